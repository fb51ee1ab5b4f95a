"""Is a job in a snapshot store recoverable? The assessment behind ``baft inspect``.

For every job under a path it takes the store's inventories and per-rank reports
(``baft.store.inspect``), reads the topology and redundancy back from the newest
manifest, and runs the recovery coordinator over the inventories: which versions could
be rebuilt and from where, and what a restart would restore now. Read-only and pure
apart from reading the stores; ``baft.cli.inspect`` prints the reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baft.recover.coordinator import assess_version, coordinate
from baft.store.coding import Redundancy
from baft.store.inspect import newest_manifest, rank_report, read_inventories, stores_by_job
from baft.store.manifest import RankInventory
from baft.store.paths import StoreAddress


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
    plan, reason = coordinate(topology, red, everyone)
    report["recovery"] = {"version": plan.version, "source": plan.source, "reason": reason}
    return report
