"""Per-iteration timeline of one rank: compute actions, blocked waits, checkpoint tasks.

One :class:`IterationTimeline` becomes one JSON line of ``RUN_DIR/timeline/rank{r}.jsonl``
(the format ``baft.profile.timeline`` reads). Times are seconds relative to ``t0``, the
wall-clock start of the iteration, measured with ``perf_counter``.
"""

from __future__ import annotations

import time
from typing import Any


class IterationTimeline:
    """Events of one iteration on one rank."""

    __slots__ = ("iteration", "rank", "t0", "_perf0", "events", "iter_s")

    def __init__(self, iteration: int, rank: int) -> None:
        self.iteration = iteration
        self.rank = rank
        self.t0 = time.time()
        self._perf0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.iter_s = 0.0

    def now(self) -> float:
        """Seconds since the start of the iteration."""
        return time.perf_counter() - self._perf0

    def add(self, name: str, cat: str, start: float, end: float, **fields: Any) -> None:
        self.events.append({"name": name, "cat": cat, "start": start, "end": end, **fields})

    def finish(self) -> float:
        self.iter_s = self.now()
        return self.iter_s

    def blocked_s(self) -> float:
        """Seconds spent blocked in waits (p2p and collectives)."""
        return sum(e["end"] - e["start"] for e in self.events if e["cat"] == "wait")

    def to_json(self) -> dict[str, Any]:
        """The record; an unfinished iteration (a hook reading it) reports its length so far."""
        return {
            "iteration": self.iteration,
            "rank": self.rank,
            "t0": self.t0,
            "iter_s": self.iter_s or self.now(),
            "events": self.events,
        }
