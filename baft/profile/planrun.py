"""``baft plan --run RUN_DIR``: the plan of a real run, and where its tasks actually ran.

A checkpointed run saves its planner inputs (every rank's measured BubbleMap, state
layout and calibrated cost model) in ``RUN_DIR/plan_input.json``. This re-plans from them
(the planner is deterministic: it is the plan the run executed), prints the BubbleMap and
plan tables, checks the run's timelines for every snapshot task (inside a measured
bubble, or explicitly spilled before the step) and draws the tasks on the timeline.
``baft.cli.plan`` prints the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from baft.plan.cost import CostModel
from baft.plan.inputs import PLAN_INPUT_FILE, bmap_from_json, layout_from_json
from baft.plan.planner import plan as make_plan
from baft.plan.types import BubbleMap, CheckpointPlan, CheckpointPolicy
from baft.profile.timeline import read_timelines
from baft.profile.trace import timeline_png


def task_placement(run_dir: Path) -> dict[int, dict[str, int]]:
    """Per rank: snapshot tasks run inside a bubble slot vs spilled to the pre-step window."""
    out: dict[int, dict[str, int]] = {}
    for rank, records in read_timelines(run_dir).items():
        counts = {"in_bubble": 0, "spilled": 0}
        for rec in records:
            for ev in rec.events:
                if ev.cat == "ckpt" and ev.name == "snapshot":
                    counts["spilled" if ev.exposed else "in_bubble"] += 1
        out[rank] = counts
    return out


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The plan a checkpointed run executed, and where its snapshot tasks ran."""

    plan: CheckpointPlan
    """Re-planned from the run's saved planner inputs (the planner is deterministic)."""
    bubbles: dict[int, BubbleMap]
    """Every rank's measured BubbleMap."""
    placement: dict[int, dict[str, int]]
    """Per rank, snapshot tasks ``in_bubble`` vs ``spilled`` (see ``task_placement``)."""
    png: Path
    """Timeline picture of the executed tasks (``RUN_DIR/plan.png``)."""


def plan_from_run(run_dir: Path) -> RunPlan:
    """Re-plan ``run_dir`` from its ``plan_input.json``, count task placement, draw plan.png.

    Raises ``ValueError`` when the run saved no planner inputs.
    """
    run_dir = Path(run_dir)
    path = run_dir / PLAN_INPUT_FILE
    if not path.exists():
        raise ValueError(
            f"{path} not found: pass the directory of a checkpointed `baft train --out DIR` run "
            "that got past its profiling iterations"
        )
    data = json.loads(path.read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    ck = cfg.get("checkpoint") or {}
    policy = CheckpointPolicy(**(ck.get("policy") or {}))
    bubbles = {r: bmap_from_json(d["bubbles"]) for r, d in enumerate(data["ranks"])}
    layouts = {r: layout_from_json(d["layout"]) for r, d in enumerate(data["ranks"])}
    cost = CostModel.from_measurements(data.get("cost") or {})
    plan = make_plan(bubbles, layouts, cost, policy)
    placement = task_placement(run_dir)
    png = timeline_png(
        read_timelines(run_dir), run_dir / "plan.png", title="executed checkpoint tasks"
    )
    return RunPlan(plan=plan, bubbles=bubbles, placement=placement, png=png)
