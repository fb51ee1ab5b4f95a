"""``baft bench``'s subcommands: the flags of the benchmarks and what runs them.

``baft/cli/bench.py`` registers ``baft bench`` and hands its parser to
:func:`add_bench_commands` when this package is installed. ``overhead`` is parsed here
and run by ``baft_bench.command.measure_overhead``: one torchrun job, a table (or one
JSON object with ``--json``) on stdout and
``benchmarks/results/overhead-<compute>-<date>.md`` with a boxplot PNG next to it.
``recovery`` and ``scale`` parse their flags here and run ``baft_bench.recovery`` and
``baft_bench.scale``; ``goodput``, ``sweep`` and ``reduction`` register their own flags
(``baft_bench.goodput``, ``baft_bench.sweep``, ``baft_bench.reduction``). The harness
lives outside the ``baft`` package and parses its own arguments.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import baft_bench.goodput as goodput_bench
import baft_bench.recovery as recovery_bench
import baft_bench.reduction as reduction_bench
import baft_bench.scale as scale_bench
import baft_bench.sweep as sweep_bench
from baft_bench.overhead import ALL_MODES, OverheadConfig
from baft_bench.stats import default_rounds, format_ci

DEFAULT_RESULTS_DIR = "benchmarks/results"
"""Where result pages go, relative to the working directory."""


HELP = "benchmarks: checkpoint overhead side by side, recovery memory vs disk, simulated scale"
"""The line of ``baft --help`` for ``bench``."""
DESCRIPTION = "Rerunnable benchmarks whose results go to benchmarks/results/."
"""The description of ``baft bench --help``."""


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` with its subcommands on ``subparsers``, as ``baft/cli`` does
    (through :func:`add_bench_commands`)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help=HELP, description=DESCRIPTION
    )
    add_bench_commands(parser)
    return parser


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    """Add ``overhead``, ``recovery``, ``scale``, ``goodput``, ``sweep`` and ``reduction`` to
    the ``bench`` parser."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    d = OverheadConfig()
    p = sub.add_parser(
        "overhead",
        help="iteration time of each checkpointing mode vs none, in one launch",
        description="Train the reference GPT once per rank and interleave blocks of "
        "iterations across checkpointing modes (none, torch-save, dcp-async, checkfreq, "
        "naive-async, baft), each checkpointing every iteration.",
    )
    add = p.add_argument
    add("--pp", type=int, default=d.num_pp, help="pipeline ranks (default %(default)s)")
    add("--dp", type=int, default=d.num_dp, help="data-parallel replicas (default %(default)s)")
    add("--dp-shard", type=int, default=d.num_dp_shard, help="FSDP2 degree inside each replica: the GPT stages fully_shard-ed over torchtitan's dp_shard dim, as baft train --dp-shard (default %(default)s)")  # fmt: skip
    add("--schedule", default=d.schedule, help="pipeline schedule (default %(default)s)")
    add("--microbatches", type=int, default=d.num_microbatches, help="(default %(default)s)")
    add("--layers", type=int, default=d.num_layers, help="transformer blocks (default %(default)s)")
    add("--d-model", type=int, default=d.d_model, help="hidden size (default %(default)s)")
    add("--heads", type=int, default=d.num_heads, help="attention heads (default %(default)s)")
    add("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default %(default)s)")
    add("--batch", type=int, default=d.global_batch, help="global batch (default %(default)s)")
    add("--blocks", type=int, default=None, help="rounds per launch, one block per mode each (default: whole Williams designs, n rounds for n modes, 2n for odd n, at least 8; fewer or a non-multiple is unbalanced and says so)")  # fmt: skip
    add("--launches", type=int, default=1, help="fresh torchrun launches whose rounds are pooled (default %(default)s)")  # fmt: skip
    add("--block-iters", type=int, default=d.block_iters, help="iterations per block (default %(default)s)")  # fmt: skip
    add("--switch-iters", type=int, default=d.num_switch_iters, help="unmeasured iterations after each switch (default %(default)s)")  # fmt: skip
    add("--warmup", type=int, default=d.num_warmup, help="unmeasured iterations at the start and per mode (default %(default)s)")  # fmt: skip
    add("--modes", default=None, help="comma-separated modes (default: all; lm-resiliency and dlrover-flash need pip install -e 'benchmarks[peers]' and are left out when missing)")  # fmt: skip
    add("--compute", choices=("real", "emulated"), default=d.compute, help="stage compute (default %(default)s)")  # fmt: skip
    add("--emulated-ms", default="", metavar="F/B,...", help="fixed emulated forward/backward ms per stage, e.g. 15.7/29.4,15.2/28.4 (default: calibrate at start-up)")  # fmt: skip
    add("--ranks-per-node", type=int, default=d.ranks_per_node, help="ranks per simulated node for the engine's redundancy (default %(default)s)")  # fmt: skip
    add("--checkpoint", default=d.checkpoint, metavar="SPEC", help="policy of the engine modes naive-async and baft (default %(default)s)")  # fmt: skip
    add("--engine", default="", metavar="KEY=VALUE,...", help="engine options of the engine modes, to measure them: host_work=bubbles|always|auto, snapshot_copy=auto|thread, exchange=auto|network (default: the defaults)")  # fmt: skip
    add("--interval", type=int, default=d.interval, help="iterations between checkpoints, every mode (the engine's every, the baselines' and peers' cadence; default %(default)s)")  # fmt: skip
    add("--persist-every", type=int, default=d.persist_every, help="disk cadence in checkpoints: torch-save, dcp-async and checkfreq write every N-th checkpoint iteration, baft-persist runs with persist=N (default %(default)s)")  # fmt: skip
    add("--no-restore-check", action="store_true", help="skip the restore check after the blocks (each mode's newest checkpoint restored and compared bit for bit)")  # fmt: skip
    add("--store-root", default=d.store_root, help="shared-memory root of the engine stores (default %(default)s)")  # fmt: skip
    add("--seed", type=int, default=d.seed, help="(default %(default)s)")
    add("--out", default=d.out_dir, help="run directory and checkpoint files (default %(default)s)")  # fmt: skip
    add("--results-dir", default=DEFAULT_RESULTS_DIR, help="where the results page goes (default %(default)s)")  # fmt: skip
    add("--no-results", action="store_true", help="do not write the results page and plot")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--timeout", type=float, default=1800.0, help="kill the job after this many seconds")
    add_recovery_parser(sub)
    add_scale_parser(sub)
    goodput_bench.add_parser(sub)
    sweep_bench.add_parser(sub)
    reduction_bench.add_parser(sub)
    parser.set_defaults(func=run_bench)


