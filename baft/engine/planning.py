"""From profiled iterations to the tasks this rank runs at each slot.

Every rank gathers all BubbleMaps and state layouts on the transport and runs the pure
planner (:func:`baft.plan.planner.plan`): identical inputs give an identical
:class:`CheckpointPlan` everywhere, no coordinator. The inputs are saved in the run
directory (:class:`~baft.store.records.PlanInput`) so a restarted job re-plans at once,
without profiling. :class:`SnapshotSchedule` is one rank's share of a plan in the
form the executor uses at run time: the snapshot tasks per slot with their pieces of the
flat state, resolved once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baft.engine.flat import FlatState, Piece
from baft.engine.transport import Transport
from baft.plan.cost import CostModel
from baft.plan.inputs import (
    bmap_from_json,
    bmap_to_json,
    layout_from_json,
    layout_to_json,
)
from baft.plan.payload import PayloadLayout, auto_full_every
from baft.plan.planner import plan as make_plan
from baft.plan.types import CheckpointPlan, CheckpointPolicy, StateLayout, Task, TaskKind
from baft.profile.bubbles import bubble_map
from baft.profile.timeline import parse_record
from baft.store.coding import Redundancy, group_layouts
from baft.store.shm import SnapshotStore
from baft.topology import Topology

SPILL = "__spill__"
"""Pseudo-slot of the snapshot tasks that fit no bubble."""

REPLAN_AFTER_CHECKPOINTS = 3
"""Checkpoints after which the measured snapshot copy rate is compared with the plan's."""


