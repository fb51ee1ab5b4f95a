"""The disk tier: snapshot versions as standard DCP checkpoints, beside the memory tier.

Every N committed versions the engine hands one version's flat state (canonical FQNs,
tensors that are views of snapshot buffers, DTensors for TP shards) to a
:class:`Persister`. A dedicated thread writes it with ``torch.distributed.checkpoint.save``
and a ``FileSystemWriter`` over a dedicated (gloo) process group, so the result loads
with plain ``dcp.load`` into a fresh model and optimizer, in any shard layout: the keys
follow torch's conventions (:mod:`baft.store.keys`), DTensor pieces keep their global
placements, and non-tensor values (torch's flattened ``param_groups``) are plain data.

The directory layout (``v00000012/`` with its ``.complete`` marker, ``latest``) and which
versions are complete: :mod:`baft.store.disk_layout`. A checkpoint counts only once its
``.complete`` exists; the coordinator (rank 0 of the group) writes it, then replaces
``latest``, then tells every rank the outcome. A crash at any point leaves either the
previous ``latest`` or a complete new checkpoint. Deleting goes the other way round
(marker first), so a half-deleted checkpoint is a partial one. Saves are collective: every rank calls :meth:`Persister.save_async` for
the same versions in the same order.

Recovery loads from here (:func:`~baft.store.dcp_state.load_version`) as it reads the
memory tier (:mod:`baft.store.shm`). TP shards are saved and loaded as the DTensors they
belong to, described by a :class:`~baft.store.dcp_state.ShardLayout`
(``baft.pipeline.layout.GlobalLayout`` is one), so this tier imports nothing above the
store. This module is the writer: :class:`Persister` and its background thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.distributed_c10d import _set_pg_timeout

from baft.store.dcp_state import (  # noqa: F401 - re-exported: callers load from here
    PLAIN_VALUES,
    SavePlanner,
    ShardLayout,
    as_dtensors,
    compact_state,
    is_plain,
    load_version,
    nested_by_head,
)
from baft.store.disk_layout import (  # noqa: F401 - re-exported: callers read the layout here
    COMPLETE_MARKER,
    LATEST_FILE,
    META_FILE,
    META_FORMAT,
    latest_version,
    list_versions,
    read_metadata,
    scan,
    select_prunable,
    version_dir,
)
from baft.store.keys import (  # noqa: F401 - re-exported: the disk tier's key schemes
    KEYS_META,
    PersistKeys,
    check_persist_keys,
    choose_persist_keys,
    loading_keys,
    persist_name,
)

log = logging.getLogger("baft")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class SaveHandle:
    """Completion of one background save; every rank gets one per version."""

    __slots__ = ("version", "_future", "_default_timeout_s")

    def __init__(self, version: int, future: Future[None], default_timeout_s: float):
        self.version = version
        """The version being saved."""
        self._future = future
        self._default_timeout_s = default_timeout_s

    def done(self) -> bool:
        """True once the save finished (successfully or not) on this rank."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is complete on every rank.

        ``timeout`` defaults to the persister's ``timeout_s``. Raises ``TimeoutError``
        when it runs out (the save goes on), or the error the save failed with.
        """
        limit = self._default_timeout_s if timeout is None else timeout
        try:
            self._future.result(timeout=limit)
        except TimeoutError:
            if self._future.done():
                raise
            raise TimeoutError(
                f"persisting version {self.version} did not finish within {limit} s"
            ) from None


@dataclass(kw_only=True, slots=True)
class _Job:
    version: int
    """Version to write."""
    state: dict[str, Any]
    """Flat state (tensors, and plain values), unchanged until the job finishes."""
    metadata: dict[str, Any]
    """Caller metadata (JSON-able)."""
    future: Future[None]
    """Completed by the worker."""


_STOP = object()


class Persister:
    """Writes versions as DCP checkpoints on one background thread, in call order.

    ``rank`` is this process's rank in ``process_group`` (rank 0 coordinates). Pass a
    dedicated gloo group: the writer thread runs collectives on it while training
    uses its own groups. With no group and no initialized default group, saves run
    in this process alone. ``timeout_s`` is the default limit of
    :meth:`SaveHandle.wait` and of the given group's collectives. ``release_group``:
    :meth:`shutdown` hands ``process_group`` to it (one made for this persister alone:
    the transport's ``destroy_group``) and drops its own reference.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_latest: int = 2,
        process_group: ProcessGroup | None = None,
        rank: int,
        timeout_s: float = 300.0,
        release_group: Callable[[ProcessGroup], None] | None = None,
        on_thread_start: Callable[[], bool] | None = None,
    ) -> None:
        if keep_latest < 1:
            raise ValueError(
                f"keep_latest must be >= 1 (the newest checkpoint is never deleted), "
                f"got {keep_latest}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._distributed = dist.is_available() and dist.is_initialized()
        group_rank = dist.get_rank(process_group) if self._distributed else 0
        if rank != group_rank:
            raise ValueError(
                f"rank={rank} but this process is rank {group_rank} of the given "
                f"process group; pass rank=dist.get_rank(process_group)"
            )
        self.directory = Path(directory)
        self.keep_latest = keep_latest
        self.rank = rank
        self.timeout_s = timeout_s
        self._group = process_group
        self._release_group = release_group
        if process_group is not None and self._distributed:
            # A group made without a timeout waits torch's default (30 min on gloo) in
            # its collectives; a frozen peer must fail a save within ``timeout_s``.
            _set_pg_timeout(timedelta(seconds=timeout_s), process_group)
        self._on_thread_start = on_thread_start
        """Called first on the writer thread (the engine lowers its priority there);
        returns whether it did, see :attr:`lowered`."""
        self.lowered = False
        """Whether the writer thread runs at a lowered priority (a waiter raises it)."""
        self.background = True
        """False: a writer thread started from now on keeps normal priority (a flush
        before exit has no training to yield to)."""
        self._jobs: queue.Queue[_Job | object] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        """Set once the writer thread has set its priority: a waiter must not raise it
        before it lowers itself (it would then stay idle through the wait)."""
        self._last_version: int | None = None
        self._closed = False
        self.layouts: Mapping[str, ShardLayout] = {}
        """DCP key -> the DTensor its (rank-local) tensor is a shard of: saved as that
        DTensor (TP shards); set by the engine."""

    @property
    def is_coordinator(self) -> bool:
        """True on rank 0 of the group, which commits and prunes."""
        return self.rank == 0

    def save_async(
        self,
        version: int,
        state: dict[str, Any],
        metadata: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Queue ``state`` as checkpoint ``version`` and return at once.

        The tensors (views of snapshot buffers) must stay unchanged until the handle
        is done; other values must be plain data (:data:`PLAIN_VALUES`, e.g. torch's
        flattened ``param_groups`` entries), which DCP pickles. Versions must increase. ``metadata`` must be JSON-able; only the
        coordinator's copy is stored.
        """
        if self._closed:
            raise RuntimeError("Persister is shut down; create a new one to save")
        self._check_args(version, state, metadata)
        self._last_version = version
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        job = _Job(
            version=version,
            state=as_dtensors(state, self.layouts),
            metadata=metadata or {},
            future=future,
        )
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"baft-persister-{self.rank}", daemon=True
            )
            self._thread.start()
            self._started.wait()
        self._jobs.put(job)
        return SaveHandle(version, future, self.timeout_s)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Finish the queued saves and stop the thread; raises ``TimeoutError`` if it
        is still writing after ``timeout_s``. Idempotent."""
        self._closed = True
        thread = self._thread
        if thread is not None:
            if thread.is_alive():
                self._jobs.put(_STOP)
            thread.join(timeout_s)
            if thread.is_alive():
                raise TimeoutError(
                    f"persister thread still writing after {timeout_s} s; "
                    f"the process group timeout bounds how long it can hang"
                )
            self._thread = None
        if self._release_group is not None:
            group, self._group = self._group, None
            if group is not None:
                self._release_group(group)

    def _check_args(
        self,
        version: int,
        state: dict[str, Any],
        metadata: dict[str, Any] | None,
    ) -> None:
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(
                f"version {version} is not newer than the last saved version "
                f"{self._last_version}; persist versions in increasing order"
            )
        for fqn, value in state.items():
            if not isinstance(fqn, str) or not is_plain(value):
                raise ValueError(
                    f"state must map FQN strings to tensors or plain values; got {fqn!r}: "
                    f"{type(value).__name__}"
                )
        try:
            json.dumps(metadata or {})
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"metadata must be JSON-able (str/int/float/bool/list/dict): {e}"
            ) from e

    @property
    def native_id(self) -> int | None:
        """The writer thread's OS id (None before the first save)."""
        return self._thread.native_id if self._thread is not None else None

    def _run(self) -> None:
        try:
            if self._on_thread_start is not None and self.background:
                self.lowered = self._on_thread_start()
        finally:
            self._started.set()
        run_jobs(self._jobs, self._save)

    def _save(self, job: _Job) -> None:
        target = version_dir(self.directory, job.version)
        if self.is_coordinator:
            target.mkdir(parents=True, exist_ok=True)
            # Re-saving a version: it stops being complete before any byte changes.
            (target / COMPLETE_MARKER).unlink(missing_ok=True)
        dcp.save(
            nested_by_head(compact_state(job.state)),
            storage_writer=FileSystemWriter(
                target, single_file_per_rank=True, sync_files=True, overwrite=True
            ),
            process_group=self._group,
            no_dist=not self._distributed,
            planner=SavePlanner(),
        )
        error = ""
        if self.is_coordinator:
            try:
                self._commit(job)
            except Exception as e:  # noqa: BLE001 - reported to every rank
                error = f"{type(e).__name__}: {e}"
        if self._distributed:
            box = [error]
            src = 0 if self._group is None else dist.get_global_rank(self._group, 0)
            dist.broadcast_object_list(box, src=src, group=self._group)
            error = box[0]
        if error:
            raise RuntimeError(f"committing version {job.version} failed: {error}")
        if self.is_coordinator:
            self._prune()

    def _commit(self, job: _Job) -> None:
        target = version_dir(self.directory, job.version)
        world = dist.get_world_size(self._group) if self._distributed else 1
        record = {
            "format": META_FORMAT,
            "version": job.version,
            "num_ranks": world,
            "metadata": job.metadata,
        }
        _atomic_write_text(target / META_FILE, json.dumps(record, sort_keys=True))
        _atomic_write_text(target / COMPLETE_MARKER, f"{job.version}\n")
        _atomic_write_text(self.directory / LATEST_FILE, f"{job.version}\n")

    def _prune(self) -> None:
        """Delete old checkpoints; failures are logged, never raised (the new one is
        already complete)."""
        complete, partial = scan(self.directory)
        for version in select_prunable(complete, partial, self.keep_latest):
            path = version_dir(self.directory, version)
            try:
                (path / COMPLETE_MARKER).unlink(missing_ok=True)
                _fsync_dir(path)
                shutil.rmtree(path)
            except OSError as e:
                log.warning("could not delete old checkpoint %s: %s", path, e)


def run_jobs(
    jobs: queue.Queue[_Job | object],
    save: Callable[[_Job], None],
    on_stop: Callable[[], None] = lambda: None,
) -> None:
    """Run queued saves in order until the stop marker (then ``on_stop``), handing each
    outcome to its job's future (a writer thread here, the writer process's client thread
    in :mod:`baft.store.disk_process`)."""
    while True:
        job = jobs.get()
        if job is _STOP:
            on_stop()
            return
        assert isinstance(job, _Job)
        try:
            save(job)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            job.future.set_exception(e)
        else:
            job.future.set_result(None)
        finally:
            job.state = {}
