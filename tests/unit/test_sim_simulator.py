"""Simulator: exact bubble fractions, bubble maps, plan replay and background load."""

from __future__ import annotations

import pytest

from baft.plan.cost import CostModel
from baft.plan.planner import plan
from baft.plan.types import (
    CheckpointPlan,
    CheckpointPolicy,
    RankPlan,
    Slot,
    StateLayout,
    Task,
    TaskKind,
    TensorSpec,
)
from baft.sim.simulator import Background, StageTimes, simulate
from baft.topology import Topology

MiB = 1 << 20


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 1.0), (0.3, 0.7)])
def test_bubble_fraction_single_stage_schedules(
    schedule: str, p: int, m: int, f: float, b: float
) -> None:
    r = simulate(schedule, p, m, StageTimes(forward_s=f, backward_s=b))
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
    assert r.base_iteration_s == pytest.approx((m + p - 1) * (f + b), rel=1e-12)


@pytest.mark.parametrize(
    ("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 4, 2), (8, 16, 2), (2, 6, 4)]
)
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 1.0)])
def test_bubble_fraction_interleaved(p: int, m: int, v: int, f: float, b: float) -> None:
    r = simulate("interleaved-1f1b", p, m, StageTimes(forward_s=f, backward_s=b), num_virtual=v)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)


def test_zero_bubble_v_schedule_beats_1f1b() -> None:
    times = StageTimes(forward_s=1.0, backward_s=2.0)
    zbv = simulate("zbv", 4, 8, times, num_virtual=2)
    one = simulate("1f1b", 4, 8, times)
    inter = simulate("interleaved-1f1b", 4, 8, times, num_virtual=2)
    assert zbv.bubble_fraction < inter.bubble_fraction < one.bubble_fraction
    assert zbv.bubble_fraction == pytest.approx(3.0 / 51.0, rel=1e-9)  # 3 idle units of 51


def test_bubble_maps_slots_and_topology() -> None:
    times = StageTimes(forward_s=1.0, backward_s=2.0, dp_allreduce_s=0.5, optimizer_s=0.25)
    r = simulate("1f1b", 2, 2, times)
    # rank 0: F0 [0,1] F1 [1,2], B0 waits for rank 1's B0 [2,4], B1 for its B1 [5,7]
    assert [(s.slot_id, s.idle_s, s.kind) for s in r.slots[0]] == [
        ("w0", 2.0, "p2p"),
        ("w1", 1.0, "p2p"),
        ("dp_allreduce", 0.5, "collective"),
        ("pre_step", 0.0, "pre_step"),
    ]
    assert [(s.slot_id, s.idle_s) for s in r.slots[1]] == [
        ("w0", 1.0),
        ("dp_allreduce", 0.5),
        ("pre_step", 2.0),
    ]
    assert r.base_iteration_s == 9.0 + 0.5 + 0.25
    assert r.blocked_s == {0: 3.5, 1: 3.5}
    maps = r.bubble_maps(Topology(num_pp=2, num_dp=2, ranks_per_node=2))
    assert sorted(maps) == [0, 1, 2, 3] and maps[3].slots == r.slots[1] and maps[2].rank == 2
    kinds = [i.kind for i in r.timeline[0]]
    assert kinds == ["F", "F", "wait", "B", "wait", "B", "allreduce", "step"]


def test_p2p_adds_waits() -> None:
    r = simulate("1f1b", 2, 2, StageTimes(forward_s=1.0, backward_s=2.0, p2p_s=0.25))
    assert r.slots[1][0].idle_s == 1.25  # first activation: F of rank 0 plus the transfer
    # Rendezvous: rank 1 posts the receive of F1 only after B0 (4.25), so F1's activation
    # (fired at 2.0) lands at 4.5, not 2.25; then B0's gradient reaches rank 0 at 4.5,
    # B1's (fired 7.5) at 7.75, and rank 0's last backward ends at 9.75.
    assert [(i.kind, i.start, i.end) for i in r.timeline[1] if i.kind in "FB"] == [
        ("F", 1.25, 2.25),
        ("B", 2.25, 4.25),
        ("F", 4.5, 5.5),
        ("B", 5.5, 7.5),
    ]
    assert r.base_iteration_s == 9.75
    # rank 1 waits at the end of the step for its last gradient send to rank 0 to land
    assert r.slots[1][-2] == Slot(slot_id="w2", idle_s=0.25, kind="p2p")


