"""``baft trace RUN_DIR [--iterations A:B] [--out DIR]``: Perfetto JSON and a PNG of a run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_MAX_ITER = sys.maxsize


def add_trace_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``baft trace RUN_DIR [--iterations A:B] [--out DIR]``."""
    parser = subparsers.add_parser(
        "trace",
        help="timeline of a run as Perfetto JSON and a PNG",
        description="Write RUN_DIR/trace.json (open in ui.perfetto.dev or chrome://tracing) "
        "and RUN_DIR/timeline.png from RUN_DIR/timeline/rank*.jsonl.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="directory of a run (holds timeline/)")
    parser.add_argument(
        "--iterations",
        metavar="A:B",
        default=None,
        help="only iterations A..B, inclusive (default: all in the JSON, the last 3 in the PNG)",
    )
    parser.add_argument(
        "--out", metavar="DIR", default=None, help="output directory (default: RUN_DIR)"
    )
    parser.set_defaults(func=run_trace)
    return parser


def parse_iterations(text: str) -> tuple[int, int]:
    """Parse "A:B" (inclusive), "A:", ":B" or "A" into ``(first, last)``."""
    try:
        if ":" not in text:
            return int(text), int(text)
        first, last = text.split(":", 1)
        rng = (int(first) if first else 0, int(last) if last else _MAX_ITER)
    except ValueError:
        raise ValueError(
            f"--iterations {text!r}: use A:B (inclusive), A:, :B or A, e.g. 5:8"
        ) from None
    if rng[0] > rng[1]:
        raise ValueError(f"--iterations {text!r}: first {rng[0]} is after last {rng[1]}")
    return rng


def run_trace(args: argparse.Namespace) -> int:
    """Run ``baft trace``: write trace.json and timeline.png, print their paths; 0 on success."""
    from baft.profile.timeline import read_timelines
    from baft.profile.trace import select_range, write_trace

    run_dir = Path(args.run_dir)
    try:
        records = read_timelines(run_dir)
        rng = parse_iterations(args.iterations) if args.iterations else None
    except (FileNotFoundError, ValueError) as exc:
        print(f"baft trace: error: {exc}", file=sys.stderr)
        return 2
    chosen = select_range(records, rng)
    if not chosen:
        have = sorted({r.iteration for recs in records.values() for r in recs})
        span = f"{have[0]}..{have[-1]}" if have else "none"
        print(
            f"baft trace: error: no iterations in {args.iterations}; the run has {span}",
            file=sys.stderr,
        )
        return 2
    json_path, png_path = write_trace(chosen, Path(args.out) if args.out else run_dir, rng)
    print(f"trace (ui.perfetto.dev): {json_path}")
    print(f"timeline picture:        {png_path}")
    return 0
