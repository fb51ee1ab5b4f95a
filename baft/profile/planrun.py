"""``baft plan --run RUN_DIR``: the plan of a real run, and where its tasks actually ran.

A checkpointed run saves its planner inputs (every rank's measured BubbleMap, state
layout and calibrated cost model) in ``RUN_DIR/plan_input.json``. This re-plans from them
(the planner is deterministic: it is the plan the run executed), prints the BubbleMap and
plan tables, checks the run's timelines for every snapshot task (inside a measured
bubble, or explicitly spilled before the step) and draws the tasks on the timeline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from baft.plan.cost import CostModel
from baft.plan.inputs import PLAN_INPUT_FILE, bmap_from_json, layout_from_json
from baft.plan.planner import plan as make_plan
from baft.plan.render import bubble_table, plan_table, plan_to_dict
from baft.plan.types import CheckpointPolicy
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


def run_plan_from_run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    path = run_dir / PLAN_INPUT_FILE
    if not path.exists():
        raise ValueError(
            f"{path} not found: pass the directory of a checkpointed `baft train --out DIR` run "
            "that got past its profiling iterations"
        )
    data = json.loads(path.read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    ck = cfg.get("checkpoint") or {}
    policy = CheckpointPolicy(
        every=ck.get("every", 1),
        redundancy=ck.get("redundancy", "xor:2"),
        persist_every=ck.get("persist_every", 50),
        on_overflow=ck.get("on_overflow", "spill"),
    )
    bubbles = {r: bmap_from_json(d["bubbles"]) for r, d in enumerate(data["ranks"])}
    layouts = {r: layout_from_json(d["layout"]) for r, d in enumerate(data["ranks"])}
    cost = CostModel.from_measurements(data.get("cost") or {})
    plan = make_plan(bubbles, layouts, cost, policy)
    placement = task_placement(run_dir)
    png = timeline_png(
        read_timelines(run_dir), run_dir / "plan.png", title="executed checkpoint tasks"
    )
    if args.json:
        out: dict[str, Any] = {"plan": plan_to_dict(plan), "placement": placement, "png": str(png)}
        print(json.dumps(out))
        return 0
    print(bubble_table(bubbles))
    print()
    print(plan_table(plan, bubbles))
    print()
    for rank, c in sorted(placement.items()):
        print(
            f"rank {rank}: {c['in_bubble']} snapshot tasks ran inside measured bubbles, "
            f"{c['spilled']} were spilled to the pre-step window (exposed)"
        )
    print(f"timeline with the executed tasks: {png}")
    return 0