def test_senders_wait_for_slow_receivers_as_torch_waits_for_sends() -> None:
    """GPipe waits for its forward sends before the first backward and for its backward
    sends at the end: a slow receiver idles the sender there (measured on gloo)."""
    r = simulate("gpipe", 2, 3, StageTimes(forward_s=(1.0, 2.0), backward_s=(2.0, 1.0)))
    # rank 1 posts F2's receive after its F1 ends (t=5): rank 0 (forwards done at 3)
    # waits 2 s for that send before its first backward's wait (which ends at 8).
    assert [(i.kind, i.start, i.end) for i in r.timeline[0] if i.kind == "wait"][0] == (
        "wait",
        3.0,
        8.0,
    )
    # rank 1 ends its backwards at 10, but rank 0 posts the receive of the last gradient
    # only after its B1 (t=12): rank 1 idles 2 s in a send wait at the end of the step
    # (a slot), then 2 s more before the step while rank 0 runs B2
    assert [(x.slot_id, x.idle_s) for x in r.slots[1]] == [
        ("w0", 1.0),
        ("w1", 2.0),
        ("pre_step", 2.0),
    ]
    assert r.base_iteration_s == 14.0


def test_trace_replay_takes_per_action_times_and_start_skew() -> None:
    base = StageTimes(forward_s=1.0, backward_s=1.0)
    slow = StageTimes(forward_s=1.0, backward_s=1.0, per_action={(0, "F", 0): 3.0})
    # rank 1 waits for rank 0's first forward: 1 s, or 3 s when that forward took 3 s
    assert simulate("gpipe", 2, 2, base).slots[1][0].idle_s == 1.0
    assert simulate("gpipe", 2, 2, slow).slots[1][0].idle_s == 3.0
    # a rank that starts 0.75 s late waits only 0.25 s for the same input
    late = StageTimes(forward_s=1.0, backward_s=1.0, start_s=(0.0, 0.75))
    assert simulate("gpipe", 2, 2, late).slots[1][0].idle_s == 0.25


def _one_rank_plan(
    slot: str, secs: float, spill: float = 0.0, lag: int = 0, interval: int = 1
) -> CheckpointPlan:
    task = Task(kind=TaskKind.SEND, chunk_id=0, nbytes=1, est_s=secs, lag=lag)
    spilled = (Task(kind=TaskKind.SNAPSHOT, chunk_id=0, nbytes=1, est_s=spill),) if spill else ()
    rp = RankPlan(
        rank=1,
        owned=(),
        owned_start=0,
        owned_stop=0,
        tasks={slot: (task,)},
        spilled=spilled,
        exposed_s=0.0,
    )
    empty = RankPlan(
        rank=0, owned=(), owned_start=0, owned_stop=0, tasks={}, spilled=(), exposed_s=0.0
    )
    return CheckpointPlan(
        ranks={0: empty, 1: rp},
        interval_iters=interval,
        exposed_s=0.0,
        lower_bound_s=0.0,
        reason="",
    )


def test_replay_uses_the_send_wait_at_the_end_of_the_step() -> None:
    times = StageTimes(forward_s=(1.0, 2.0), backward_s=(2.0, 1.0))
    base = simulate("gpipe", 2, 3, times)  # rank 1: w1 is its 2 s send wait after B2
    assert [(x.slot_id, x.idle_s) for x in base.slots[1]][1] == ("w1", 2.0)
    fits = simulate("gpipe", 2, 3, times, plan=_one_rank_plan("w1", 2.0))
    assert fits.exposed_s == 0.0
    assert ("ckpt", 10.0, 12.0, "slot@end") in [
        (i.kind, i.start, i.end, i.label) for i in fits.timeline[1]
    ]
    # 3 s: past the send wait, but the pre-step idle (rank 0 runs B2 until 14) absorbs it
    assert simulate("gpipe", 2, 3, times, plan=_one_rank_plan("w1", 3.0)).exposed_s == 0.0
    assert simulate("gpipe", 2, 3, times, plan=_one_rank_plan("w1", 5.0)).exposed_s == 1.0


