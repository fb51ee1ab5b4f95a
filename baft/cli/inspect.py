"""``baft inspect PATH [--json]``: what a snapshot store holds and whether it is recoverable.

PATH is a store root (holding ``<job>/node<N>/rank<R>/``) or one job directory. For
every job it lists each rank's versions, states, shard sizes, redundancy regions and
checksum status, and which versions are recoverable now (``baft.recover.inspect`` runs
the recovery coordinator over the inventories). Read-only: nothing in the store is
modified.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
    from baft.recover.inspect import inspect_stores

    path = Path(args.path)
    reports = inspect_stores(path)
    if not reports:
        what = "does not exist" if not path.exists() else "is not a baft snapshot store"
        print(f"baft inspect: {path} {what}; {_EXPECTED}")
        return 2
    if getattr(args, "json", False):
        print(json.dumps({"jobs": reports}, indent=2))
    else:
        print("\n\n".join(format_job(r) for r in reports))
    return 0


def format_job(report: dict[str, Any]) -> str:
    """Human-readable text of ``baft.recover.inspect.inspect_job``'s report."""
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
