"""Background protect work of one rank: chunk checksums and redundancy sends.

A SNAPSHOT copy must read live tensors before the optimizer step, so the executor runs it
on the main thread at its slot. What follows from it (hashing the copied chunk, sending it
to its redundancy holders) only reads the snapshot buffer and goes to this worker.

Where the worker may run is a gate. When the host CPU is also the compute device (CPU
training), the gate is open only while the main thread is blocked in a pipeline wait:
protect work then uses the cores the pipeline leaves idle, item by item, and stops as
soon as compute resumes (the reference measurements show a blocked gloo wait sleeps and
releases the GIL). With an accelerator doing the compute the host is idle anyway and the
gate stays open. ``drain`` opens the gate and waits for everything queued: what is left
there is exposed time. The thread runs at idle CPU priority (:mod:`baft.engine.priority`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

from baft.engine.priority import lower_thread_priority, raised


class ProtectWorker:
    """A single background thread running queued items while its gate is open."""

    def __init__(self, *, gated: bool, name: str = "baft-protect") -> None:
        self.gated = gated
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._gate = threading.Event()
        if not gated:
            self._gate.set()
        self._error: BaseException | None = None
        self._idle = False
        self._native_id = 0
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def submit(self, item: Callable[[], None]) -> None:
        self._queue.put(item)

    def open(self) -> None:
        """The main thread is about to block: protect work may run."""
        self._gate.set()

    def close(self) -> None:
        """The main thread computes again: no new item starts (gated mode)."""
        if self.gated:
            self._gate.clear()

    def boosted(self) -> contextlib.AbstractContextManager[None]:
        """The caller waits for the worker: it runs at normal priority meanwhile (an
        idle-priority thread that the training thread waits on is a priority inversion:
        any runnable thread of another rank starves it)."""
        return raised(self._native_id, self._idle)

    def drain(self) -> None:
        """Run everything queued now and wait for it; re-raises a worker failure."""
        self._gate.set()
        with self.boosted():
            self._queue.join()
        self.close()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("background checkpoint work failed") from err

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._gate.set()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self, started: threading.Event) -> None:
        self._native_id = threading.get_native_id()
        self._idle = lower_thread_priority()
        started.set()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._gate.wait()
                if self._error is None:
                    item()
            except BaseException as e:  # noqa: BLE001 - reported by drain()
                self._error = e
            finally:
                self._queue.task_done()
