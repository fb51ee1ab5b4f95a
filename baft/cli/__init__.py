"""``baft`` command line: train | demo | plan | simulate | bench | inspect | trace.

All argument parsing lives in this package, one module per command; each registers its
subcommand (``add_*_parser``), turns the flags into the typed arguments of the domain
code it calls and prints the result. Domain packages take plain arguments and do not
print (``demo``, at the top of the layering, may). ``bench`` is registered here and
parsed by the measurement harness, a package outside baft (see :mod:`baft.cli.bench`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from baft.cli.bench import add_bench_parser
from baft.cli.demo import add_demo_parser
from baft.cli.inspect import add_inspect_parser
from baft.cli.plan import add_plan_parser
from baft.cli.simulate import add_simulate_parser
from baft.cli.trace import add_trace_parser
from baft.cli.train import add_train_parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``baft`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="baft",
        description="Bubble-aware fault tolerance for hybrid-parallel PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_train_parser(sub)
    add_demo_parser(sub)
    add_plan_parser(sub)
    add_simulate_parser(sub)
    add_bench_parser(sub)
    add_inspect_parser(sub)
    add_trace_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``baft`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"baft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
