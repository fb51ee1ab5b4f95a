"""Housekeeping of job stores on a host: stores left by an earlier rank numbering, stores
of jobs nobody holds, and (fault injection) a node's or a job's stores removed.

Everything here works on directories under a store root; one rank's store itself is
:class:`baft.store.shm.SnapshotStore`. A job's stores are freed only when no live process
holds them (the allocation lock of every rank directory is free, see
:meth:`baft.store.versions.VersionLog.open_progress`) and nobody wrote to them for a while:
deleting a running job's store would lose its snapshots. :func:`host_jobs` lists what a
store root holds (``baft inspect``), :func:`why_kept` is the one predicate deciding
whether a job may go, and :func:`free_jobs` applies it (``baft inspect --free`` and,
through :func:`reclaim_stale_jobs`, a restore freeing other jobs' memory).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from baft.store.paths import PROGRESS_FILE, find_stores, is_job_dir, job_path, node_path
from baft.store.shm import DEFAULT_ROOT, SnapshotStore
from baft.store.versions import or_none

log = logging.getLogger("baft")

DEFAULT_IDLE_S = 3600.0
"""How long nobody must have written to a job's stores before they are freed: a job
between torchrun restarts holds no lock for a moment, but was written to moments ago."""


@dataclass(frozen=True, slots=True)
class JobStores:
    """One job's directory under a store root, as the reclaimer sees it."""

    job_id: str
    """Job directory name."""
    path: Path
    """The job directory."""
    num_stores: int
    """Rank stores (``node<N>/rank<R>`` directories) in it."""
    host_bytes: int
    """Bytes its files occupy on the store root's filesystem (allocated blocks: on tmpfs,
    host memory)."""
    last_write: float
    """Newest modification time of its files (0.0 when it holds none)."""
    held: bool
    """Whether a live process holds one of its stores (its progress lock is taken)."""

    def age_s(self, now: float) -> float:
        """Seconds since the last write at time ``now``."""
        return now - self.last_write


@dataclass(frozen=True, slots=True)
class FreeDecision:
    """What :func:`free_jobs` did (or, dry, would do) with one job's stores."""

    job: JobStores
    """The job as seen just before the decision."""
    kept: str | None
    """Why the stores stay (None: freed, or would be on a dry run)."""

    @property
    def freed(self) -> bool:
        return self.kept is None


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


def scan_job(job: Path) -> JobStores:
    """Size, last write and liveness of one job directory (reads metadata only and
    probes the progress locks; changes nothing)."""
    nbytes, newest, held = 0, 0.0, False
    for f in job.rglob("*"):
        try:
            st = f.lstat()
        except FileNotFoundError:  # removed while we looked
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        nbytes += st.st_blocks * 512
        newest = max(newest, st.st_mtime)
        held = held or (f.name == PROGRESS_FILE and _locked(f))
    return JobStores(job.name, job, len(find_stores(job)), nbytes, newest, held)


def host_jobs(root: Path = DEFAULT_ROOT) -> list[JobStores]:
    """Every job's stores under the store root ``root``, by job id. Only directories
    that look like job stores (children all ``node<N>``) count; symlinks never do."""
    root = Path(root)
    if not root.is_dir():
        return []
    jobs = []
    for j in sorted(root.iterdir()):
        try:
            if not j.is_symlink() and is_job_dir(j):
                jobs.append(scan_job(j))
        except FileNotFoundError:  # removed while we looked (another reclaim)
            continue
    return jobs


def why_kept(job: JobStores, idle_s: float, now: float) -> str | None:
    """Why ``job``'s stores must stay (None: they belong to no live job and may go): a
    live process holds one of them, or someone wrote to them less than ``idle_s``
    seconds before ``now``."""
    reasons = []
    if job.held:
        reasons.append("held by a live process")
    age = job.age_s(now)
    if age < idle_s:
        reasons.append(f"written {age:.0f} s ago (< idle {idle_s:g} s)")
    return "; ".join(reasons) or None


def free_jobs(
    root: Path = DEFAULT_ROOT,
    idle_s: float = DEFAULT_IDLE_S,
    *,
    keep_job_id: str | None = None,
    only: str | None = None,
    dry_run: bool = False,
) -> list[FreeDecision]:
    """Remove every job's stores under ``root`` that :func:`why_kept` lets go; one
    decision per job, by job id. ``keep_job_id``: a job never removed (the caller's
    own); ``only``: look at this job alone; ``dry_run``: decide, remove nothing."""
    out: list[FreeDecision] = []
    for job in host_jobs(root):
        if only is not None and job.job_id != only:
            continue
        kept = "the caller's own job" if job.job_id == keep_job_id else None
        kept = kept or why_kept(job, idle_s, time.time())
        if kept is None and not dry_run:
            shutil.rmtree(job.path, ignore_errors=True)
            if job.path.exists():
                kept = "could not remove it all (permissions?)"
            else:
                log.info("freed the stores of job %s (%d B)", job.job_id, job.host_bytes)
        out.append(FreeDecision(job, kept))
    return out


def reclaim_stale_jobs(
    root: Path = DEFAULT_ROOT, idle_s: float = DEFAULT_IDLE_S, *, keep_job_id: str | None = None
) -> list[Path]:
    """Remove every job's stores under ``root`` that belong to no live job: no live process
    holds them (the allocation lock is free in every rank directory) and nobody changed
    their files for ``idle_s`` seconds (a job between torchrun restarts holds no lock for
    a moment, but was written to moments ago). ``keep_job_id``: a job never removed (the
    caller's own). Only directories that look like job stores (children all ``node<N>``)
    are touched. Returns the job directories removed (see :func:`free_jobs`)."""
    return [d.job.path for d in free_jobs(root, idle_s, keep_job_id=keep_job_id) if d.freed]


def reclaim_other_jobs(root: Path, keep_job_id: str, idle_s: float = DEFAULT_IDLE_S) -> list[Path]:
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
