"""The disk tier's writer process, seen from the training process.

:class:`ProcessPersister` is a :class:`~baft.store.disk.Persister` whose periodic saves run
in a separate process (:mod:`baft.store.disk_writer`), started once when the engine is
built: DCP's planning, pickling and writing then hold that process's GIL and CPU (at idle
priority), not the training process's. The tensors it is handed must live in shared
files (the committed store slot's typed views, or :meth:`ProcessPersister.host_buffer`),
which the child maps; anything else is pickled to it. A client thread here sends each
save and completes its :class:`~baft.store.disk.SaveHandle` when the child answers.

Saves made after ``background`` is set False (the SIGTERM flush, just before the process
exits) take the in-process path of the base class, over the group it was given.
:meth:`abort` (an in-process recovery abandoning the generation) kills the child without
a collective; the child also dies with its parent.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from baft.store.disk import _STOP, Persister, SaveHandle, _Job, run_jobs
from baft.store.disk_writer import describe, describe_layouts

log = logging.getLogger("baft")
BUFFER_NAME = "persist_copy.buf"
"""The differential live copy's shared file, in the rank's store directory."""


def store_address() -> tuple[str, int] | None:
    """Host and port of the TCPStore under the default process group's store (the job's
    c10d store: torchrun's, or in-process recovery's generation store), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store: Any = dist.distributed_c10d._get_default_store()
    while not isinstance(store, dist.TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (host, int(port)) if host and port else None


def agree_prefix(group: ProcessGroup | None) -> str:
    """A store prefix every rank's writer process meets under, fresh for this build (rank
    0's random token). Collective over ``group``."""
    box = [f"baft-writer/{uuid.uuid4().hex}"]
    if dist.is_available() and dist.is_initialized():
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(box, src=src, group=group)
    return str(box[0])


class ProcessPersister(Persister):
    """A :class:`Persister` whose background saves a writer process runs.

    ``prefix``: the store prefix of the writers' group (:func:`agree_prefix`, the same on
    every rank); ``buffer_dir``: where :meth:`host_buffer` makes its shared file (the
    rank's store directory); ``idle``: start the child at idle CPU priority. The other
    arguments are the base class's; its ``process_group`` serves the SIGTERM flush."""

    def __init__(
        self,
        directory: str | Path,
        *,
        prefix: str,
        buffer_dir: str | Path,
        idle: bool = True,
        keep_latest: int = 2,
        process_group: ProcessGroup | None = None,
        rank: int,
        timeout_s: float = 300.0,
        release_group: Callable[[ProcessGroup], None] | None = None,
        on_thread_start: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(
            directory, keep_latest=keep_latest, process_group=process_group, rank=rank,
            timeout_s=timeout_s, release_group=release_group, on_thread_start=on_thread_start,
        )  # fmt: skip
        self.buffer_dir = Path(buffer_dir)
        world = dist.get_world_size(process_group) if self._distributed else 1
        address = store_address() if self._distributed else None
        if self._distributed and address is None:
            raise RuntimeError(
                "PersistConfig(writer='process') needs the job's c10d store to be a "
                "TCPStore (torchrun, or init_process_group with a TCPStore); use "
                "writer='thread'"
            )
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
        fd = theirs.fileno()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "baft.store.disk_writer", str(fd)],
            pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        # lowered here, before the child runs a line (one thread yet): were it to lower
        # itself, a waiter's boost could come first and the child stay idle through the
        # wait; its import of torch then starved behind any busy core (a DataLoader)
        self.lowered = idle and _set_policy(self._proc.pid, idle=True)
        self._boosts = 0
        self._boost_lock = threading.Lock()
        self._conn.send(
            {
                "parent": os.getpid(), "idle": idle and not self.lowered,
                "rank": rank, "world": world,
                "host": address[0] if address else None,
                "port": address[1] if address else 0, "prefix": prefix,
                "directory": str(self.directory), "keep_latest": keep_latest,
                "timeout_s": timeout_s,
            }
        )  # fmt: skip
        self._requests: queue.Queue[_Job | object] = queue.Queue()
        self._failed = ""
        """Why the writer process is gone (empty while it serves)."""
        self._client = threading.Thread(
            target=self._serve, name=f"baft-persist-client-{rank}", daemon=True
        )
        self._client.start()
        self._buffer: tuple[mmap.mmap, torch.Tensor] | None = None
        self.inline_bytes = 0
        """Bytes of the last request that lived in no shared file (sent pickled)."""

    @property
    def pid(self) -> int:
        """The writer process's pid."""
        return self._proc.pid

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A byte tensor of ``nbytes`` in a shared file the writer process can map (the
        differential live copy's buffer); reused while the size stays."""
        if self._buffer is not None and self._buffer[1].numel() == nbytes:
            return self._buffer[1]
        self.buffer_dir.mkdir(parents=True, exist_ok=True)
        path = self.buffer_dir / BUFFER_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        buf = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
        self._buffer = (mm, buf)
        return buf

    def save_async(
        self, version: int, state: dict[str, Any], metadata: dict[str, Any] | None = None
    ) -> SaveHandle:
        """As :meth:`Persister.save_async`, written by the writer process (in this process
        once ``background`` is False: the SIGTERM flush)."""
        if not self.background:
            return super().save_async(version, state, metadata)
        if self._closed:
            raise RuntimeError("Persister is shut down; create a new one to save")
        self._check_args(version, state, metadata)
        self._last_version = version
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        self._requests.put(
            _Job(version=version, state=dict(state), metadata=metadata or {}, future=future)
        )
        return SaveHandle(version, future, self.timeout_s)

    def _serve(self) -> None:
        """The client thread: one request at a time, in order, each answered by the child."""
        ready = self._receive()
        if ready is not None and ready[0] != "ready":
            self._failed = f"writer process failed to start: {ready[2]}"
        run_jobs(self._requests, self._save_remote, self._stop_writer)

    def _stop_writer(self) -> None:
        if not self._failed:
            try:
                self._conn.send(("stop",))
                self._receive()
            except OSError:
                pass

    def _save_remote(self, job: _Job) -> None:
        if self._failed:
            raise RuntimeError(self._failed)
        layouts, state = describe_layouts(self.layouts, job.state)
        entries, inline = describe(state)
        self.inline_bytes = inline
        if inline:
            log.debug("v%d: %d B of the state sent to the writer pickled", job.version, inline)
        # plain pickle, by value: Connection.send's ForkingPickler would hand a tensor over
        # as a shared-memory handle whose fd torch passes through multiprocessing's
        # resource sharer, which refuses a process not started by multiprocessing
        self._conn.send_bytes(
            pickle.dumps(("save", job.version, entries, job.metadata, layouts), protocol=5)
        )
        reply = self._receive()
        if reply is None:
            raise RuntimeError(self._failed)
        kind, version, text = reply
        if kind != "done" or version != job.version:
            if kind == "failed":
                self._failed = f"writer process failed: {text}"
            raise RuntimeError(f"persisting version {job.version} failed: {text}")

    def _receive(self) -> tuple[str, int, str] | None:
        """The child's next answer, or None (``_failed`` says why) once it is gone."""
        try:
            reply: tuple[str, int, str] = self._conn.recv()
            return reply
        except (EOFError, OSError):
            code = self._proc.wait()
            self._failed = self._failed or f"writer process {self._proc.pid} exited ({code})"
            return None

    @property
    def native_id(self) -> int | None:
        return None  # boosting goes through :meth:`boosted`

    @contextmanager
    def boosted(self) -> Iterator[None]:
        """While the caller waits for a save: the writer process at normal priority."""
        if not self.lowered:
            yield
            return
        with self._boost_lock:  # nestable: the outermost waiter lowers it again
            self._boosts += 1
            if self._boosts == 1:
                _set_policy(self._proc.pid, idle=False)
        try:
            yield
        finally:
            with self._boost_lock:
                self._boosts -= 1
                if self._boosts == 0:
                    _set_policy(self._proc.pid, idle=True)

    def abort(self) -> None:
        """Stop at once, without a collective (the generation is abandoned): kill the
        writer process; a save in flight fails, its checkpoint stays incomplete."""
        self._closed = True
        self._failed = self._failed or "writer process stopped (abort)"
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        self._proc.wait()
        self._requests.put(_STOP)
        self._client.join(10.0)
        self._conn.close()
        self._drop_buffer()
        super().shutdown(timeout_s=1.0)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Finish the queued saves, stop the writer process (killed if it is still
        running after ``timeout_s``), then the base class's thread and group."""
        if not self._closed or self._client.is_alive():
            self._closed = True
            self._requests.put(_STOP)
            with self.boosted():
                self._client.join(timeout_s)
                try:
                    self._proc.wait(timeout_s if not self._client.is_alive() else 0.1)
                except subprocess.TimeoutExpired:
                    pass
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._conn.close()
            self._drop_buffer()
            if self._client.is_alive():
                raise TimeoutError(f"DCP writer process still writing after {timeout_s} s")
        super().shutdown(timeout_s)

    def _drop_buffer(self) -> None:
        if self._buffer is not None:
            mm, _ = self._buffer
            self._buffer = None
            try:
                mm.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass
            (self.buffer_dir / BUFFER_NAME).unlink(missing_ok=True)


def _set_policy(pid: int, *, idle: bool) -> bool:
    """Every thread of process ``pid`` to ``SCHED_IDLE`` or ``SCHED_OTHER``."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    done = False
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done = True
        except OSError:
            continue
    return done