def config_from_args(a: argparse.Namespace) -> OverheadConfig:
    """The validated ``OverheadConfig`` of parsed ``bench overhead`` flags."""
    modes = _modes(a)
    if getattr(a, "launches", 1) < 1:
        raise ValueError("--launches must be >= 1")
    a.blocks, note = default_rounds(len(modes), a.blocks)
    if note:
        print(f"[bench] note: {note}", file=sys.stderr)
    cfg = OverheadConfig(
        num_pp=a.pp,
        num_dp=a.dp,
        num_dp_shard=getattr(a, "dp_shard", 1),
        schedule=a.schedule,
        num_microbatches=a.microbatches,
        num_layers=a.layers,
        d_model=a.d_model,
        num_heads=a.heads,
        seq_len=a.seq_len,
        global_batch=a.batch,
        num_blocks=a.blocks,
        block_iters=a.block_iters,
        num_switch_iters=a.switch_iters,
        num_warmup=a.warmup,
        modes=modes,
        compute=a.compute,
        emulated_ms=getattr(a, "emulated_ms", ""),
        out_dir=a.out,
        seed=a.seed,
        ranks_per_node=a.ranks_per_node,
        checkpoint=a.checkpoint,
        store_root=a.store_root,
        engine=a.engine,
        interval=getattr(a, "interval", 1),
        persist_every=getattr(a, "persist_every", 1),
        restore_check=not getattr(a, "no_restore_check", False),
    )
    cfg.validate()
    return cfg


def _modes(a: argparse.Namespace) -> list[str]:
    """``--modes`` as a list. Named peer modes whose library is missing raise ValueError
    with the install command; the default (all) leaves them out with a note."""
    from baft_bench.peers import INSTALL_HINT, missing_peers

    modes = [m.strip() for m in (a.modes or ",".join(ALL_MODES)).split(",") if m.strip()]
    missing = missing_peers(modes)
    if missing and a.modes is not None:
        raise ValueError(f"--modes names {', '.join(missing)}, not installed: {INSTALL_HINT}")
    if missing:
        print(f"[bench] note: leaving out {', '.join(missing)} (not installed: {INSTALL_HINT})", file=sys.stderr)  # fmt: skip
    a.modes = ",".join(m for m in modes if m not in missing)  # command_line() shows what ran
    return [m for m in modes if m not in missing]


def command_line(a: argparse.Namespace) -> str:
    """The ``baft bench overhead`` command with every flag spelled out (reproducible)."""
    flags = [
        ("--pp", a.pp), ("--dp", a.dp),
        ("--dp-shard", a.dp_shard if getattr(a, "dp_shard", 1) != 1 else None),
        ("--schedule", a.schedule),
        ("--microbatches", a.microbatches), ("--layers", a.layers), ("--d-model", a.d_model),
        ("--heads", a.heads), ("--seq-len", a.seq_len), ("--batch", a.batch),
        ("--blocks", a.blocks), ("--launches", a.launches if a.launches != 1 else None),
        ("--block-iters", a.block_iters),
        ("--switch-iters", a.switch_iters), ("--warmup", a.warmup), ("--modes", a.modes),
        ("--compute", a.compute), ("--emulated-ms", getattr(a, "emulated_ms", "") or None),
        ("--ranks-per-node", a.ranks_per_node),
        ("--checkpoint", a.checkpoint), ("--engine", a.engine or None), ("--seed", a.seed),
        ("--interval", getattr(a, "interval", None)),
        ("--persist-every", getattr(a, "persist_every", None)),
        ("--out", a.out),
    ]  # fmt: skip
    words = ["baft", "bench", "overhead"] + [
        w for f, v in flags if v is not None for w in (f, str(v))
    ]
    if getattr(a, "no_restore_check", False):
        words.append("--no-restore-check")
    return shlex.join(words + (["--json"] if a.json else []))


