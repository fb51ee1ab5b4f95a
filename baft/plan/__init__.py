"""Pure checkpoint planning: data types, cost model, planner, bounds and plan rendering."""

from baft.plan.types import (
    BubbleMap,
    CheckpointPlan,
    CheckpointPolicy,
    Chunk,
    RankPlan,
    Slot,
    StateLayout,
    Task,
    TaskKind,
    TensorSpec,
)

__all__ = [
    "BubbleMap",
    "CheckpointPlan",
    "CheckpointPolicy",
    "Chunk",
    "RankPlan",
    "Slot",
    "StateLayout",
    "Task",
    "TaskKind",
    "TensorSpec",
]
