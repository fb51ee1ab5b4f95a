"""From profiled iterations to the tasks this rank runs at each slot.

Every rank gathers all BubbleMaps and state layouts on the transport and runs the pure
planner (:func:`baft.plan.planner.plan`): identical inputs give an identical
:class:`CheckpointPlan` everywhere, no coordinator. The inputs are saved in the run
directory (:data:`~baft.plan.inputs.PLAN_INPUT_FILE`) so a restarted job re-plans at
once, without profiling. :class:`SnapshotSchedule` is one rank's share of a plan in the
form the executor uses at run time: the snapshot tasks per slot with their pieces of the
flat state, resolved once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baft.engine.flat import FlatState, Piece
from baft.engine.transport import Transport
from baft.plan.cost import CostModel
from baft.plan.inputs import PLAN_INPUT_FILE, bmap_to_json, layout_to_json
from baft.plan.types import CheckpointPlan, StateLayout, Task, TaskKind
from baft.profile.bubbles import bubble_map
from baft.profile.timeline import parse_record

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


def load_plan_input(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / PLAN_INPUT_FILE
    return json.loads(path.read_text()) if path.exists() else None


def save_plan_input(run_dir: Path, plan_input: dict[str, Any]) -> None:
    """Atomically replace the run directory's saved planner inputs (call on one rank)."""
    tmp = run_dir / (PLAN_INPUT_FILE + ".tmp")
    tmp.write_text(json.dumps(plan_input))
    tmp.replace(run_dir / PLAN_INPUT_FILE)


def calibrate(configured: dict[str, float] | None) -> dict[str, float]:
    """The cost model: configured values, else a ~1 s micro-benchmark on this machine."""
    if configured:
        return dict(configured)
    from baft.profile.calibrate import measure_cost_model

    return measure_cost_model(8 << 20, repeats=2)


def replan_rate(plan_input: dict[str, Any], rates: list[float | None]) -> float | None:
    """The snapshot copy rate to re-plan with, or None to keep the plan.

    The start-up micro-benchmark copies one hot buffer; real snapshots gather many tensors
    next to a computing neighbour (2-4x slower here). The slowest rank's measured rate
    replaces the assumed one when they differ by more than 25%.
    """
    measured = [r for r in rates if r]
    if not measured:
        return None
    rate = min(measured)
    assumed = float(plan_input["cost"].get("copy_Bps", CostModel().copy_Bps))
    return None if 0.8 <= rate / assumed <= 1.25 else rate