def _print_table(result: dict[str, Any]) -> None:
    print(f"sync_snapshot_fraction: {result['sync_snapshot_fraction']:.3f} ({result['compute']})")
    print(f"{'mode':<12} {'iter ms':>9} {'ratio':>7} {'wall ratio':>10} {'paired wall ratio [95% CI]':>27} {'exposed ms':>11} {'in-bubble':>10} {'MiB/iter':>9} {'saves/iter':>10}")  # fmt: skip
    for name, m in result["modes"].items():
        frac = m["in_bubble_fraction"]
        ci = format_ci(m.get("paired_wall_ratio_vs_none"), m.get("ci_low"), m.get("ci_high"))
        print(
            f"{name:<12} {m['median_iter_s'] * 1e3:9.1f} {m['ratio_vs_none']:7.3f} "
            f"{m['wall_ratio_vs_none']:10.3f} {ci:>27} "
            f"{m['exposed_s'] * 1e3:11.1f} {'-' if frac is None else f'{frac:.2f}':>10} "
            f"{m['bytes_per_iter'] / 2**20:9.1f} {m.get('disk_saves_per_iter', 0.0):10.2f}"
        )


def run_overhead(a: argparse.Namespace) -> int:
    """Run ``baft bench overhead``: measure, write the results page, print."""
    from baft_bench.command import measure_overhead, write_results

    cfg = config_from_args(a)
    result, raw = measure_overhead(cfg, timeout_s=a.timeout, launches=a.launches)
    if not a.no_results:
        path = write_results(result, raw, Path(a.results_dir), command_line(a))
        print(f"[bench] wrote {path}", file=sys.stderr)
    if a.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Run ``baft bench <what>``; returns the exit code."""
    what = getattr(args, "bench_command", None)
    if what == "overhead":
        try:
            return run_overhead(args)
        except RuntimeError as exc:
            print(f"baft bench: error: {exc}", file=sys.stderr)
            return 1
    print(
        "baft bench: choose a benchmark: overhead, recovery, scale, goodput, sweep, reduction",
        file=sys.stderr,
    )
    return 2


def add_recovery_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "recovery",
        help="restore after a crash and a node loss: memory vs DCP on disk",
        description=recovery_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default %(default)s)")
    p.add_argument("--d-model", type=int, default=512, help="hidden size (default %(default)s)")
    p.add_argument("--iterations", type=int, default=15, help="(default %(default)s)")
    p.add_argument("--persist-every", type=int, default=4, help="DCP interval in checkpoints (default %(default)s)")  # fmt: skip
    p.add_argument("--full-every", default="3", help="differential checkpoints: full copy of every tensor at least every N iterations, 1 = whole state, auto (default %(default)s)")  # fmt: skip
    p.add_argument("--hang-timeout", type=float, default=10.0, help="--timeout of the hang row's job; 0 skips the row (default %(default)s)")  # fmt: skip
    p.add_argument("--failures", type=int, default=3, help="failures per downtime row (in-process vs group restart: rank crash, node loss, hang); 0 skips them (default %(default)s)")  # fmt: skip
    p.add_argument("--no-peers", action="store_true", help="skip the peers' rank-crash rows of the downtime table (torchft, NVRx's in-process Wrapper; they run when installed)")  # fmt: skip
    p.add_argument("--out", default="runs/bench-recovery", help="(default %(default)s)")
    p.add_argument("--results-dir", default="benchmarks/results", help="(default %(default)s)")
    p.add_argument("--no-results", action="store_true", help="do not write the results page")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="show the jobs' output")
    p.set_defaults(func=recovery_bench.run_recovery)
    return p


def add_scale_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("scale", help="SIMULATED cost on cluster presets (Llama-2, GPT-3)")
    p.add_argument("--redundancy", default="xor:2", help="(default %(default)s)")
    p.add_argument("--mtbf-hours", type=float, default=6.0, help="job-level MTBF (default %(default)s)")  # fmt: skip
    p.add_argument("--storage-gbps", type=float, default=0.5, help="storage GB/s per GPU (default %(default)s)")  # fmt: skip
    p.add_argument("--results-dir", default="benchmarks/results", help="(default %(default)s)")
    p.add_argument("--no-results", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=scale_bench.run_scale)
    return p
