"""The training process's end of its supervisor pipe (in-process recovery).

Under ``python -m baft.inprocess`` (see :mod:`baft.inprocess`) every rank's training code
runs in a child of a small supervisor, and the two talk over a Unix pipe (never TCP:
an abort shuts TCP sockets down, see below) in the messages of :mod:`.messages`.

- **down**: :class:`~.messages.Announce` ("the job moved to generation ``g``; its c10d
  store listens on ``port``"). A reader thread takes it, marks the recovery pending and
  at once aborts this process's communication of the old generation by shutting down
  the TCP sockets the training function opened (:func:`baft.inprocess.sockets.shutdown_tcp`):
  whatever the main thread is blocked in (a gloo collective, a pipeline receive, the
  store) raises, and :func:`baft.inprocess.run.run` re-enters the training function in
  generation ``g``. A training thread that has not taken it within
  ``InprocessTimeouts.stuck_s`` is hung off any socket: the channel says so
  (:class:`~.messages.Stuck`) and the supervisor replaces the process.
- **up**: the other messages, sent by the methods below.

:class:`Channel` is the :class:`baft.liveness.generation.Link` the library sees; it also
holds a SIGTERM that comes between two generations (:class:`SigtermHold`) for the next
one's engine to flush.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from baft.config import InprocessTimeouts
from baft.inprocess import messages as msg
from baft.inprocess.policy import Elastic
from baft.inprocess.sockets import shutdown_tcp, tcp_inodes
from baft.liveness.generation import GENERATION_ENV, Generation
from baft.liveness.loader import keep_loader_workers_through_sigterm
from baft.liveness.termination import die_of_sigterm

log = logging.getLogger("baft")


class Channel:
    """The child's end of the supervisor pipe (a ``multiprocessing`` Connection); the
    :class:`baft.liveness.generation.Link` the library reports to."""

    def __init__(
        self,
        conn: Any,
        generation: Generation,
        rank: int,
        *,
        timeouts: InprocessTimeouts | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.conn = conn
        self.timeouts = timeouts or InprocessTimeouts.from_env()
        self._on_lost = on_lost or _die
        self.rank = rank
        self.generation = generation
        self.spawned_in = generation.number
        """The generation this process started in (> 0: it replaced a failed one)."""
        self.entered_at = time.time()
        """Wall time this process (re-)entered the training function."""
        self._keep = tcp_inodes()
        self._lock = threading.Lock()
        self._pending: Generation | None = None
        self._arrived = threading.Event()
        self._progressed = -1
        self.close_agreed: bool | None = None
        """Whether the last ``ft.close()`` of this generation agreed on the job's end
        (None: no close yet)."""
        self.hold: SigtermHold | None = None
        """The SIGTERM hold :meth:`hold_sigterm` installed (main thread, once)."""
        self._reader = threading.Thread(target=self._read, name="baft-channel", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ child -> supervisor
    def _send(self, message: msg.Up) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError) as e:  # the supervisor is gone: it takes us along
                log.debug("baft channel: send failed: %s", e)

    def progress(self) -> None:
        """An iteration completed in this generation (sent once per generation)."""
        g = self.generation.number
        if self._progressed != g:
            self._progressed = g
            self._send(msg.Progress(g))

    def failed(self, reason: str) -> None:
        self._send(msg.Failed(self.generation.number, reason))

    def suspect(self, ranks: list[int], reason: str) -> None:
        self._send(msg.Suspect(self.generation.number, tuple(sorted(ranks)), reason))

    def elastic(self, num_replicas: int, model_ranks: int) -> None:
        self._send(Elastic(num_replicas, model_ranks))

    def ended(self) -> None:
        """The training function returned after the job's agreed end."""
        self._send(msg.Ended(self.generation.number))

    def refused(self, reason: str) -> None:
        self._send(msg.Refused(self.generation.number, reason))

    def closed(self, agreed: bool) -> None:
        """``ft.close()`` ran in this generation; ``agreed``: every rank ended with it."""
        self.close_agreed = agreed

    def keep_connections(self) -> None:
        """The TCP connections this process holds now stay through every abort: those the
        script opened before its training function (a metrics or data-service client at
        module level); only what the training function opens belongs to a generation."""
        self._keep = tcp_inodes()

    # ------------------------------------------------------------------ SIGTERM between generations
    def hold_sigterm(self) -> None:
        """Hold SIGTERM for this process's life between engines (see :class:`SigtermHold`).
        From the main thread; a no-op elsewhere or when already installed."""
        if self.hold is not None or threading.current_thread() is not threading.main_thread():
            return
        self.hold = SigtermHold(self.timeouts.hold_sigterm_s)
        signal.signal(signal.SIGTERM, self.hold.handle)
        keep_loader_workers_through_sigterm()

    def take_held_sigterm(self) -> bool:
        return self.hold is not None and self.hold.take()

    def hold_sigterm_again(self) -> None:
        if self.hold is not None:
            self.hold.give_back()

    # ------------------------------------------------------------------ supervisor -> child
    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the supervisor is gone: so is this rank
                log.error("baft: the supervisor of rank %d is gone: leaving", self.rank)
                self._on_lost()
                return
            if not isinstance(message, msg.Announce):
                continue
            gen = message.generation
            with self._lock:
                if gen.number <= self.generation.number:
                    continue
                self._pending = gen
            n = shutdown_tcp(self._keep)
            _abort_nccl()
            log.info(
                "baft: generation %d (%s): aborted this rank's %d connections of generation %d",
                gen.number, gen.cause, n, self.generation.number,
            )  # fmt: skip
            self._arrived.set()
            self._keep_aborting()

    def _keep_aborting(self) -> None:
        """Until the main thread takes the new generation, a connection it opens for the
        old one (a rendezvous it was entering) is shut down too, so it cannot wait there.
        A main thread that has not taken it after ``stuck_s`` is hung off any socket (a
        stuck read, a deadlock, a sleep): this rank says so and its supervisor replaces
        the process (its watchdog still beats, so no peer names it)."""
        stuck_s = self.timeouts.stuck_s
        deadline: float | None = time.monotonic() + stuck_s
        while True:
            with self._lock:  # enter() takes the lock: no shutdown after it returned
                pending = self._pending
                if pending is None:
                    return
                shutdown_tcp(self._keep)
            if deadline is not None and time.monotonic() > deadline:
                deadline = None
                log.error(
                    "baft: the training thread of rank %d has not taken generation %d within "
                    "%.1f s (hung off any socket): its supervisor replaces this process",
                    self.rank, pending.number, stuck_s,
                )  # fmt: skip
                self._send(msg.Stuck(pending.number))
            try:
                if self.conn.poll(0.05):  # a newer message: read it
                    return
            except (EOFError, OSError):
                return

    def pending(self) -> Generation | None:
        with self._lock:
            return self._pending

    def wait_for_generation(self, timeout_s: float | None) -> bool:
        """Whether a new generation was announced (waiting up to ``timeout_s``)."""
        return self._arrived.wait(timeout_s)

    def abort_again(self) -> None:
        """Shut down what the old generation still holds (sockets opened after the abort)."""
        shutdown_tcp(self._keep)

    def enter(self) -> Generation:
        """Move to the announced generation: its store becomes ``MASTER_PORT``."""
        with self._lock:
            gen, self._pending = self._pending, None
            self._arrived.clear()
        assert gen is not None, "enter() without an announced generation"
        self.generation = gen
        self.close_agreed = None
        self.entered_at = time.time()
        enter_environment(gen)
        self.rank = int(os.environ.get("RANK", self.rank))
        self._send(msg.Entered(gen.number))
        return gen


