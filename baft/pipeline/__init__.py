"""The one adapter over torch.distributed.pipelining: schedules with slot hooks and timing."""

from baft.pipeline.adapter import ProtectedSchedule, build_schedule, stage_indices
from baft.pipeline.recorder import IterationTimeline

__all__ = ["IterationTimeline", "ProtectedSchedule", "build_schedule", "stage_indices"]
