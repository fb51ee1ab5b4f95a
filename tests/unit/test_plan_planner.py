"""Planner on hand-computed instances: ownership split, chunking, spill, stretch, sends."""

from __future__ import annotations

import pytest

from baft.plan.cost import CostModel
from baft.plan.planner import owned_ranges, plan, split_bytes
from baft.plan.types import (
    BubbleMap,
    CheckpointPlan,
    CheckpointPolicy,
    Slot,
    StateLayout,
    TaskKind,
    TensorSpec,
)
from baft.topology import Topology

MiB = 1 << 20
# 1 MiB/s and no task overhead: one 1 MiB chunk costs exactly 1.0 s.
UNIT = CostModel(copy_Bps=2.0**20, net_Bps=2.0**20, task_overhead_s=0.0)
# Byte-level split tests: owner boundaries may cut tensors (alignment has its own test).
POLICY = CheckpointPolicy(
    max_chunk_bytes=MiB, min_chunk_bytes=64 << 10, persist_every=0, align_to_tensors=False
)


def bubble(
    rank: int, idles: list[float], kinds: list[str] | None = None, it: float = 100.0
) -> BubbleMap:
    kinds = kinds or ["p2p"] * (len(idles) - 1) + ["pre_step"]
    slots = tuple(
        Slot(slot_id="pre_step" if k == "pre_step" else f"w{j}", idle_s=x, kind=k)
        for j, (x, k) in enumerate(zip(idles, kinds, strict=True))
    )
    return BubbleMap(rank=rank, slots=slots, iteration_s=it)


def layout(rank: int, nbytes: int, replicas: tuple[int, ...]) -> StateLayout:
    half = nbytes // 2
    tensors = (
        TensorSpec(name="model.w", nbytes=half),
        TensorSpec(name="optim.w.exp_avg", nbytes=nbytes - half),
    )
    return StateLayout(rank=rank, tensors=tensors, replicas=replicas)