def enter_environment(gen: Generation) -> None:
    """What ``init_process_group`` reads in generation ``gen``: its store as
    ``MASTER_PORT``, and the rank and world of a job that shrank (:attr:`Generation.env`)."""
    os.environ.update(dict(gen.env))
    os.environ["MASTER_PORT"] = str(gen.port)
    os.environ[GENERATION_ENV] = str(gen.number)


class SigtermHold:
    """The process-wide SIGTERM handler between two generations' engines: a SIGTERM that
    comes while no :class:`~baft.liveness.termination.Termination` is installed (during a
    recovery) is held until the next engine's takes it over (its flush then follows the
    restore); the process leaves if none does within ``hold_s``. One per process: a
    signal's disposition is process-wide state, so this is too."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.pid = os.getpid()
        self.pending = False
        """A SIGTERM came and no :class:`Termination` has taken it over yet."""
        self._taken = threading.Event()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid or self.pending:  # a forked DataLoader worker: not ours
            return
        log.warning("SIGTERM: held for the next generation's flush (at most %.0f s)", self.hold_s)
        self.pending = True
        self._taken.clear()
        threading.Thread(target=self._expire, name="baft-sigterm-hold", daemon=True).start()

    def _expire(self) -> None:
        if not self._taken.wait(self.hold_s):
            die_of_sigterm(f"no engine took the held SIGTERM over within {self.hold_s:.0f} s")

    def take(self) -> bool:
        """A :class:`Termination` takes the SIGTERM over; whether one was pending."""
        was, self.pending = self.pending, False
        self._taken.set()
        return was

    def give_back(self) -> None:
        """A :class:`Termination` that had the SIGTERM was uninstalled unflushed (an
        in-process recovery began): hold it again for the next one."""
        if not self.pending:
            self.handle(signal.SIGTERM, None)


def _abort_nccl() -> None:
    """NCCL collectives do not wait on the sockets shut down above: abort the NCCL
    communicators with torch's abort (as NVRx's in-process restart does). Jobs without
    NCCL (gloo, CPU) skip it. Untested here: this machine has no GPU."""
    try:
        import torch.distributed as dist

        if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
            dist.distributed_c10d._abort_process_group()
    except Exception as e:  # noqa: BLE001 - best effort: the bounded waits remain
        log.warning("baft: aborting the NCCL groups failed: %s", e)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
