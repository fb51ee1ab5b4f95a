"""baft's measurement harness, outside the library: checkpoint overhead side by side
(``baft bench overhead``), recovery from memory vs disk, simulated scale, and the
checkpointing modes people use today, as StepHooks, to compare baft against.

Installed next to baft (``pip install -e benchmarks`` from a checkout; ``make`` does),
its subcommands hang under ``baft bench``: ``baft/cli/bench.py`` registers them from
:mod:`baft_bench.cli`, which parses their flags. Nothing is imported eagerly, so
``python -m baft_bench.overhead`` (the worker) loads only what it needs.
"""
