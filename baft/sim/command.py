"""``baft simulate`` and ``baft plan --preset``: what-if checkpointing at cluster scale.

``simulate`` compares three ways to checkpoint every iteration (or as often as each
affords) on a simulated pipeline: ``baft`` (plan snapshot D2H copies and redundancy sends
into the bubbles, replayed on the simulator), ``naive-async`` (the same copies and sends
start right after the step and run alongside compute) and ``sync`` (training stops for the
D2H copy and the write to storage, at the Young/Daly interval). All numbers come from
the stated assumptions, printed with the results. ``plan`` shows the bubble map and where
each task lands. The arithmetic lives in ``evaluate``; the shell only parses and prints.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from typing import Any

from baft.plan.cost import CostModel
from baft.plan.planner import owned_ranges
from baft.plan.planner import plan as make_plan
from baft.plan.render import bubble_table, bubbles_to_dict, plan_table, plan_to_dict
from baft.plan.types import CheckpointPlan, CheckpointPolicy, TaskKind
from baft.sim.presets import HARDWARE, MODELS, Scenario, build_scenario, layouts
from baft.sim.schedules import SCHEDULES
from baft.sim.simulator import Background, SimResult, simulate

__all__ = ["add_plan_parser", "add_simulate_parser", "evaluate", "run_plan", "run_simulate"]

TASK_OVERHEAD_S = 50e-6
"""Per-task cost on a GPU (launch + event) assumed by the cost model."""


def _add_scenario_args(p: argparse.ArgumentParser) -> None:
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


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "simulate", help="what-if: checkpoint overhead of baft vs naive async vs sync"
    )
    _add_scenario_args(p)
    p.add_argument(
        "--mtbf-hours", type=float, default=6.0, help="job-wide mean time between failures"
    )
    p.add_argument("--restart-s", type=float, default=60.0, help="restart + rendezvous seconds")
    p.set_defaults(func=run_simulate)
    return p


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` (simulator source) on an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="show the bubble map and the checkpoint plan")
    p.add_argument(
        "--run",
        metavar="RUN_DIR",
        help="plan of a real checkpointed run (its measured bubbles) instead of a preset",
    )
    _add_scenario_args(p)
    p.add_argument("--ranks", help="comma-separated global ranks to show (default: dp=0,tp=0)")
    p.set_defaults(func=run_plan)
    return p


def _scenario(args: argparse.Namespace) -> Scenario:
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


def _cost(scn: Scenario, storage_Bps: float) -> CostModel:
    hw = scn.hardware
    return CostModel(
        copy_Bps=hw.d2h_Bps,
        net_Bps=hw.nic_Bps,
        encode_Bps=hw.host_memcpy_Bps,
        persist_Bps=storage_Bps,
        interference=0.0,
        task_overhead_s=TASK_OVERHEAD_S,
    )


def _transfers(scn: Scenario, policy: CheckpointPolicy, shards: dict[int, int]) -> dict:
    """Redundancy traffic per rank from the coding module's stripe layout."""
    from baft.store.coding import Redundancy, coding_groups, group_layouts

    red = Redundancy.parse(policy.redundancy)
    if red.kind == "none":
        return {}
    coding_groups(scn.topology, red)  # raises ValueError with the fix
    out: dict[int, list[tuple[int, int]]] = {r: [] for r in shards}
    seen: set[int] = set()
    for gl in group_layouts(scn.topology, red, shards).values():
        if id(gl) in seen:
            continue
        seen.add(id(gl))
        for t in gl.transfers():
            out[t.src_rank].append((t.dst_rank, t.nbytes))
    return {r: tuple(v) for r, v in out.items()}


def planned(
    scn: Scenario, policy: CheckpointPolicy, storage_Bps: float
) -> tuple[SimResult, dict, CheckpointPlan, dict]:
    """Base simulation, bubble maps, plan (with redundancy sends) and the transfers."""
    base = _sim(scn)
    bubbles = base.bubble_maps(scn.topology)
    lays = layouts(scn)
    cost = _cost(scn, storage_Bps)
    shards = {r: b - a for r, (a, b) in owned_ranges(bubbles, lays, cost, policy).items()}
    transfers = _transfers(scn, policy, shards)
    return base, bubbles, make_plan(bubbles, lays, cost, policy, transfers or None), transfers


def _sim(scn: Scenario, **kwargs: Any) -> SimResult:
    topo = scn.topology
    return simulate(
        scn.schedule,
        topo.num_pp,
        scn.num_microbatches,
        scn.times,
        num_virtual=scn.num_virtual,
        **kwargs,
    )


def _mode(
    exposed: float, interval: int, lag: int, recover: float, it: float, mtbf_s: float, **extra: Any
) -> dict[str, Any]:
    """One row of the comparison; lost work = (interval/2 + commit lag) iterations + recovery."""
    lost = (0.5 * interval + lag) * it + recover
    return {
        "exposed_s": exposed,
        "exposed_fraction": exposed / it,
        "interval_iters": interval,
        "expected_lost_s": lost,
        "recovery_s": recover,
        "goodput_loss_fraction": exposed / it + lost / mtbf_s,
        **extra,
    }


