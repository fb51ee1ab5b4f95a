"""Benchmarks: checkpoint overhead side by side (``baft bench overhead``) and the
checkpointing modes people use today, as StepHooks, to compare baft against.

Exports are lazy, so ``python -m baft.bench.overhead`` (the worker) does not import the
command line first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_bench_parser", "run_bench"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from baft.bench import command

        return getattr(command, name)
    raise AttributeError(f"module 'baft.bench' has no attribute {name!r}")
