"""``baft bench``: the subcommand of the measurement harness, a package of its own.

The harness (``baft_bench``, distribution ``baft-bench``, in ``benchmarks/`` of a
checkout) is not part of the ``baft`` package: when it is installed, its subcommands and
flags hang under ``baft bench`` (it parses them itself); when it is not, ``baft bench``
says how to install it and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Any

NOT_INSTALLED = (
    "baft bench needs the measurement harness, the baft-bench package (import name "
    "baft_bench), which is not installed: from a checkout of baft run "
    "`pip install -e benchmarks` (`make` does; `pip install -e 'benchmarks[peers]'` adds "
    "the peer libraries it compares against)"
)
"""What ``baft bench`` says without the harness."""


def harness_cli() -> ModuleType | None:
    """The harness's command-line module, or None when the harness is not installed (an
    import error inside an installed harness is raised as it is)."""
    try:
        from baft_bench import cli
    except ModuleNotFoundError as e:
        if e.name != "baft_bench":
            raise
        return None
    return cli


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``baft bench``: the harness's subcommands, or a stand-in that says how to
    install it."""
    cli = harness_cli()
    if cli is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser(
            "bench", help=cli.HELP, description=cli.DESCRIPTION
        )
        cli.add_bench_commands(parser)
        return parser
    parser = subparsers.add_parser(
        "bench",
        help="measurements (needs the baft-bench package: pip install -e benchmarks)",
        description=NOT_INSTALLED,
        add_help=False,
        prefix_chars="\0",  # every word, --help too, goes to the stand-in below
    )
    parser.add_argument("words", nargs=argparse.REMAINDER)
    parser.set_defaults(func=not_installed)
    return parser


def not_installed(args: argparse.Namespace) -> int:
    """``baft bench ...`` without the harness: the install note, exit code 2."""
    print(f"baft: error: {NOT_INSTALLED}", file=sys.stderr)
    return 2