def test_split_proportional_to_capacity_zero_exposure() -> None:
    bubbles = {0: bubble(0, [1.5, 0.5]), 1: bubble(1, [0.0, 1.0])}
    layouts = {r: layout(r, 3 * MiB, (0, 1)) for r in (0, 1)}
    p = plan(bubbles, layouts, UNIT, POLICY)
    assert (p.ranks[0].owned_start, p.ranks[0].owned_stop) == (0, 2 * MiB)
    assert (p.ranks[1].owned_start, p.ranks[1].owned_stop) == (2 * MiB, 3 * MiB)
    assert p.exposed_s == 0.0 and p.lower_bound_s == 0.0 and p.interval_iters == 1
    t0 = p.ranks[0].tasks
    assert [(t.chunk_id, t.nbytes, t.offset) for t in t0["w0"]] == [(0, MiB, 0), (1, MiB // 2, MiB)]
    assert [(t.chunk_id, t.nbytes, t.offset) for t in t0["pre_step"]] == [
        (2, MiB // 2, 3 * MiB // 2)
    ]
    assert [(t.chunk_id, t.nbytes) for t in p.ranks[1].tasks["pre_step"]] == [(3, MiB)]
    assert [(c.chunk_id, c.start, c.stop) for c in p.ranks[1].owned] == [(3, 2 * MiB, 3 * MiB)]
    assert p.reason.startswith("2 ranks in 1 DP replica groups")
    assert (
        "rank 0 has 2000 ms of idle in 2 bubbles, snapshots 2.0 MiB in 3 chunks, spills 0 B"
        in p.reason
    )
    assert "lower bound 0 ms" in p.reason


def test_spill_exposure_exact_and_amortised_by_every() -> None:
    bubbles = {0: bubble(0, [0.5, 0.5])}
    layouts = {0: layout(0, 3 * MiB, (0,))}
    p = plan(bubbles, layouts, UNIT, POLICY)
    spilled = p.ranks[0].spilled
    assert [(t.kind, t.nbytes, t.lag) for t in spilled] == [(TaskKind.SNAPSHOT, MiB, 0)] * 2
    assert p.exposed_s == 2.0 and p.lower_bound_s == 2.0
    assert "bubbles hold only 33% of the snapshot work" in p.reason
    p2 = plan(
        bubbles, layouts, UNIT, CheckpointPolicy(every=2, max_chunk_bytes=MiB, min_chunk_bytes=1024)
    )
    assert (p2.interval_iters, p2.exposed_s, p2.lower_bound_s) == (2, 1.0, 1.0)


def test_spill_is_levelled_across_replicas() -> None:
    bubbles = {0: bubble(0, [1.0]), 1: bubble(1, [0.0])}
    layouts = {r: layout(r, 4 * MiB, (0, 1)) for r in (0, 1)}
    p = plan(bubbles, layouts, UNIT, POLICY)
    assert p.ranks[0].owned_stop == 5 * MiB // 2
    assert p.ranks[0].exposed_s == p.ranks[1].exposed_s == 1.5
    assert p.exposed_s == p.lower_bound_s == 1.5


def test_stretch_picks_smallest_interval_within_target() -> None:
    # zero-bubble schedule: nothing idle, 3 s of snapshot per checkpoint, 100 s iterations.
    bubbles = {0: bubble(0, [0.0, 0.0], it=100.0)}
    layouts = {0: layout(0, 3 * MiB, (0,))}
    pol = CheckpointPolicy(on_overflow="stretch", max_chunk_bytes=MiB, min_chunk_bytes=1024)
    p = plan(bubbles, layouts, UNIT, pol)
    assert p.interval_iters == 3 and p.exposed_s == 1.0 and p.lower_bound_s == 1.0
    assert "stretched from every 1" in p.reason
    spill = plan(bubbles, layouts, UNIT, POLICY)
    assert spill.interval_iters == 1 and spill.exposed_s == 3.0
    assert "overflow=stretch lowers the frequency" in spill.reason


def test_stretch_keeps_interval_when_it_fits() -> None:
    bubbles = {0: bubble(0, [4.0])}
    layouts = {0: layout(0, 3 * MiB, (0,))}
    p = plan(bubbles, layouts, UNIT, CheckpointPolicy(on_overflow="stretch", every=2))
    assert p.interval_iters == 2 and p.exposed_s == 0.0


def test_sends_every_iteration_after_snapshots_never_in_collectives() -> None:
    bubbles = {0: bubble(0, [2.0, 2.0, 2.0], ["p2p", "collective", "pre_step"])}
    layouts = {0: layout(0, MiB, (0,))}
    p = plan(bubbles, layouts, UNIT, POLICY, transfers={0: ((5, MiB),)})
    tasks = p.ranks[0].tasks
    assert [t.kind for t in tasks["w0"]] == [TaskKind.SNAPSHOT]
    assert "w1" not in tasks
    sends = tasks["pre_step"]
    assert [(t.kind, t.lag, t.nbytes, t.offset, t.stream) for t in sends] == [
        (TaskKind.SEND, 0, MiB, 0, 0)
    ]
    assert p.ranks[0].peers == (5,)
    assert p.exposed_s == 0.0


def test_sends_with_interval_two_spill_into_next_iteration() -> None:
    bubbles = {0: bubble(0, [2.0, 2.0, 2.0], ["p2p", "collective", "pre_step"])}
    layouts = {0: layout(0, 5 * MiB, (0,))}
    pol = CheckpointPolicy(every=2, max_chunk_bytes=MiB, min_chunk_bytes=1024)
    p = plan(bubbles, layouts, UNIT, pol, transfers={0: ((7, 3 * MiB),)})
    tasks = p.ranks[0].tasks
    lag0 = [
        (sid, t.nbytes, t.offset)
        for sid, ts in tasks.items()
        for t in ts
        if t.kind is TaskKind.SEND and t.lag == 0
    ]
    lag1 = [
        (sid, t.nbytes, t.offset)
        for sid, ts in tasks.items()
        for t in ts
        if t.kind is TaskKind.SEND and t.lag == 1
    ]
    assert lag0 == [("pre_step", MiB, 0)]
    assert lag1 == [("w0", MiB, MiB), ("w0", MiB, 2 * MiB)]
    assert p.exposed_s == 0.0 and p.ranks[0].spilled == ()


def test_interference_counts_in_bubble_copies() -> None:
    cost = CostModel(copy_Bps=2.0**20, task_overhead_s=0.0, interference=0.25)
    bubbles = {0: bubble(0, [1.0, 1.0]), 1: bubble(1, [4.0])}
    layouts = {r: layout(r, 2 * MiB, (0, 1)) for r in (0, 1)}
    p = plan(bubbles, layouts, cost, POLICY)
    # levelling interference alone gives an even split: 1 MiB each, 0.25 s exposed each.
    assert p.ranks[0].owned_stop == MiB
    assert p.exposed_s == pytest.approx(0.25) and p.lower_bound_s == pytest.approx(0.25)


def test_split_bytes_exact_sum_and_determinism() -> None:
    shares = split_bytes(10, [3, 3, 3], [0.0, 0.0, 0.0], UNIT, POLICY)
    assert shares == [4, 3, 3]
    assert split_bytes(0, [1, 2], [0.0, 0.0], UNIT, POLICY) == [0, 0]


@pytest.mark.parametrize(
    ("layouts", "bubbles", "match"),
    [
        ({0: layout(0, 8, (0, 1)), 1: layout(1, 9, (0, 1))}, None, "different state sizes"),
        ({0: layout(0, 8, (0, 1)), 1: layout(1, 8, (1,))}, None, "disagree about their replicas"),
        ({0: layout(0, 8, (1,))}, None, "must include the rank itself"),
        ({0: layout(0, 8, (0,))}, {}, "a StateLayout or a BubbleMap but not both"),
    ],
)
def test_validation_errors(layouts: dict, bubbles: dict | None, match: str) -> None:
    bubbles = {r: bubble(r, [1.0]) for r in layouts} if bubbles is None else bubbles
    with pytest.raises(ValueError, match=match):
        plan(bubbles, layouts, UNIT, POLICY)


def big_instance(num_pp: int = 64, num_dp: int = 64) -> tuple[dict, dict, dict]:
    topo = Topology(num_pp=num_pp, num_dp=num_dp, ranks_per_node=8)
    tensors = tuple(
        TensorSpec(name=f"model.layers.{k // 2}.w{k % 2}.weight", nbytes=(1 + k % 3) * MiB)
        for k in range(100)
    )
    layouts, bubbles, transfers = {}, {}, {}
    for r in range(topo.world_size):
        layouts[r] = StateLayout(rank=r, tensors=tensors, replicas=topo.replicas(r))
        idles = [0.002 + 0.001 * ((r + k) % 5) for k in range(15)] + [0.003]
        bubbles[r] = bubble(r, idles, it=1.0)
        transfers[r] = (((r + 8) % topo.world_size, 2 * MiB),)
    return layouts, bubbles, transfers


def check_complete(p: CheckpointPlan, layouts: dict) -> None:
    for r, rp in p.ranks.items():
        group = layouts[r].replicas
        assert sum(c.nbytes for c in rp.owned) == rp.owned_stop - rp.owned_start
        snaps = [t for ts in rp.tasks.values() for t in ts if t.kind is TaskKind.SNAPSHOT]
        snaps += [t for t in rp.spilled if t.kind is TaskKind.SNAPSHOT]
        assert sorted(t.chunk_id for t in snaps) == [c.chunk_id for c in rp.owned]
        if rp.rank == group[-1]:
            assert rp.owned_stop == layouts[r].nbytes
        if rp.rank == group[0]:
            assert rp.owned_start == 0


def test_plans_4096_ranks_completely() -> None:
    """Completeness at scale; how fast is measured in benchmarks/planner_speed.py, not here."""
    layouts, bubbles, transfers = big_instance()
    p = plan(bubbles, layouts, CostModel(), CheckpointPolicy(), transfers=transfers)
    assert len(p.ranks) == 4096
    check_complete(p, layouts)
    assert p.exposed_s == 0.0 and p.lower_bound_s == 0.0


def test_identical_groups_share_tasks_and_match_planning_them_alone() -> None:
    """The memo that makes 4096 ranks fast must not change any rank's plan."""
    topo = Topology(num_pp=2, num_dp=2, num_tp=2, ranks_per_node=2)
    tensors = tuple(TensorSpec(name=f"t{k}", nbytes=(1 + k % 3) * MiB) for k in range(9))
    layouts, bubbles, transfers = {}, {}, {}
    for r in range(topo.world_size):
        c = topo.coords(r)
        layouts[r] = StateLayout(rank=r, tensors=tensors, replicas=topo.replicas(r))
        # tp ranks of one stage have equal bubbles (fresh objects); stages and dp differ
        idles = [1.0 + c.pp + 0.5 * c.dp, 2.0, 0.5 * (1 + c.pp)]
        bubbles[r] = bubble(r, idles)
        transfers[r] = ((r ^ 1, (2 + c.pp) * MiB),)
    whole = plan(bubbles, layouts, UNIT, POLICY, transfers=transfers)
    for group in {layouts[r].replicas for r in layouts}:
        sub = {r: bubbles[r] for r in group}
        alone = plan(
            sub, {r: layouts[r] for r in group}, UNIT, POLICY, {r: transfers[r] for r in group}
        )
        for r in group:
            assert whole.ranks[r] == alone.ranks[r]
    a, b = topo.rank_of(pp=1, dp=0, tp=0), topo.rank_of(pp=1, dp=0, tp=1)
    assert whole.ranks[a].tasks is whole.ranks[b].tasks  # shared, not copied
    assert whole.ranks[a].peers == (a ^ 1,) and whole.ranks[b].peers == (b ^ 1,)
    assert whole.ranks[a].tasks != whole.ranks[topo.rank_of(pp=1, dp=1, tp=0)].tasks


def test_owned_ranges_are_the_plans_ranges_without_transfers() -> None:
    layouts, bubbles, _ = big_instance(num_pp=4, num_dp=4)
    for r in list(bubbles)[::3]:  # make some members of some groups differ
        bubbles[r] = bubble(r, [0.001 * (1 + r % 7)] * 4 + [0.002], it=1.0)
    p = plan(bubbles, layouts, CostModel(), CheckpointPolicy())
    got = owned_ranges(bubbles, layouts, CostModel(), CheckpointPolicy())
    assert got == {r: (rp.owned_start, rp.owned_stop) for r, rp in p.ranks.items()}
    assert len({stop - start for start, stop in got.values()}) > 2  # unequal shares


def test_plan_restores_the_garbage_collector_state() -> None:
    import gc

    layouts, bubbles, transfers = big_instance(num_pp=2, num_dp=4)
    assert gc.isenabled()
    plan(bubbles, layouts, CostModel(), CheckpointPolicy(), transfers=transfers)
    assert gc.isenabled()
    gc.disable()
    try:
        plan(bubbles, layouts, CostModel(), CheckpointPolicy(), transfers=transfers)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError):
        plan(bubbles, {}, CostModel(), CheckpointPolicy())
    assert gc.isenabled()


def test_owner_boundaries_snap_to_tensor_boundaries() -> None:
    from baft.plan.planner import snap_to_tensors
    from baft.plan.types import StateLayout, TensorSpec

    lay = StateLayout(
        rank=0,
        tensors=tuple(
            TensorSpec(name=f"t{i}", nbytes=n) for i, n in enumerate([400, 100, 300, 200])
        ),
        replicas=(0, 1, 2),
    )
    # cuts at 330 and 660 move to the nearest tensor edges 400 and 800
    assert snap_to_tensors([330, 330, 340], lay) == [400, 400, 200]
    assert sum(snap_to_tensors([1000, 0, 0], lay)) == 1000
    bubbles = {r: bubble(r, [1.0, 1.0]) for r in (0, 1)}
    layouts = {r: StateLayout(rank=r, tensors=lay.tensors, replicas=(0, 1)) for r in (0, 1)}
    p = plan(bubbles, layouts, UNIT, CheckpointPolicy(max_chunk_bytes=MiB, min_chunk_bytes=64))
    edges = {0, 400, 500, 800, 1000}
    assert p.ranks[0].owned_stop in edges and p.ranks[1].owned_start == p.ranks[0].owned_stop
