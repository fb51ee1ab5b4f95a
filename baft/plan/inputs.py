"""The planner's inputs of a run as JSON: what ``RUN_DIR/plan_input.json`` holds.

Every rank's measured BubbleMap and state layout plus the cost model; saved once after
profiling so a restarted job (and ``baft plan --run``) re-plans deterministically without
profiling again.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from baft.plan.types import BubbleMap, Slot, StateLayout, TensorSpec

PLAN_INPUT_FILE = "plan_input.json"


def bmap_to_json(b: BubbleMap) -> dict[str, Any]:
    return {"rank": b.rank, "iteration_s": b.iteration_s, "slots": [asdict(s) for s in b.slots]}


def bmap_from_json(d: dict[str, Any]) -> BubbleMap:
    return BubbleMap(
        rank=d["rank"], iteration_s=d["iteration_s"], slots=tuple(Slot(**s) for s in d["slots"])
    )


def layout_to_json(layout: StateLayout) -> dict[str, Any]:
    return {
        "rank": layout.rank,
        "replicas": list(layout.replicas),
        "tensors": [[t.name, t.nbytes] for t in layout.tensors],
    }


def layout_from_json(d: dict[str, Any]) -> StateLayout:
    return StateLayout(
        rank=d["rank"],
        replicas=tuple(d["replicas"]),
        tensors=tuple(TensorSpec(name=n, nbytes=b) for n, b in d["tensors"]),
    )
