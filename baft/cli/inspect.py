"""``baft inspect [PATH] [--job ID] [--free] [--json]``: the snapshot stores on this host.

PATH (or ``--root``; default ``/dev/shm/baft``) is a store root holding
``<job>/node<N>/rank<R>/``: a table of every job's stores there (rank stores, bytes they
occupy, last write, whether a live process holds them, whether a restart could restore
from them). With ``--job ID``, or a job directory as PATH, one job in detail: each
rank's versions, states, shard sizes, redundancy regions and checksum status, and which
versions are recoverable now (``baft.recover.inspect`` runs the recovery coordinator
over the inventories). Read-only, except ``--free``: it removes the stores of jobs that
no live process holds and nobody wrote to for ``--idle-s`` seconds (the checks a restore
applies to other jobs' stores, ``baft.store.reclaim.why_kept``); ``--dry-run`` only says
what it would free.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path
from typing import Any

from baft.store.reclaim import DEFAULT_IDLE_S, DEFAULT_ROOT, FreeDecision, JobStores

_EXPECTED = (
    "expected a store root (e.g. /dev/shm/baft) holding <job>/node<N>/rank<R>/ "
    "directories, or one job directory holding node<N>/rank<R>/"
)


def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``inspect`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "inspect",
        help="list the snapshot stores on this host, show one job's, free leftover ones",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument(
        "path",
        metavar="PATH",
        nargs="?",
        help=f"store root or job directory (default {DEFAULT_ROOT})",
    )
    p.add_argument("--root", help="store root (same as PATH)")
    p.add_argument("--job", metavar="ID", help="show (or with --free, free) this job alone")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--free",
        action="store_true",
        help="remove the stores of jobs no live process holds and nobody wrote to lately",
    )
    p.add_argument(
        "--idle-s",
        type=float,
        metavar="SECONDS",
        help=f"with --free: a job written to less than this long ago stays (default {DEFAULT_IDLE_S:g})",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="with --free: say what would be freed, free nothing"
    )
    p.set_defaults(func=run_inspect)
    return p


def run_inspect(args: argparse.Namespace) -> int:
    """Print the listing, one job's report or what ``--free`` did; 0 on success, 2 when
    the arguments or PATH are not usable."""
    if args.path and args.root and Path(args.path) != Path(args.root):
        return _fail("give the store root as PATH or as --root, not both")
    if not args.free and (args.idle_s is not None or args.dry_run):
        return _fail("--idle-s and --dry-run go with --free")
    explicit = args.path or args.root
    root, job = Path(explicit or DEFAULT_ROOT), args.job
    from baft.store.paths import is_job_dir

    if is_job_dir(root):  # PATH is one job's directory
        if job is not None and job != root.name:
            return _fail(f"{root} is the directory of job {root.name}, not of job {job}")
        root, job = root.parent, root.name
    if explicit and not root.exists():
        return _fail(f"{root} does not exist; {_EXPECTED}")
    if explicit and job is None and _holds_other_things(root):
        return _fail(f"{root} is not a baft snapshot store; {_EXPECTED}")
    if args.free:
        return _free(args, root, job)
    from baft.recover.inspect import describe_jobs

    reports = describe_jobs(root, job)
    if job is not None and not reports:
        return _fail(f"no stores of job {job} under {root}")
    if args.json:
        print(json.dumps({"root": str(root), "jobs": reports}, indent=2))
    elif job is not None:
        print("\n\n".join(format_job(r) for r in reports))
    else:
        print(format_listing(root, reports))
    return 0


def _fail(message: str) -> int:
    print(f"baft inspect: {message}")
    return 2


def _holds_other_things(root: Path) -> bool:
    """A directory with entries but no job store in it: not a store root."""
    from baft.store.reclaim import host_jobs

    return root.is_dir() and any(root.iterdir()) and not host_jobs(root)


def _free(args: argparse.Namespace, root: Path, job: str | None) -> int:
    from baft.store.reclaim import free_jobs

    idle_s = DEFAULT_IDLE_S if args.idle_s is None else args.idle_s
    decisions = free_jobs(root, idle_s, only=job, dry_run=args.dry_run)
    if job is not None and not decisions:
        return _fail(f"no stores of job {job} under {root}")
    if args.json:
        print(json.dumps(free_report(root, idle_s, args.dry_run, decisions), indent=2))
    else:
        print(format_free(root, idle_s, args.dry_run, decisions))
    return 0


def free_report(
    root: Path, idle_s: float, dry_run: bool, decisions: list[FreeDecision]
) -> dict[str, Any]:
    """JSON-able record of ``free_jobs``' decisions."""
    now = time.time()

    def entry(d: FreeDecision) -> dict[str, Any]:
        j = d.job
        out = {
            "job": j.job_id,
            "path": str(j.path),
            "num_stores": j.num_stores,
            "host_bytes": j.host_bytes,
            "age_s": j.age_s(now) if j.last_write else None,
            "live": j.held,
        }
        return out if d.freed else {**out, "reason": d.kept}

    return {
        "root": str(root),
        "idle_s": idle_s,
        "dry_run": dry_run,
        "freed": [entry(d) for d in decisions if d.freed],
        "kept": [entry(d) for d in decisions if not d.freed],
        "freed_bytes": sum(d.job.host_bytes for d in decisions if d.freed),
    }


