"""Housekeeping of job stores on a host: stores left by an earlier rank numbering, stores
of jobs nobody holds, and (fault injection) a node's or a job's stores removed.

Everything here works on directories under a store root; one rank's store itself is
:class:`baft.store.shm.SnapshotStore`. A job's stores are freed only when no live process
holds them (the allocation lock of every rank directory is free, see
:meth:`baft.store.versions.VersionLog.open_progress`) and nobody wrote to them for a while
(:func:`reclaim_stale_jobs`): deleting a running job's store would lose its snapshots.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

from baft.store.paths import PROGRESS_FILE, find_stores, is_job_dir, job_path, node_path
from baft.store.shm import DEFAULT_ROOT, SnapshotStore
from baft.store.versions import or_none


def reclaim_foreign(
    root: Path, job_id: str, own: set[tuple[int, int]], newer_than: int
) -> list[Path]:
    """Remove the job's stores under ``root`` other than the ``own`` ``(node, rank)``
    directories when they hold nothing newer than ``newer_than`` (call after the
    job's own stores committed ``newer_than``: copies kept from a restore are then
    provably unneeded). Returns what was removed."""
    removed = []
    for a in find_stores(job_path(root, job_id)):
        if (a.node, a.rank) in own:
            continue
        store = SnapshotStore(a.root, a.job_id, a.node, a.rank, 0)
        versions = [or_none(store.read_manifest, s) for s in range(store.num_slots)]
        if all(m is None or m.version <= newer_than for m in versions):
            store.destroy()
            removed.append(store.path)
    return removed


def reclaim_stale_jobs(
    root: Path = DEFAULT_ROOT, idle_s: float = 3600.0, *, keep_job_id: str | None = None
) -> list[Path]:
    """Remove every job's stores under ``root`` that belong to no live job: no live process
    holds them (the allocation lock is free in every rank directory) and nobody changed
    their files for ``idle_s`` seconds (a job between torchrun restarts holds no lock for
    a moment, but was written to moments ago). ``keep_job_id``: a job never removed (the
    caller's own). Only directories that look like job stores (children all ``node<N>``)
    are touched. Returns the job directories removed."""
    removed: list[Path] = []
    root = Path(root)
    if not root.is_dir():
        return removed
    now = time.time()
    for job in sorted(root.iterdir()):
        if job.name == keep_job_id or job.is_symlink() or not is_job_dir(job):
            continue
        files = [f for f in job.rglob("*") if f.is_file()]
        newest = max((f.stat().st_mtime for f in files), default=0.0)
        if now - newest < idle_s or any(_locked(f) for f in files if f.name == PROGRESS_FILE):
            continue
        shutil.rmtree(job, ignore_errors=True)
        removed.append(job)
    return removed


def reclaim_other_jobs(root: Path, keep_job_id: str, idle_s: float = 3600.0) -> list[Path]:
    """Remove stores of jobs other than ``keep_job_id`` under ``root`` that no live process
    holds and nobody changed for ``idle_s`` seconds (see :func:`reclaim_stale_jobs`).
    Returns the job directories removed."""
    return reclaim_stale_jobs(root, idle_s, keep_job_id=keep_job_id)


def remove_node(root: Path, job_id: str, node: int) -> None:
    """Remove every rank store of one node of a job (simulates losing the node)."""
    shutil.rmtree(node_path(root, job_id, node), ignore_errors=True)


def remove_job(root: Path, job_id: str) -> None:
    """Remove every store of a job (simulates losing all host memory)."""
    shutil.rmtree(job_path(root, job_id), ignore_errors=True)


def _locked(path: Path) -> bool:
    """Whether some live process holds the store lock on ``path`` (see
    :meth:`baft.store.versions.VersionLog.open_progress`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's own lock
    return False
