"""What a snapshot store holds, read-only: the store side of ``baft inspect``.

Finds the stores under a path (a store root holding ``<job>/node<N>/rank<R>/`` or one job
directory), groups them by job, inventories each with checksums verified, and turns an
inventory into a JSON-able report. Whether a job is recoverable needs the recovery
coordinator, which sits above the store: ``baft.recover.inspect`` assesses the versions,
``baft.cli.inspect`` prints. Nothing in the store is modified.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baft.store.manifest import Manifest, RankInventory, VersionInfo
from baft.store.paths import StoreAddress, find_stores
from baft.store.shm import SnapshotStore


def stores_by_job(path: Path) -> dict[str, list[StoreAddress]]:
    """Stores under ``path`` grouped by job id (empty when ``path`` holds none)."""
    jobs: dict[str, list[StoreAddress]] = {}
    for a in find_stores(Path(path)):
        jobs.setdefault(a.job_id, []).append(a)
    return jobs


def read_inventories(addresses: list[StoreAddress]) -> dict[int, RankInventory]:
    """Inventory (checksums verified) of every given store, by rank."""
    invs: dict[int, RankInventory] = {}
    for a in addresses:
        store = SnapshotStore(a.root, a.job_id, a.node, a.rank, 0)
        invs[a.rank] = store.inventory(verify=True)
    return invs


def newest_manifest(invs: dict[int, RankInventory]) -> Manifest | None:
    """The manifest of the newest version any rank completed (None when there is none)."""
    best: Manifest | None = None
    for inv in invs.values():
        for v in inv.versions:
            if v.manifest is not None and (best is None or v.version > best.version):
                best = v.manifest
    return best


def rank_report(inv: RankInventory) -> dict[str, Any]:
    """One rank's store as a JSON-able dict: commit record, problems, every version."""
    return {
        "rank": inv.rank,
        "node": inv.node,
        "committed": inv.committed,
        "problems": list(inv.problems),
        "versions": [version_report(v) for v in inv.versions],
    }


def version_report(v: VersionInfo) -> dict[str, Any]:
    """One slot's version: state, checksum status, and its manifest's layout when complete."""
    out: dict[str, Any] = {
        "version": v.version,
        "slot": v.slot,
        "state": v.state,
        "verified": v.verified,
        "data_ok": v.data_ok,
        "bad_regions": list(v.bad_regions),
        "problems": list(v.problems),
    }
    m = v.manifest
    if m is not None:
        out.update(
            iteration=m.iteration,
            owned=[m.owned_start, m.owned_stop],
            data_nbytes=m.data_nbytes,
            num_chunks=len(m.chunks),
            red_nbytes=m.red_nbytes,
            regions=[[r.region_id, r.offset, r.nbytes] for r in m.regions],
            group=list(m.group),
            meta_keys=sorted(m.meta),
        )
    return out
