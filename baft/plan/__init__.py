"""Pure checkpoint planning: data types, cost model, planner, bounds and plan rendering."""

from baft.plan.bounds import exact_exposed, lower_bound
from baft.plan.cost import CostModel
from baft.plan.planner import owned_ranges, plan
from baft.plan.render import bubble_table, plan_table, plan_to_dict
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
    "CostModel",
    "RankPlan",
    "Slot",
    "StateLayout",
    "Task",
    "TaskKind",
    "TensorSpec",
    "bubble_table",
    "exact_exposed",
    "lower_bound",
    "owned_ranges",
    "plan",
    "plan_table",
    "plan_to_dict",
]