def _naive_background(
    scn: Scenario, shard: dict[int, int], sent: dict[int, int]
) -> dict[int, Background]:
    """Naive async: per pipeline rank, copy then send from the start of the iteration."""
    topo, hw = scn.topology, scn.hardware
    out = {}
    for pp in range(topo.num_pp):
        ranks = [r for r in shard if topo.coords(r).pp == pp]
        copy = max(shard[r] for r in ranks) / hw.d2h_Bps
        send = max(sent[r] for r in ranks) / hw.nic_Bps
        out[pp] = Background(
            compute_until_s=copy,
            compute_factor=1.0 + hw.d2h_Bps / hw.hbm_Bps,
            link_until_s=copy + send,
            link_factor=scn.times.p2p_contention,
            done_by_step_s=copy,
        )
    return out


def _layout_dict(scn: Scenario) -> dict[str, Any]:
    topo = scn.topology
    return {
        "dp": topo.num_dp,
        "pp": topo.num_pp,
        "tp": topo.num_tp,
        "schedule": scn.schedule,
        "num_virtual": scn.num_virtual,
        "microbatches": scn.num_microbatches,
        "micro_batch_size": scn.micro_batch_size,
        "global_batch_tokens": scn.global_batch_tokens,
    }


def evaluate(
    scn: Scenario,
    policy: CheckpointPolicy,
    *,
    mtbf_s: float,
    storage_Bps: float,
    restart_s: float,
) -> dict[str, Any]:
    """All numbers of ``baft simulate`` as one JSON-ready dict (pure)."""
    if mtbf_s <= 0 or storage_Bps <= 0 or restart_s < 0:
        raise ValueError("--mtbf-hours and --storage-gbps must be > 0, --restart-s >= 0")
    hw = scn.hardware
    base, bubbles, plan, transfers = planned(scn, policy, storage_Bps)
    it = base.base_iteration_s
    replay = _sim(scn, plan=plan, topology=scn.topology)
    shard = {r: rp.owned_stop - rp.owned_start for r, rp in plan.ranks.items()}
    sent = {r: sum(n for _, n in transfers.get(r, ())) for r in plan.ranks}
    state_max = max(scn.state_bytes)
    copy_s = max(shard.values()) / hw.d2h_Bps
    send_s = max(sent.values(), default=0) / hw.nic_Bps
    lagged = any(t.lag for rp in plan.ranks.values() for ts in rp.tasks.values() for t in ts)
    recover_mem = restart_s + state_max / hw.nic_Bps + state_max / hw.d2h_Bps
    recover_disk = restart_s + state_max / storage_Bps + state_max / hw.d2h_Bps
    naive = _sim(scn, background=_naive_background(scn, shard, sent))
    naive_lag = max(0, math.ceil((copy_s + send_s) / naive.iteration_s) - 1)
    sync_cost = max(shard[r] / hw.d2h_Bps + shard[r] / storage_Bps for r in shard)
    sync_n = max(1, round(math.sqrt(2.0 * sync_cost * mtbf_s) / it))
    modes = {
        "baft": _mode(
            replay.exposed_s,
            plan.interval_iters,
            int(lagged),
            recover_mem,
            it,
            mtbf_s,
            predicted_exposed_s=plan.exposed_s,
            lower_bound_s=plan.lower_bound_s,
            reason=plan.reason,
        ),
        "naive-async": _mode(naive.exposed_s, policy.every, naive_lag, recover_mem, it, mtbf_s),
        "sync": _mode(
            sync_cost / sync_n, sync_n, 0, recover_disk, it, mtbf_s, checkpoint_s=sync_cost
        ),
    }
    return {
        "preset": scn.model.name,
        "hardware": hw.name,
        "gpus": scn.topology.world_size,
        "layout": _layout_dict(scn),
        "iteration_s": it,
        "bubble_fraction": base.bubble_fraction,
        "checkpoint": {
            "state_bytes_per_gpu": state_max,
            "snapshot_bytes_per_gpu": max(shard.values()),
            "send_bytes_per_gpu": max(sent.values(), default=0),
            "snapshot_s": copy_s,
            "send_s": send_s,
            "min_idle_s_per_gpu": min(b.capacity_s() for b in bubbles.values()),
        },
        "modes": modes,
        "assumptions": _assumptions(scn, policy, mtbf_s, storage_Bps, restart_s),
        "notes": list(scn.notes),
    }