def test_replay_tasks_inside_idle_cost_nothing_excess_delays() -> None:
    times = StageTimes(forward_s=1.0, backward_s=2.0)
    base = simulate("1f1b", 2, 2, times)
    assert base.slots[1][0].slot_id == "w0" and base.slots[1][0].idle_s == 1.0
    fits = simulate("1f1b", 2, 2, times, plan=_one_rank_plan("w0", 1.0))
    assert fits.iteration_s == base.base_iteration_s and fits.exposed_s == 0.0
    over = simulate("1f1b", 2, 2, times, plan=_one_rank_plan("w0", 1.5))
    assert over.exposed_s == 0.5  # the excess delays rank 1 and the whole pipeline
    pre = simulate("1f1b", 2, 2, times, plan=_one_rank_plan("pre_step", 2.0))
    assert pre.exposed_s == 0.0  # rank 1 idles 2.0 before the step
    spill = simulate("1f1b", 2, 2, times, plan=_one_rank_plan("pre_step", 2.0, spill=0.75))
    assert spill.exposed_s == 0.75
    lagged = simulate("1f1b", 2, 2, times, plan=_one_rank_plan("w0", 3.0, lag=1, interval=4))
    assert lagged.checkpoint_iteration_s == 11.0 and lagged.exposed_s == 2.0 / 4


def test_replay_contention_slows_overlapping_transfer() -> None:
    times = StageTimes(forward_s=1.0, backward_s=2.0, p2p_s=0.5, p2p_contention=2.0)
    base = simulate("1f1b", 2, 2, times)
    # rank 1 waits 1.5 for its first input (F0 of rank 0 ends at 1.0, transfer 0.5)
    r = simulate("1f1b", 2, 2, times, plan=_one_rank_plan("w0", 1.2))
    # tasks [0, 1.2] overlap the transfer [1.0, 1.5] for 0.2 s -> transfer 0.2 s longer
    assert r.exposed_s == pytest.approx(0.2, rel=1e-12)
    assert base.slots[1][0].idle_s == 1.5


def test_unknown_slot_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not have"):
        simulate(
            "1f1b", 2, 2, StageTimes(forward_s=1.0, backward_s=2.0), plan=_one_rank_plan("w9", 1.0)
        )


def test_background_slows_compute_until_done() -> None:
    times = StageTimes(forward_s=1.0, backward_s=2.0)
    bg = {0: Background(compute_until_s=2.0, compute_factor=2.0, done_by_step_s=0.0)}
    r = simulate("1f1b", 2, 2, times, background=bg)
    # rank 0's F0 takes 2.0 instead of 1.0 and everything downstream shifts by 1.0
    assert r.exposed_s == 1.0
    late = simulate("1f1b", 2, 2, times, background={1: Background(done_by_step_s=20.0)})
    assert late.iteration_s == 20.0


def test_planned_replay_matches_prediction_without_contention() -> None:
    times = StageTimes(forward_s=0.01, backward_s=0.02, p2p_s=0.001, dp_allreduce_s=0.004)
    topo = Topology(num_pp=4, num_dp=2, ranks_per_node=2)
    base = simulate("1f1b", 4, 8, times)
    bubbles = base.bubble_maps(topo)
    lay = {
        g: StateLayout(
            rank=g, tensors=(TensorSpec(name="w", nbytes=40 * MiB),), replicas=topo.replicas(g)
        )
        for g in range(8)
    }
    cost = CostModel(copy_Bps=2e9, net_Bps=1e9)
    for nbytes, every in ((40 * MiB, 1), (400 * MiB, 1), (400 * MiB, 3)):
        lay = {
            g: StateLayout(
                rank=g, tensors=(TensorSpec(name="w", nbytes=nbytes),), replicas=topo.replicas(g)
            )
            for g in range(8)
        }
        p = plan(
            bubbles,
            lay,
            cost,
            CheckpointPolicy(every=every),
            transfers={g: (((g + 2) % 8, 4 * MiB),) for g in range(8)},
        )
        r = simulate("1f1b", 4, 8, times, plan=p, topology=topo)
        # tasks never exceed their slot, so only spilled work shows: replay == prediction
        assert r.exposed_s == pytest.approx(p.exposed_s, rel=1e-6, abs=1e-12)