@dataclass
class SnapshotSchedule:
    """One rank's snapshot tasks, by slot, with the flat-state pieces each copies."""

    owned_start: int = 0
    owned_stop: int = 0
    by_slot: dict[str, list[tuple[Task, tuple[Piece, ...]]]] = field(default_factory=dict)
    all_tasks: list[tuple[Task, tuple[Piece, ...]]] = field(default_factory=list)
    """Every task in offset order (what runs before the step if its slot never came)."""
    chunk_at: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Shard offset of a chunk -> (chunk id, end offset in the shard)."""

    @classmethod
    def of(cls, plan: CheckpointPlan, rank: int, flat: FlatState) -> SnapshotSchedule:
        rp = plan.ranks[rank]
        s = cls(owned_start=rp.owned_start, owned_stop=rp.owned_stop)
        for slot_id, tasks in [*rp.tasks.items(), (SPILL, rp.spilled)]:
            for t in tasks:
                if t.kind is TaskKind.SNAPSHOT:
                    entry = (t, flat.pieces(t.offset, t.offset + t.nbytes))
                    s.by_slot.setdefault(slot_id, []).append(entry)
                    s.all_tasks.append(entry)
        s.all_tasks.sort(key=lambda e: e[0].offset)
        s.chunk_at = {
            t.offset - rp.owned_start: (t.chunk_id, t.offset - rp.owned_start + t.nbytes)
            for t, _ in s.all_tasks
        }
        return s

    @property
    def nbytes(self) -> int:
        return self.owned_stop - self.owned_start


def gather_plan_input(
    transport: Transport,
    rank: int,
    profile: list[dict[str, Any]],
    layout: StateLayout,
    cost: dict[str, float] | None,
    world_size: int,
) -> dict[str, Any]:
    """Every rank's BubbleMap (from its profiled timelines) and layout, plus rank 0's cost
    model. Collective."""
    bmap = bubble_map(rank, [parse_record(d) for d in profile], skip=0)
    gathered = transport.all_gather_object(
        {"bubbles": bmap_to_json(bmap), "layout": layout_to_json(layout), "cost": cost}
    )
    return {
        "ranks": [{k: v for k, v in g.items() if k != "cost"} for g in gathered],
        "cost": gathered[0]["cost"],
        "world_size": world_size,
    }


CALIBRATE_NBYTES = 64 << 20
"""Buffer of the start-up calibration: past the private caches (a snapshot streams the
state from memory; an 8 MiB buffer measured the cache here, 1.7x the memory's rate)."""


def calibrate(configured: dict[str, float] | None, *, hashes_on_copy: bool) -> dict[str, float]:
    """The cost model: configured values, else a ~1 s calibration on this machine.

    ``hashes_on_copy``: the snapshot copier hashes every block as it copies it (host
    copiers: :func:`baft.engine.device.copy_hash`), so a snapshot byte costs a copy and a
    hash, and ``copy_Bps`` is that combined rate (what the re-plan later measures)."""
    if configured:
        return dict(configured)
    from baft.profile.calibrate import measure_cost_model

    cost = measure_cost_model(CALIBRATE_NBYTES, repeats=2, persist_nbytes=8 << 20)
    if hashes_on_copy:
        cost["copy_Bps"] = 1.0 / (1.0 / cost["copy_Bps"] + 1.0 / cost["hash_Bps"])
    return cost


def replan_rate(plan_input: dict[str, Any], rates: list[float | None]) -> float | None:
    """The snapshot copy rate to re-plan with, or None to keep the plan.

    The start-up calibration copies one hot buffer; real snapshots gather many tensors
    next to a computing neighbour (2-4x slower here). The slowest rank's measured rate
    replaces the assumed one when they differ by more than 25%.
    """
    measured = [r for r in rates if r]
    if not measured:
        return None
    rate = min(measured)
    assumed = float(plan_input["cost"].get("copy_Bps", CostModel().copy_Bps))
    return None if 0.8 <= rate / assumed <= 1.25 else rate


def plan_of(plan_input: dict[str, Any], k: int, policy: CheckpointPolicy) -> CheckpointPlan:
    """The plan of ``plan_input`` with full_every ``k`` (pure: every rank computes the
    same from the same input); with ``k > 1`` the planned bytes are each rank's payload."""
    ranks = plan_input["ranks"]
    bubbles = {r: bmap_from_json(d["bubbles"]) for r, d in enumerate(ranks)}
    layouts = {r: layout_from_json(d["layout"]) for r, d in enumerate(ranks)}
    if k > 1:
        layouts = {
            r: StateLayout(
                rank=r, tensors=PayloadLayout.of(lay.tensors, k).specs(), replicas=lay.replicas
            )
            for r, lay in layouts.items()
        }
    return make_plan(bubbles, layouts, CostModel.from_measurements(plan_input["cost"]), policy)


def store_bytes(
    plan_input: dict[str, Any],
    k: int,
    policy: CheckpointPolicy,
    topology: Topology,
    redundancy: Redundancy,
) -> int:
    """The most host memory any rank's store needs under the plan with full_every ``k``:
    ``max(2, k + 1)`` slots of its shard and its redundancy (as the engine allocates)."""
    plan = plan_of(plan_input, k, policy)
    shards = {r: p.owned_stop - p.owned_start for r, p in plan.ranks.items()}
    red = group_layouts(topology, redundancy, shards)
    return max(
        SnapshotStore.required_bytes(shards[r], red[r].redundancy_nbytes(r), max(2, k + 1))
        for r in shards
    )


def auto_k(
    plan_input: dict[str, Any],
    policy: CheckpointPolicy,
    topology: Topology,
    redundancy: Redundancy,
    budget_bytes: int,
) -> tuple[int, str]:
    """``full_every=auto``: the largest k any rank's bubbles need
    (:func:`baft.plan.payload.auto_full_every`), stepped down while some rank's store
    would exceed ``budget_bytes`` (k+1 payload slots, each with a gradient record, grow
    with k: fewer bytes fit the bubbles, but the job runs). At k=1 an over-budget store
    fails at allocation with ``MemoryBudgetError``, which says what to change. Returns
    ``(k, reason)``; the same on every rank."""
    cost = CostModel.from_measurements(plan_input["cost"])
    fanout = {"none": 0.0, "replicate": float(redundancy.k)}.get(redundancy.kind, 1.0)
    choices = {
        r: auto_full_every(
            layout_from_json(d["layout"]).tensors,
            bmap_from_json(d["bubbles"]).capacity_s(),
            cost.copy_Bps,
            cost.net_Bps,
            fanout,
        )
        for r, d in enumerate(plan_input["ranks"])
    }
    worst = max(choices, key=lambda r: (choices[r][0], -r))
    wanted, why = choices[worst]
    k = wanted
    while k > 1 and store_bytes(plan_input, k, policy, topology, redundancy) > budget_bytes:
        k -= 1
    reason = f"auto, rank {worst}: {why}"
    if k != wanted:
        reason += (
            f"; lowered to full_every={k}: with {wanted} the store would exceed "
            f"budget_bytes={budget_bytes:,}"
        )
    return k, reason
