"""Is a job in a snapshot store recoverable? The assessment behind ``baft inspect``.

:func:`describe_jobs` lists every job's stores under a store root (or one job directory):
what the reclaimer sees (rank stores, bytes on the filesystem, last write, whether a live
process holds them: :func:`baft.store.reclaim.host_jobs`) next to the assessment below.
For every job under a path :func:`inspect_stores` takes the store's inventories and
per-rank reports (``baft.store.inspect``), reads the topology and redundancy back from
the newest manifest, and runs the recovery coordinator over the inventories: which versions could
be rebuilt and from where, and what a restart would restore now. Read-only and pure
apart from reading the stores; ``baft.cli.inspect`` prints the reports.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from baft.recover.coordinator import TopologyMismatchError, assess_version, coordinate
from baft.store.coding import Redundancy
from baft.store.inspect import newest_manifest, rank_report, read_inventories, stores_by_job
from baft.store.manifest import RankInventory
from baft.store.paths import StoreAddress, is_job_dir, job_stores
from baft.store.reclaim import JobStores, host_jobs, scan_job


def describe_jobs(path: Path, job_id: str | None = None) -> list[dict[str, Any]]:
    """One :func:`describe_job` entry per job under ``path`` (a store root, or one job
    directory), by job id; ``job_id``: that job alone. Empty when it holds none."""
    path = Path(path)
    if is_job_dir(path):
        jobs = [scan_job(path)]
    else:
        jobs = [j for j in host_jobs(path) if job_id is None or j.job_id == job_id]
    now = time.time()
    return [describe_job(j, now) for j in jobs]


def describe_job(job: JobStores, now: float) -> dict[str, Any]:
    """:func:`inspect_job`'s report of one job plus what the host holds of it:
    ``num_stores``, ``host_bytes`` (allocated), ``last_write`` (epoch s), ``age_s``
    (since then, at ``now``; None when nothing was written), ``live`` (a live process holds a store) and ``recoverable``
    (a restart now would restore a version from memory)."""
    addresses = job_stores(job.path.parent, job.job_id)
    try:
        report = inspect_job(addresses) if addresses else _unreadable(job, "no rank store")
    except (OSError, ValueError) as err:  # removed or rewritten while we read it
        report = _unreadable(job, f"unreadable ({err})")
    report.update(
        num_stores=job.num_stores,
        host_bytes=job.host_bytes,
        last_write=job.last_write,
        age_s=job.age_s(now) if job.last_write else None,
        live=job.held,
        recoverable=report["recovery"]["source"] == "memory",
    )
    return report


def _unreadable(job: JobStores, why: str) -> dict[str, Any]:
    return {
        "job": job.job_id,
        "path": str(job.path),
        "ranks": [],
        "topology": None,
        "versions": [],
        "recovery": {"version": None, "source": "unknown", "reason": why},
    }


def inspect_stores(path: Path) -> list[dict[str, Any]]:
    """One ``inspect_job`` report per job under ``path`` (empty when it holds no store)."""
    return [inspect_job(addrs) for addrs in stores_by_job(path).values()]


def inspect_job(addresses: list[StoreAddress]) -> dict[str, Any]:
    """Inventory every store of one job and assess each version (JSON-able dict)."""
    invs = read_inventories(addresses)
    newest = newest_manifest(invs)
    report: dict[str, Any] = {
        "job": addresses[0].job_id,
        "path": str(addresses[0].root / addresses[0].job_id),
        "ranks": [rank_report(inv) for inv in sorted(invs.values(), key=lambda i: i.rank)],
    }
    if newest is None:
        report["topology"] = None
        report["recovery"] = {
            "version": None,
            "source": "unknown",
            "reason": "no complete manifest: topology unknown",
        }
        report["versions"] = []
        return report
    topology, red = newest.topology(), Redundancy.parse(newest.redundancy)
    everyone: dict[int, RankInventory | None] = {r: invs.get(r) for r in range(topology.world_size)}
    report["topology"] = {
        "num_pp": topology.num_pp,
        "num_dp": topology.num_dp,
        "num_tp": topology.num_tp,
        "ranks_per_node": topology.ranks_per_node,
        "redundancy": str(red),
        "missing_ranks": [r for r, inv in everyone.items() if inv is None],
    }
    present = {r: inv for r, inv in everyone.items() if inv is not None}
    committed = max(
        (i.committed for i in present.values() if i.committed is not None), default=None
    )
    report["committed"] = committed
    versions = sorted({v.version for inv in present.values() for v in inv.versions}, reverse=True)
    report["versions"] = []
    for version in versions:
        verdict = assess_version(topology, present, version, committed)
        why = "; ".join(verdict.notes) if verdict.ok else f"v={version} {verdict.why_not}"
        report["versions"].append({"version": version, "recoverable": verdict.ok, "reason": why})
    try:
        plan, reason = coordinate(topology, red, everyone)
    except TopologyMismatchError as err:
        report["recovery"] = {"version": None, "source": "unknown", "reason": str(err)}
    else:
        report["recovery"] = {"version": plan.version, "source": plan.source, "reason": reason}
    return report
