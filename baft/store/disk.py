"""The disk tier: snapshot versions as standard DCP checkpoints, beside the memory tier.

Every N committed versions the engine hands one version's flat state (canonical FQNs,
tensors that are views of snapshot buffers, DTensors for TP shards) to a
:class:`Persister`. A dedicated thread writes it with ``torch.distributed.checkpoint.save``
and a ``FileSystemWriter`` over a dedicated (gloo) process group, so the result loads
with plain ``dcp.load`` into a fresh model and optimizer, in any shard layout: the keys
follow torch's conventions (:mod:`baft.store.keys`), DTensor pieces keep their global
placements, and non-tensor values (torch's flattened ``param_groups``) are plain data.

Layout under ``directory``::

    v00000012/            a DCP checkpoint (.metadata, __<rank>_0.distcp)
    v00000012/baft_meta.json   caller metadata, written by the coordinator
    v00000012/.complete   commit marker: every rank finished, metadata written
    latest                "12": the newest complete version (atomically replaced)

A checkpoint counts only once its ``.complete`` exists; the coordinator (rank 0 of the
group) writes it, then replaces ``latest``, then tells every rank the outcome. A crash
at any point leaves either the previous ``latest`` or a complete new checkpoint.
Deleting goes the other way round (marker first), so a half-deleted checkpoint is a
partial one. Saves are collective: every rank calls :meth:`Persister.save_async` for
the same versions in the same order.

Recovery loads from here (:func:`load_version`) as it reads the memory tier
(:mod:`baft.store.shm`). TP shards are saved and loaded as the DTensors they belong to,
described by a :class:`ShardLayout` (``baft.pipeline.layout.GlobalLayout`` is one), so
this tier imports nothing above the store.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.tensor import DTensor

from baft.store.keys import (  # noqa: F401 - re-exported: the disk tier's key schemes
    KEYS_META,
    PersistKeys,
    check_persist_keys,
    choose_persist_keys,
    loading_keys,
    persist_name,
)

COMPLETE_MARKER = ".complete"
"""File inside a version directory that marks the checkpoint complete."""
LATEST_FILE = "latest"
"""File in the checkpoint root holding the newest complete version as decimal text."""
META_FILE = "baft_meta.json"
"""Caller metadata next to the DCP files, written by the coordinator."""
META_FORMAT = 1
"""Format number stored in ``baft_meta.json``."""

_log = logging.getLogger(__name__)
_VERSION_DIR = re.compile(r"^v(\d{8,})$")


class ShardLayout(Protocol):
    """Where a rank-local tensor sits in its DTensor (a TP shard): what the disk tier
    needs to save and load it as that DTensor. :class:`baft.pipeline.layout.GlobalLayout`
    is one."""

    @property
    def mesh(self) -> Any: ...
    @property
    def placements(self) -> tuple[Any, ...]: ...
    @property
    def shape(self) -> torch.Size: ...
    @property
    def stride(self) -> tuple[int, ...]: ...


def as_dtensors(
    state: Mapping[str, torch.Tensor], layouts: Mapping[str, ShardLayout]
) -> dict[str, torch.Tensor]:
    """``state`` with every plain tensor named in ``layouts`` wrapped, without a copy or a
    collective, as the DTensor whose local shard it is. baft snapshots rank-local bytes;
    DCP must see TP shards as DTensors, else the shards of one tensor are same-named
    plain tensors and DCP keeps one of them (every other TP rank restores its bytes)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        g = layouts.get(key)
        out[key] = (
            t
            if g is None or isinstance(t, DTensor)
            else DTensor.from_local(
                t, g.mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride
            )
        )
    return out


def version_dir(directory: str | Path, version: int) -> Path:
    """Directory of ``version`` under ``directory`` (``v{version:08d}``)."""
    return Path(directory) / f"v{version:08d}"


def _scan(directory: Path) -> tuple[list[int], list[int]]:
    """(complete, partial) versions found under ``directory``, each ascending."""
    complete: list[int] = []
    partial: list[int] = []
    if not directory.is_dir():
        return complete, partial
    for entry in directory.iterdir():
        match = _VERSION_DIR.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        version = int(match.group(1))
        is_complete = (entry / COMPLETE_MARKER).is_file()
        (complete if is_complete else partial).append(version)
    return sorted(complete), sorted(partial)


def list_versions(directory: str | Path) -> list[int]:
    """Versions under ``directory`` that are complete checkpoints, ascending."""
    return _scan(Path(directory))[0]


def latest_version(directory: str | Path) -> int | None:
    """The version named by the ``latest`` marker, or None when nothing is complete.

    The marker is trusted only when its version is complete; if it is missing, garbled
    or points at a deleted or partial directory, the newest complete version is
    returned instead.
    """
    root = Path(directory)
    try:
        marked: int | None = int((root / LATEST_FILE).read_text().strip())
    except (OSError, ValueError):
        marked = None
    if marked is not None and (version_dir(root, marked) / COMPLETE_MARKER).is_file():
        return marked
    complete = list_versions(root)
    return complete[-1] if complete else None


def select_prunable(complete: list[int], partial: list[int], keep_latest: int) -> list[int]:
    """Versions to delete: complete ones beyond the newest ``keep_latest``, and
    partial ones older than the newest complete (pure; inputs need not be sorted)."""
    if keep_latest < 1:
        raise ValueError(f"keep_latest must be >= 1, got {keep_latest}")
    ordered = sorted(complete)
    if not ordered:
        return []
    doomed = ordered[:-keep_latest]
    doomed += [v for v in partial if v < ordered[-1]]
    return sorted(doomed)


