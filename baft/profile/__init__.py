"""Profiling: trainer timelines -> BubbleMap, Perfetto/PNG trace export, cost calibration.

Modules: ``timeline`` (records, reader), ``bubbles`` (pure BubbleMap extraction),
``trace`` (Perfetto JSON, PNG, ``baft trace``), ``calibrate`` (cost-model measurement).
Only ``timeline`` is imported eagerly; the rest load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from baft.profile.timeline import Event, IterationRecord, read_timelines, write_timelines

_LAZY = {
    "blocked_fraction": "baft.profile.bubbles",
    "bubble_map": "baft.profile.bubbles",
    "bubble_maps": "baft.profile.bubbles",
    "chrome_trace": "baft.profile.trace",
    "timeline_png": "baft.profile.trace",
    "measure_cost_model": "baft.profile.calibrate",
}

__all__ = ["Event", "IterationRecord", "read_timelines", "write_timelines", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'baft.profile' has no attribute {name!r}")