def format_free(root: Path, idle_s: float, dry_run: bool, decisions: list[FreeDecision]) -> str:
    """One line per job (freed, or kept and why), then the total."""
    now = time.time()
    verb = "would free" if dry_run else "freed"
    lines = []
    for d in decisions:
        j = d.job
        what = f"{j.job_id} ({j.num_stores} rank store(s), {j.host_bytes:,} B, last write {_ago(j, now)})"
        lines.append(f"{verb} {what}" if d.freed else f"kept {what}: {d.kept}")
    freed = [d for d in decisions if d.freed]
    total = sum(d.job.host_bytes for d in freed)
    lines.append(
        f"{verb} {len(freed)} job(s), {total:,} B ({_size(total)}) under {root}; "
        f"kept {len(decisions) - len(freed)} (idle threshold {idle_s:g} s)"
    )
    return "\n".join(lines)


def format_listing(root: Path, reports: list[dict[str, Any]]) -> str:
    """A table of ``baft.recover.inspect.describe_jobs``' reports, one row per job."""
    if not reports:
        return f"no job stores under {root}"
    from rich.console import Console
    from rich.table import Table

    table = Table("job", "rank stores", "size", "last write", "live", "recoverable")
    for r in reports:
        rec = r["recovery"]
        table.add_row(
            r["job"],
            str(r["num_stores"]),
            _size(r["host_bytes"]),
            "never" if r["age_s"] is None else _ago_s(r["age_s"]),
            "yes (held by a live process)" if r["live"] else "no",
            f"v={rec['version']} from memory" if r["recoverable"] else "no",
        )
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False).print(table)
    total = sum(r["host_bytes"] for r in reports)
    return (
        f"{len(reports)} job(s), {total:,} B ({_size(total)}) under {root}\n"
        + buf.getvalue().rstrip("\n")
        + f"\none job in detail: baft inspect --root {root} --job ID; free the stores no live "
        "job holds: baft inspect --free" + ("" if root == DEFAULT_ROOT else f" --root {root}")
    )


def format_job(report: dict[str, Any]) -> str:
    """Human-readable text of ``baft.recover.inspect.describe_job``'s report."""
    lines = [f"job {report['job']}  ({report['path']})"]
    if "num_stores" in report:
        live = "held by a live process" if report["live"] else "held by no live process"
        age = "never" if report["age_s"] is None else _ago_s(report["age_s"])
        lines.append(
            f"  {report['num_stores']} rank store(s), {report['host_bytes']:,} B, "
            f"last write {age}, {live}"
        )
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


def _size(nbytes: int) -> str:
    """``nbytes`` in binary units: 0 B, 12.0 KiB, 3.4 GiB."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"


def _ago(job: JobStores, now: float) -> str:
    return _ago_s(job.age_s(now)) if job.last_write else "never"


def _ago_s(age_s: float) -> str:
    """A duration back from now: 12 s ago, 5 min ago, 3.0 h ago, 2.0 d ago."""
    if age_s < 120:
        return f"{age_s:.0f} s ago"
    if age_s < 7200:
        return f"{age_s / 60:.0f} min ago"
    if age_s < 172800:
        return f"{age_s / 3600:.1f} h ago"
    return f"{age_s / 86400:.1f} d ago"
