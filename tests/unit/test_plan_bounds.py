"""Lower bound, exact small-instance solver and property tests of the planner."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baft.plan.bounds import Exposure, exact_exposed, level_split, lower_bound
from baft.plan.cost import CostModel
from baft.plan.planner import plan
from baft.plan.types import (
    BubbleMap,
    CheckpointPlan,
    CheckpointPolicy,
    Slot,
    StateLayout,
    TaskKind,
    TensorSpec,
)

KINDS = ("p2p", "collective")


def make_instance(
    rng: random.Random,
    *,
    num_groups: int,
    num_dp: int,
    num_slots: int,
    quantum: int,
    max_units: int,
) -> tuple[dict[int, BubbleMap], dict[int, StateLayout]]:
    bubbles, layouts = {}, {}
    for g in range(num_groups):
        group = tuple(g * num_dp + d for d in range(num_dp))
        units = rng.randint(0, max_units)
        cut = rng.randint(0, units)
        tensors = (
            TensorSpec(name=f"g{g}.a", nbytes=cut * quantum),
            TensorSpec(name=f"g{g}.b", nbytes=(units - cut) * quantum),
        )
        for r in group:
            layouts[r] = StateLayout(rank=r, tensors=tensors, replicas=group)
            slots = [
                Slot(
                    slot_id=f"w{k}",
                    idle_s=rng.choice([0.0, rng.uniform(0.0, 3.0)]),
                    kind=rng.choice(KINDS),
                )
                for k in range(num_slots - 1)
            ]
            slots.append(Slot(slot_id="pre_step", idle_s=rng.uniform(0.0, 1.0), kind="pre_step"))
            bubbles[r] = BubbleMap(rank=r, slots=tuple(slots), iteration_s=10.0)
    return bubbles, layouts


def test_level_split_exact() -> None:
    # g0 flat at 0 up to y=2 then slope 1; g1 starts at 1 and has slope 1 from y=0.
    curves = [Exposure(points=((0.0, 0.0), (2.0, 0.0))), Exposure(points=((0.0, 1.0),))]
    level, ys = level_split(curves, 6.0)
    assert level == 2.5 and ys == [4.5, 1.5]
    level, ys = level_split(curves, 2.0)
    assert level == 1.0 and ys == [3.0, 0.0]


def test_planner_matches_bound_and_exact_solver_on_small_random_instances() -> None:
    rng = random.Random(1234)
    quantum = 1 << 16
    num_zero = num_spill = 0
    for case in range(50):
        cost = CostModel(
            copy_Bps=quantum / rng.uniform(0.2, 1.0),
            task_overhead_s=rng.choice([0.0, 0.01]),
            interference=rng.choice([0.0, 0.0, 0.3]),
        )
        policy = CheckpointPolicy(
            align_to_tensors=False,  # the exact solver splits at any byte
            min_chunk_bytes=quantum,
            max_chunk_bytes=quantum * rng.choice([2, 3]),
            every=rng.choice([1, 2]),
        )
        bubbles, layouts = make_instance(
            rng,
            num_groups=rng.choice([1, 2]),
            num_dp=rng.choice([1, 2]),
            num_slots=3,
            quantum=quantum,
            max_units=5,
        )
        p = plan(bubbles, layouts, cost, policy)
        exact = exact_exposed(bubbles, layouts, cost, policy, quantum=quantum)
        bound = lower_bound(bubbles, layouts, cost, policy)
        assert bound <= exact + 1e-12, case
        assert bound <= p.exposed_s + 1e-12, case
        assert p.exposed_s <= exact * 1.10 + 1e-12, (case, p.exposed_s, exact)
        if exact == 0.0:
            num_zero += 1
            assert p.exposed_s == 0.0 and bound == 0.0
        else:
            num_spill += 1
    assert num_zero >= 5 and num_spill >= 5


def _usable(slot: Slot, policy: CheckpointPolicy) -> float:
    return max(0.0, slot.idle_s - policy.spread_margin * slot.spread_s)


def check_plan(
    p: CheckpointPlan,
    bubbles: dict[int, BubbleMap],
    layouts: dict[int, StateLayout],
    cost: CostModel,
    policy: CheckpointPolicy,
    transfers: dict[int, tuple[tuple[int, int], ...]],
) -> None:
    """Invariants every plan must satisfy."""
    for group in {lay.replicas for lay in layouts.values()}:
        total = layouts[group[0]].nbytes
        covered = 0
        ids: list[int] = []
        for r in group:  # owned ranges tile the flat state in dp order
            rp = p.ranks[r]
            assert rp.owned_start == covered
            pos = rp.owned_start
            for k, c in enumerate(rp.owned):
                assert c.start == pos and c.stop > c.start and c.nbytes <= policy.max_chunk_bytes
                if k < len(rp.owned) - 1:
                    assert c.nbytes >= policy.min_chunk_bytes
                pos = c.stop
                ids.append(c.chunk_id)
            assert pos == rp.owned_stop
            covered = rp.owned_stop
        assert covered == total
        assert ids == list(range(len(ids)))
    worst = 0.0
    for r, rp in p.ranks.items():
        slot_by_id = {s.slot_id: s for s in bubbles[r].slots}
        chunks = {c.chunk_id: c for c in rp.owned}
        seen: list[int] = []
        in_bubble = 0.0
        last_snap = -1
        order = [s.slot_id for s in bubbles[r].slots]
        for sid, tasks in rp.tasks.items():
            assert sid in slot_by_id
            for lag in (0, 1):
                used = sum(t.est_s for t in tasks if p.interval_iters == 1 or t.lag == lag)
                assert used <= _usable(slot_by_id[sid], policy) * (1 + 1e-9) + 1e-15
            for t in tasks:
                assert t.est_s == cost.seconds(t.kind, t.nbytes)
                if t.kind is TaskKind.SNAPSHOT:
                    assert t.lag == 0
                    in_bubble += t.est_s
                    last_snap = max(last_snap, order.index(sid))
                if t.kind is TaskKind.SEND:
                    assert slot_by_id[sid].kind != "collective"
        for sid, tasks in rp.tasks.items():
            for k, t in enumerate(tasks):
                if t.kind is TaskKind.SEND and t.lag == 0:  # after every snapshot of the rank
                    assert order.index(sid) >= last_snap
                    assert all(u.kind is not TaskKind.SNAPSHOT for u in tasks[k:])
                    assert not any(u.kind is TaskKind.SNAPSHOT for u in rp.spilled)
        all_tasks = [t for ts in rp.tasks.values() for t in ts] + list(rp.spilled)
        for t in all_tasks:
            if t.kind is TaskKind.SNAPSHOT:
                assert t.lag == 0
                c = chunks[t.chunk_id]
                assert (t.offset, t.nbytes) == (c.start, c.nbytes)
                seen.append(t.chunk_id)
        assert sorted(seen) == sorted(chunks)  # each owned chunk snapshotted exactly once
        for stream, (peer, nbytes) in enumerate(transfers.get(r, ())):
            pieces = sorted(
                (t.offset, t.nbytes, rp.peers[t.stream])
                for t in all_tasks
                if t.kind is TaskKind.SEND and t.stream == stream
            )
            pos = 0
            for offset, size, to in pieces:
                assert offset == pos and to == peer
                pos += size
            assert pos == nbytes
        exposure = sum(t.est_s for t in rp.spilled) + cost.interference * in_bubble
        assert rp.exposed_s == pytest.approx(exposure / p.interval_iters, rel=1e-12, abs=1e-15)
        worst = max(worst, rp.exposed_s)
    assert p.exposed_s == worst
    assert p.lower_bound_s <= p.exposed_s + 1e-12


@st.composite
def instances(draw: st.DrawFn) -> tuple:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    quantum = draw(st.sampled_from([1, 1000, 1 << 16]))
    bubbles, layouts = make_instance(
        rng,
        num_groups=draw(st.integers(1, 3)),
        num_dp=draw(st.integers(1, 4)),
        num_slots=draw(st.integers(1, 6)),
        quantum=quantum,
        max_units=draw(st.integers(0, 40)),
    )
    transfers = {}
    if draw(st.booleans()):
        for r in layouts:
            transfers[r] = tuple(
                (rng.randrange(len(layouts)), rng.randrange(0, 6 * quantum + 1))
                for _ in range(rng.randint(0, 2))
            )
    cost = CostModel(
        copy_Bps=quantum * draw(st.floats(0.5, 20.0)),
        net_Bps=quantum * draw(st.floats(0.5, 20.0)),
        task_overhead_s=draw(st.sampled_from([0.0, 1e-3, 0.05])),
        interference=draw(st.sampled_from([0.0, 0.2])),
    )
    mn = quantum * draw(st.sampled_from([1, 2]))  # at most ~40 chunks per rank
    policy = CheckpointPolicy(
        align_to_tensors=draw(st.booleans()),
        every=draw(st.integers(1, 3)),
        on_overflow=draw(st.sampled_from(["spill", "stretch"])),
        min_chunk_bytes=mn,
        max_chunk_bytes=mn * draw(st.integers(2, 5)),
        spread_margin=0.0,
    )
    return bubbles, layouts, cost, policy, transfers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_plan_invariants(inst: tuple) -> None:
    bubbles, layouts, cost, policy, transfers = inst
    p = plan(bubbles, layouts, cost, policy, transfers=transfers or None)
    check_plan(p, bubbles, layouts, cost, policy, transfers)
    again = plan(bubbles, layouts, cost, policy, transfers=transfers or None)
    assert again == p  # deterministic
