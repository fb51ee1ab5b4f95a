"""Benchmarks: checkpoint overhead side by side (``baft bench overhead``), recovery from
memory vs disk, simulated scale, and the checkpointing modes people use today, as
StepHooks, to compare baft against. The command line lives in ``baft.cli.bench``.

Nothing is imported eagerly, so ``python -m baft_bench.overhead`` (the worker) loads only
what it needs.
"""
