"""Profiling: trainer timelines -> BubbleMap, Perfetto/PNG trace export, cost calibration.

Light imports only: ``trace`` (matplotlib) and ``calibrate`` (torch) are imported from
their modules when needed, e.g. ``from baft.profile.trace import chrome_trace``.
"""

from baft.profile.bubbles import blocked_fraction, bubble_map, bubble_maps
from baft.profile.timeline import Event, IterationRecord, read_timelines, write_timelines

__all__ = [
    "Event",
    "IterationRecord",
    "blocked_fraction",
    "bubble_map",
    "bubble_maps",
    "read_timelines",
    "write_timelines",
]