def _assumptions(
    scn: Scenario, policy: CheckpointPolicy, mtbf_s: float, storage_Bps: float, restart_s: float
) -> dict[str, Any]:
    hw, t = scn.hardware, scn.times
    return {
        "peak_bf16_flops": hw.peak_bf16_flops,
        "mfu_in_stage": hw.mfu,
        "hbm_Bps": hw.hbm_Bps,
        "d2h_Bps_per_gpu": hw.d2h_Bps,
        "nic_Bps_per_gpu": hw.nic_Bps,
        "host_memcpy_Bps_per_gpu": hw.host_memcpy_Bps,
        "storage_Bps_per_gpu": storage_Bps,
        "hardware_source": hw.source,
        "model_source": scn.model.source,
        "task_overhead_s": TASK_OVERHEAD_S,
        "restart_s": restart_s,
        "mtbf_s": mtbf_s,
        "redundancy": policy.redundancy,
        "p2p_s": t.p2p_s,
        "dp_allreduce_exposed_s": t.dp_allreduce_s,
        "optimizer_s": t.optimizer_s,
        "link_contention_factor": t.p2p_contention,
        "compute": "6*params*tokens per stage (attention quadratic term ignored), F=1/3, B=2/3",
        "state": "14 bytes/param (bf16 weight + fp32 master, exp_avg, exp_avg_sq) per TP "
        "shard; DP replicas split it (sharded snapshots)",
        "p2p": "activation bytes/tp over the NIC plus 10 us; transfers rendezvous (start once the receive is posted) and senders wait for them where torch's schedule code does",
        "dp_allreduce": "ring all-reduce of bf16 grads; only the last layer's bucket is "
        "exposed (rest overlaps backward); copies there slow it by the contention factor",
        "barrier": "all ranks wait for the slowest before the optimizer step (grad-norm all-reduce)",
        "baft": "D2H snapshot copies and redundancy sends run in bubbles (sends never in the "
        "DP all-reduce); overflow runs before the step; work next to an incoming "
        "transfer slows it by the contention factor (shared GPU PCIe/NIC link)",
        "naive_async": "copy then send start after the step; while copying, compute slows "
        "by d2h/hbm bandwidth share and pipeline transfers by the contention factor "
        "(also while sending); the step waits for the copy. Real stacks measure far "
        "more contention (GIL, allocator), so this is a floor",
        "sync": "training stops for D2H copy + write of the DP shard to storage; "
        "interval from Young/Daly sqrt(2*C*MTBF)",
        "expected_lost_s": "(interval/2 + commit lag) iterations + recovery; recovery = restart "
        "+ state from peers over the NIC (baft, naive) or from storage (sync) + H2D",
        "persist": f"baft/naive persist every {policy.persist_every} checkpoints from host "
        "memory in the background; not counted",
        "encode": "parity XOR on the receiving host, off the GPU timeline; not counted",
    }


def _policy(args: argparse.Namespace) -> CheckpointPolicy:
    return CheckpointPolicy(every=args.every, redundancy=args.redundancy, on_overflow=args.overflow)


def _fail(err: ValueError) -> int:
    print(f"error: {err}", file=sys.stderr)
    return 2


def run_simulate(args: argparse.Namespace) -> int:
    """Entry point of ``baft simulate``; returns the exit code."""
    try:
        scn = _scenario(args)
        result = evaluate(
            scn,
            _policy(args),
            mtbf_s=args.mtbf_hours * 3600.0,
            storage_Bps=args.storage_gbps * 1e9,
            restart_s=args.restart_s,
        )
    except ValueError as err:
        return _fail(err)
    if args.json:
        print(json.dumps(result))
        return 0
    print(render_result(result))
    return 0


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
        for name, m in result["modes"].items()
    ]
    assumptions = "\n".join(f"  {k}: {v}" for k, v in result["assumptions"].items())
    tail = f"\nbaft plan: {result['modes']['baft']['reason']}\nassumptions:\n{assumptions}"
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


def run_plan(args: argparse.Namespace) -> int:
    """Entry point of ``baft plan``: a real run's profile (``--run``) or a simulator preset."""
    if getattr(args, "run", None):
        from baft.profile.planrun import run_plan_from_run

        try:
            return run_plan_from_run(args)
        except ValueError as err:
            return _fail(err)
    try:
        scn = _scenario(args)
        policy = _policy(args)
        _, bubbles, plan, _ = planned(scn, policy, args.storage_gbps * 1e9)
        topo = scn.topology
        if args.ranks:
            ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
            bad = [r for r in ranks if r not in plan.ranks]
            if bad:
                raise ValueError(f"--ranks {bad} outside 0..{topo.world_size - 1}")
        else:
            ranks = [topo.rank_of(pp, 0, 0) for pp in range(topo.num_pp)]
    except ValueError as err:
        return _fail(err)
    if args.json:
        shown = set(ranks)
        out = plan_to_dict(plan)
        out["ranks"] = {k: v for k, v in out["ranks"].items() if int(k) in shown}
        print(
            json.dumps(
                {
                    "bubble_maps": bubbles_to_dict({r: bubbles[r] for r in sorted(shown)}),
                    "plan": out,
                }
            )
        )
        return 0
    print(bubble_table(bubbles, ranks))
    print()
    print(plan_table(plan, bubbles, ranks))
    print()
    print(plan.reason)
    snaps = sum(
        t.nbytes
        for rp in plan.ranks.values()
        for ts in rp.tasks.values()
        for t in ts
        if t.kind is TaskKind.SNAPSHOT
    )
    print(f"\n{snaps / 1e9:.2f} GB of snapshot copies planned inside bubbles across all ranks")
    return 0
