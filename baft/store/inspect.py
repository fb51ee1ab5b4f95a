"""``baft inspect PATH [--json]``: what a snapshot store holds and whether it is recoverable.

PATH is a store root (holding ``<job>/node<N>/rank<R>/``) or one job directory. For
every job it lists each rank's versions, states, shard sizes, redundancy regions and
checksum status, then runs the recovery coordinator over the inventories (topology and
redundancy read back from the manifests) to say which versions are recoverable now.
Read-only: nothing in the store is modified.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from baft.recover.coordinator import assess_version, coordinate
from baft.store.coding import Redundancy
from baft.store.manifest import Manifest, RankInventory, VersionInfo
from baft.store.shm import SnapshotStore, StoreAddress, find_stores

_EXPECTED = (
    "expected a store root (e.g. /dev/shm/baft) holding <job>/node<N>/rank<R>/ "
    "directories, or one job directory holding node<N>/rank<R>/"
)


def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``inspect`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "inspect",
        help="show what a snapshot store holds and whether it is recoverable",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("path", metavar="PATH", help="store root or job directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run_inspect)
    return p


def run_inspect(args: argparse.Namespace) -> int:
    """Print the report; 0 on success, 2 when PATH is not a store."""
    path = Path(args.path)
    addresses = find_stores(path)
    if not addresses:
        what = "does not exist" if not path.exists() else "is not a baft snapshot store"
        print(f"baft inspect: {path} {what}; {_EXPECTED}")
        return 2
    jobs: dict[str, list[StoreAddress]] = {}
    for a in addresses:
        jobs.setdefault(a.job_id, []).append(a)
    reports = [inspect_job(addrs) for addrs in jobs.values()]
    if getattr(args, "json", False):
        print(json.dumps({"jobs": reports}, indent=2))
    else:
        print("\n\n".join(format_job(r) for r in reports))
    return 0


def inspect_job(addresses: list[StoreAddress]) -> dict[str, Any]:
    """Inventory every store of one job and assess each version (JSON-able dict)."""
    invs: dict[int, RankInventory] = {}
    for a in addresses:
        store = SnapshotStore(a.root, a.job_id, a.node, a.rank, 0)
        invs[a.rank] = store.inventory(verify=True)
    newest = _newest_manifest(invs)
    report: dict[str, Any] = {
        "job": addresses[0].job_id,
        "path": str(addresses[0].root / addresses[0].job_id),
        "ranks": [_rank_report(inv) for inv in sorted(invs.values(), key=lambda i: i.rank)],
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


def _newest_manifest(invs: dict[int, RankInventory]) -> Manifest | None:
    best: Manifest | None = None
    for inv in invs.values():
        for v in inv.versions:
            if v.manifest is not None and (best is None or v.version > best.version):
                best = v.manifest
    return best


def _rank_report(inv: RankInventory) -> dict[str, Any]:
    return {
        "rank": inv.rank,
        "node": inv.node,
        "committed": inv.committed,
        "problems": list(inv.problems),
        "versions": [_version_report(v) for v in inv.versions],
    }


def _version_report(v: VersionInfo) -> dict[str, Any]:
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


def format_job(report: dict[str, Any]) -> str:
    """Human-readable text of ``inspect_job``'s report."""
    lines = [f"job {report['job']}  ({report['path']})"]
    topo = report["topology"]
    if topo:
        lines.append(
            f"  topology pp={topo['num_pp']} dp={topo['num_dp']} tp={topo['num_tp']}, "
            f"{topo['ranks_per_node']} ranks/node, redundancy {topo['redundancy']}; "
            f"committed v={report['committed']}"
        )
        for r in topo["missing_ranks"]:
            lines.append(f"  rank {r}: store missing")
    for rank in report["ranks"]:
        lines.append(
            f"  rank {rank['rank']} node {rank['node']} (commit record v={rank['committed']})"
        )
        for p in rank["problems"]:
            lines.append(f"    ! {p}")
        for v in rank["versions"]:
            lines.append("    " + _version_line(v))
            for p in v["problems"]:
                lines.append(f"      ! {p}")
    for v in report["versions"]:
        verdict = "recoverable" if v["recoverable"] else "NOT recoverable"
        lines.append(f"  v{v['version']}: {verdict}: {v['reason']}")
    rec = report["recovery"]
    lines.append(f"  recovery now: {rec['reason']}")
    return "\n".join(lines)


def _version_line(v: dict[str, Any]) -> str:
    head = f"slot {v['slot']} v{v['version']} {v['state']}"
    if v["state"] != "complete":
        return head
    status = "ok" if v["data_ok"] else "CORRUPT"
    red_status = "ok" if not v["bad_regions"] else f"CORRUPT regions {v['bad_regions']}"
    start, stop = v["owned"]
    return (
        f"{head}: shard {v['data_nbytes']:,} B [{start}, {stop}) in {v['num_chunks']} chunks {status}; "
        f"redundancy {v['red_nbytes']:,} B in {len(v['regions'])} regions {red_status}; "
        f"group {v['group']}"
    )