def read_metadata(directory: str | Path, version: int) -> dict[str, Any]:
    """Caller metadata stored with ``version`` ({} when the file is absent)."""
    path = version_dir(directory, version) / META_FILE
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    meta = record.get("metadata", {})
    assert isinstance(meta, dict), f"corrupt {path}"
    return meta


def load_version(
    directory: str | Path,
    version: int,
    state: dict[str, torch.Tensor],
    process_group: ProcessGroup | None = None,
    layouts: Mapping[str, ShardLayout] | None = None,
) -> dict[str, Any]:
    """Load complete checkpoint ``version`` in place into ``state``; return its metadata.

    ``layouts``: keys whose rank-local tensors are DTensor shards, loaded as those
    DTensors (see :attr:`Persister.layouts`).

    Plain ``dcp.load``: without an initialized default group it loads in this process
    alone; otherwise it is collective over ``process_group`` (default: the world).
    """
    complete = list_versions(directory)
    if version not in complete:
        raise ValueError(
            f"version {version} is not a complete checkpoint in {directory}; "
            f"pick one of {complete} (see latest_version())"
        )
    wanted = as_dtensors(state, layouts or {})
    check_against_metadata(wanted, directory, version)
    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.load(
        wanted,
        storage_reader=FileSystemReader(version_dir(directory, version)),
        process_group=process_group,
        no_dist=no_dist,
    )
    return read_metadata(directory, version)


def check_against_metadata(
    state: Mapping[str, torch.Tensor], directory: str | Path, version: int
) -> None:
    """Raise ValueError naming every key of ``state`` that checkpoint ``version`` lacks or
    holds with another global shape or dtype (DTensors by their global shape); before a
    byte is read. DCP itself refuses a missing key or another size, but would convert
    another dtype silently; this names all of them at once."""
    saved = FileSystemReader(version_dir(directory, version)).read_metadata()
    problems: list[str] = []
    for key, t in state.items():
        md = saved.state_dict_metadata.get(key)
        if md is None:
            problems.append(f"{key} (absent)")
            continue
        size, props = getattr(md, "size", None), getattr(md, "properties", None)
        if size is None or props is None:
            problems.append(f"{key} (saved as an object, not a tensor)")
        elif tuple(size) != tuple(t.shape) or props.dtype != t.dtype:
            problems.append(
                f"{key} (saved {props.dtype}{list(size)}, now {t.dtype}{list(t.shape)})"
            )
    if problems:
        shown = "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
        raise ValueError(
            f"{version_dir(directory, version)} does not hold this job's tensors "
            f"({len(problems)} differ): {shown}; nothing was loaded"
        )


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


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as ``tensor`` behind a storage of exactly its size, if possible.

    DCP's writer clones any CPU tensor whose storage is larger than the tensor (so
    ``torch.save`` does not write the whole snapshot buffer); a zero-copy re-wrap of
    the view avoids that copy. Anything else is returned unchanged.
    """
    if (
        tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.numel() == 0
        or tensor.untyped_storage().nbytes() == tensor.nbytes
    ):
        return tensor
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        tensor.element_size()
    )
    if carrier is None or tensor.is_complex() or tensor.is_quantized:
        return tensor
    try:
        raw = tensor.detach().view(carrier).numpy()
    except (RuntimeError, TypeError):  # e.g. a lazy negation view; DCP will clone
        return tensor
    return torch.from_numpy(raw).view(tensor.dtype)


def _compact_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, value in state.items():
        if isinstance(value, DTensor):
            local = value.to_local()
            compact = _compact(local)
            out[fqn] = (
                value
                if compact is local
                else DTensor.from_local(
                    compact,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
            )
        elif isinstance(value, torch.Tensor):
            out[fqn] = _compact(value)
        else:  # a plain value (optimizer.param_groups.*): DCP pickles it
            out[fqn] = value
    return out


PLAIN_VALUES = (bool, int, float, str, type(None))
"""Non-tensor values a checkpoint may hold (also inside tuples and lists)."""


def _plain(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, *PLAIN_VALUES)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


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
        self._jobs: queue.Queue[_Job | object] = queue.Queue()
        self._thread: threading.Thread | None = None
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
            if not isinstance(fqn, str) or not _plain(value):
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

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            assert isinstance(job, _Job)
            try:
                self._save(job)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                job.future.set_exception(e)
            else:
                job.future.set_result(None)
            finally:
                job.state = {}

    def _save(self, job: _Job) -> None:
        target = version_dir(self.directory, job.version)
        if self.is_coordinator:
            target.mkdir(parents=True, exist_ok=True)
            # Re-saving a version: it stops being complete before any byte changes.
            (target / COMPLETE_MARKER).unlink(missing_ok=True)
        dcp.save(
            _compact_state(job.state),
            storage_writer=FileSystemWriter(
                target, single_file_per_rank=True, sync_files=True, overwrite=True
            ),
            process_group=self._group,
            no_dist=not self._distributed,
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
        complete, partial = _scan(self.directory)
        for version in select_prunable(complete, partial, self.keep_latest):
            path = version_dir(self.directory, version)
            try:
                (path / COMPLETE_MARKER).unlink(missing_ok=True)
                _fsync_dir(path)
                shutil.rmtree(path)
            except OSError as e:
                _log.warning("could not delete old checkpoint %s: %s", path, e)
