"""``baft simulate``: what-if checkpoint overhead of baft vs naive async vs sync at scale.

Also holds the scenario flags ``baft plan`` shares (model preset, cluster, layout,
schedule, policy). The arithmetic is ``baft.sim.command.evaluate``; this module parses,
renders and prints.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Any

from baft.plan.types import CheckpointPolicy
from baft.sim.presets import HARDWARE, MODELS, Scenario, build_scenario
from baft.sim.schedules import SCHEDULES


def add_scenario_args(p: argparse.ArgumentParser) -> None:
    """The flags that pick a simulated scenario and checkpoint policy."""
    p.add_argument("--preset", default="llama2-34b", choices=sorted(MODELS), help="model")
    p.add_argument("--gpus", type=int, default=512, help="total GPUs (default 512)")
    p.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    p.add_argument("--dp", type=int, help="data-parallel degree (default: gpus / (pp*tp))")
    p.add_argument("--pp", type=int, help="pipeline stages (default: the preset's)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: the preset's)")
    p.add_argument("--microbatches", type=int, help="per iteration (default: from the batch)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    p.add_argument("--virtual", type=int, default=2, help="stages per rank (interleaved)")
    p.add_argument("--mfu", type=float, help="share of peak inside a stage (default: per GPU)")
    p.add_argument("--redundancy", default="xor:2", help="none | replicate:k | xor:g | rs:k+m")
    p.add_argument("--every", type=int, default=1, help="target checkpoint interval")
    p.add_argument("--overflow", default="spill", choices=("spill", "stretch"))
    p.add_argument("--storage-gbps", type=float, default=0.5, help="storage GB/s per GPU")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario the flags of ``add_scenario_args`` describe (``ValueError`` if invalid)."""
    return build_scenario(
        args.preset,
        args.hardware,
        args.gpus,
        dp=args.dp,
        pp=args.pp,
        tp=args.tp,
        num_microbatches=args.microbatches,
        micro_batch_size=args.micro_batch_size,
        schedule=args.schedule,
        num_virtual=args.virtual if args.schedule == "interleaved-1f1b" else 1,
        mfu=args.mfu,
    )


def policy_from_args(args: argparse.Namespace) -> CheckpointPolicy:
    """The checkpoint policy of ``--every``, ``--redundancy`` and ``--overflow``."""
    return CheckpointPolicy(every=args.every, redundancy=args.redundancy, on_overflow=args.overflow)


def fail(err: ValueError) -> int:
    """Print ``error: ...`` to stderr; the exit code 2."""
    print(f"error: {err}", file=sys.stderr)
    return 2


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "simulate", help="what-if: checkpoint overhead of baft vs naive async vs sync"
    )
    add_scenario_args(p)
    p.add_argument(
        "--mtbf-hours", type=float, default=6.0, help="job-wide mean time between failures"
    )
    p.add_argument("--restart-s", type=float, default=60.0, help="restart + rendezvous seconds")
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args: argparse.Namespace) -> int:
    """Entry point of ``baft simulate``; returns the exit code."""
    from baft.sim.command import evaluate

    try:
        scn = scenario_from_args(args)
        if args.mtbf_hours <= 0 or args.storage_gbps <= 0 or args.restart_s < 0:
            raise ValueError("--mtbf-hours and --storage-gbps must be > 0, --restart-s >= 0")
        result = evaluate(
            scn,
            policy_from_args(args),
            mtbf_s=args.mtbf_hours * 3600.0,
            storage_Bps=args.storage_gbps * 1e9,
            restart_s=args.restart_s,
        )
    except ValueError as err:
        return fail(err)
    if args.json:
        print(json.dumps(result))
        return 0
    print(render_result(result))
    return 0


def _diff_row(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``baft-diff``: baft with differential checkpoints (gradient record + one slice per
    iteration, full_every as the model chose), next to full snapshots."""
    d = result.get("differential")
    return [(f"baft-diff (K={d['full_every']})", d["mode"])] if d else []


def render_result(result: dict[str, Any]) -> str:
    """Human-readable report of ``evaluate``'s dict (a rich table when rich is present)."""
    lay, ck = result["layout"], result["checkpoint"]
    head = (
        f"{result['preset']} on {result['gpus']} x {result['hardware']}: dp={lay['dp']} "
        f"pp={lay['pp']} tp={lay['tp']}, {lay['schedule']}, {lay['microbatches']} microbatches; "
        f"iteration {result['iteration_s']:.3f} s, bubbles {result['bubble_fraction']:.1%}\n"
        f"per GPU: state {ck['state_bytes_per_gpu'] / 1e9:.2f} GB, snapshot shard "
        f"{ck['snapshot_bytes_per_gpu'] / 1e9:.3f} GB ({ck['snapshot_s'] * 1e3:.1f} ms D2H), "
        f"redundancy send {ck['send_bytes_per_gpu'] / 1e9:.3f} GB ({ck['send_s'] * 1e3:.1f} ms), "
        f"least idle {ck['min_idle_s_per_gpu'] * 1e3:.1f} ms/iteration"
    )
    cols = ("mode", "exposed ms/iter", "exposed %", "every", "lost s/failure", "goodput loss")
    rows = [
        (
            name,
            f"{m['exposed_s'] * 1e3:.3f}",
            f"{m['exposed_fraction']:.3%}",
            str(m["interval_iters"]),
            f"{m['expected_lost_s']:.1f}",
            f"{m['goodput_loss_fraction']:.3%}",
        )
        for name, m in [*result["modes"].items(), *_diff_row(result)]
    ]
    assumptions = "\n".join(f"  {k}: {v}" for k, v in result["assumptions"].items())
    tail = f"\nbaft plan: {result['modes']['baft']['reason']}"
    if "differential" in result:
        from baft.sim.differential import summary_lines

        tail += "\n" + "\n".join(summary_lines(result["differential"]))
    tail += f"\nassumptions:\n{assumptions}"
    if result["notes"]:
        tail += "\nnotes:\n" + "\n".join(f"  {n}" for n in result["notes"])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency
        widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return head + "\n" + "\n".join(lines) + tail
    table = Table(*cols)
    for row in rows:
        table.add_row(*row)
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False).print(table)
    return head + "\n" + buf.getvalue().rstrip("\n") + tail
