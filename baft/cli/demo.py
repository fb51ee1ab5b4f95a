"""``baft demo``: train, fail, recover from memory, verify (see ``baft.demo``)."""

from __future__ import annotations

import argparse
from typing import Any

import baft.demo


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``demo`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "demo",
        help="train, fail, recover from memory, verify bit-exactness (4 CPU ranks, ~2 min)",
        description=baft.demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", default="runs/demo", help="directory for both runs (default %(default)s)"
    )
    p.add_argument(
        "--iterations", type=int, default=30, help="iterations per run (default %(default)s)"
    )
    p.add_argument(
        "--kill-at", type=int, default=8, help="iteration of the rank crash (default %(default)s)"
    )
    p.add_argument(
        "--node-loss-at",
        type=int,
        default=18,
        help="iteration of the node loss (default %(default)s)",
    )
    p.set_defaults(func=run_demo)
    return p


def run_demo(a: argparse.Namespace) -> int:
    """Run ``baft demo``; 0 when the protected run recovered bit-exactly."""
    if not 3 < a.kill_at < a.node_loss_at < a.iterations:
        raise ValueError("need 3 < --kill-at < --node-loss-at < --iterations")
    return baft.demo.run_demo(
        a.out, iterations=a.iterations, kill_at=a.kill_at, node_loss_at=a.node_loss_at
    )
