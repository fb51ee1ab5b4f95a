"""What-if checkpointing at cluster scale: the arithmetic of ``baft simulate`` and ``baft plan``.

``simulate`` compares three ways to checkpoint every iteration (or as often as each
affords) on a simulated pipeline: ``baft`` (plan snapshot D2H copies and redundancy sends
into the bubbles, replayed on the simulator), ``naive-async`` (the same copies and sends
start right after the step and run alongside compute) and ``sync`` (training stops for the
D2H copy and the write to storage, at the Young/Daly interval). All numbers come from
the stated assumptions, printed with the results. ``plan`` shows the bubble map and where
each task lands. The arithmetic lives here (``evaluate``, ``planned``); the flags, the
rendering and the printing live in ``baft.cli.simulate`` and ``baft.cli.plan``.
"""

from __future__ import annotations

import math
from typing import Any

from baft.plan.cost import CostModel
from baft.plan.planner import owned_ranges
from baft.plan.planner import plan as make_plan
from baft.plan.types import CheckpointPlan, CheckpointPolicy, StateLayout
from baft.sim.differential import model_differential, payload_layouts
from baft.sim.differential import to_dict as differential_dict
from baft.sim.presets import Scenario, layouts
from baft.sim.simulator import Background, SimResult, simulate

__all__ = ["TASK_OVERHEAD_S", "evaluate", "planned"]

TASK_OVERHEAD_S = 50e-6
"""Per-task cost on a GPU (launch + event) assumed by the cost model."""


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
    scn: Scenario,
    policy: CheckpointPolicy,
    storage_Bps: float,
    lays: dict[int, StateLayout] | None = None,
) -> tuple[SimResult, dict, CheckpointPlan, dict]:
    """Base simulation, bubble maps, plan (with redundancy sends) and the transfers.

    ``lays``: what each rank protects per iteration (default: its whole state)."""
    base = _sim(scn)
    bubbles = base.bubble_maps(scn.topology)
    lays = lays or layouts(scn)
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
        raise ValueError(
            f"mtbf_s={mtbf_s} and storage_Bps={storage_Bps} must be > 0, restart_s={restart_s} >= 0"
        )
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
    per_pp = base.bubble_maps()
    differential = model_differential(
        scn,
        [per_pp[pp].capacity_s() for pp in range(scn.topology.num_pp)],
        iteration_s=it,
        redundancy=policy.redundancy,
    )
    sync_n = max(1, round(math.sqrt(2.0 * sync_cost * mtbf_s) / it))
    if differential.full_every == 1:  # the same payload as baft's: reuse its row
        diff_mode = _mode(
            replay.exposed_s,
            plan.interval_iters,
            int(lagged),
            recover_mem,
            it,
            mtbf_s,
            full_every=1,
            predicted_exposed_s=plan.exposed_s,
            reason=plan.reason,
        )
    else:
        diff_mode = _differential_mode(
            scn, policy, storage_Bps, differential.full_every, it, mtbf_s, recover_mem
        )
    diff_mode["replay_s"] = differential.replay_s
    diff_mode["expected_lost_s"] += differential.replay_s
    diff_mode["goodput_loss_fraction"] += differential.replay_s / mtbf_s
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
        "differential": {**differential_dict(differential), "mode": diff_mode},
        "assumptions": _assumptions(scn, policy, mtbf_s, storage_Bps, restart_s),
        "notes": list(scn.notes),
    }


def _differential_mode(
    scn: Scenario,
    policy: CheckpointPolicy,
    storage_Bps: float,
    k: int,
    it: float,
    mtbf_s: float,
    recover_s: float,
) -> dict[str, Any]:
    """The ``baft`` row with differential payloads (record + largest slice) planned and
    replayed on the simulator like full snapshots."""
    _, _, plan, _ = planned(scn, policy, storage_Bps, payload_layouts(scn, k))
    run = _sim(scn, plan=plan, topology=scn.topology)
    lagged = any(t.lag for rp in plan.ranks.values() for ts in rp.tasks.values() for t in ts)
    return _mode(
        run.exposed_s,
        plan.interval_iters,
        int(lagged),
        recover_s,
        it,
        mtbf_s,
        full_every=k,
        predicted_exposed_s=plan.exposed_s,
        reason=plan.reason,
    )


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
        "differential": "per GPU and iteration: the gradient record of the last step "
        "(4 B/param, fp32 main grads) + the largest of K rotating full-state slices "
        "(whole weights with their optimizer state), both split over the DP replicas; K is "
        "the smallest whose D2H copy + redundancy send fits every GPU's bubbles; the store "
        "keeps K+1 payloads (padded to the largest slice); recovery replays <= K-1 steps; "
        "right after a fresh start or a DCP restore the first K-1 versions are not rebuildable",
    }
