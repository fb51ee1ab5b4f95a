"""The naive-async baseline: the same engine, but all snapshot work starts at once.

At each iteration's start the worker copies and protects the whole state in the
background (as "async checkpointing" usually does), ignoring the bubbles; the training
thread only waits for the copies before the optimizer step. Comparing it with the
bubble-aware engine in one run isolates what the scheduling buys.
"""

from __future__ import annotations

import threading

from baft.engine.engine import CheckpointEngine
from baft.engine.versions import Version
from baft.pipeline import IterationTimeline


class NaiveAsyncEngine(CheckpointEngine):
    """A :class:`CheckpointEngine` whose snapshot tasks all start at the iteration's start."""

    bubble_aware = False

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        self.state.capture()
        self._fire("iteration", iteration)
        v = self._current(iteration)
        if v is not None:
            v.snapshot_event = threading.Event()
            self.worker.submit(lambda: self._run_all(v))

    def on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        return

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        v = self._current(iteration)
        if v is not None and v.snapshot_event is not None:  # the snapshot must be done
            start = timeline.now()
            with self.worker.boosted():  # as drain: no inversion behind other ranks
                v.snapshot_event.wait()
            v.exposed_s += timeline.now() - start
            timeline.add(
                "snapshot-join", "ckpt", start, timeline.now(), slot="pre_step", exposed=True
            )
        super().before_optimizer_step(iteration, timeline)

    def _run_all(self, v: Version) -> None:
        """On the worker: snapshot and protect everything at once."""
        self.worker_thread = threading.current_thread()
        for task, pieces in self.schedule.all_tasks:
            if task.chunk_id not in v.done:
                self._snapshot(v, task, pieces, None, "naive", exposed=False)
        assert v.snapshot_event is not None
        v.snapshot_event.set()
