"""When snapshot tasks start: the scheduling seam of the version writer.

- :class:`BubbleAware` (the default): tasks run at the plan's slots, where the rank
  would block on a peer anyway; what fits no bubble starts at the iteration's start on
  the asynchronous spill copier.
- :class:`AllAtStart`: every task at the iteration's start on the protect worker, as
  async checkpointing usually does (the naive-async baseline: comparing it with
  :class:`BubbleAware` isolates what the scheduling buys).

Both write the same bytes; the writer copies whatever is left at the step deadline.
Strategies see the writer through :class:`Writes`, the little they use of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from baft.engine.device import DeviceCopy
from baft.engine.flat import Piece
from baft.engine.planning import SPILL, SnapshotSchedule
from baft.engine.versions import Version
from baft.engine.worker import ProtectWorker
from baft.pipeline import IterationTimeline
from baft.plan.types import Task


class Writes(Protocol):
    """What a strategy uses of :class:`~baft.engine.writer.VersionWriter`."""

    schedule: SnapshotSchedule
    spill_copier: DeviceCopy
    worker: ProtectWorker
    timeout_s: float

    @property
    def base_schedule(self) -> SnapshotSchedule | None:
        """The current layout's schedule (which tasks exist), None before a plan."""
        ...

    @property
    def has_same_host_peers(self) -> bool: ...

    def snapshot(
        self,
        v: Version,
        task: Task,
        pieces: tuple[Piece, ...],
        timeline: IterationTimeline | None,
        slot_id: str,
        *,
        exposed: bool = False,
        copier: DeviceCopy | None = None,
        inline: bool = False,
    ) -> None: ...

    def pull(self) -> None: ...

    def fire(self, point: str, iteration: int) -> None: ...


class Scheduling(Protocol):
    """When a version's snapshot tasks start (the writer does the rest)."""

    bubble_aware: bool
    """Whether work waits for the plan's slots (host-side work may then be gated)."""

    def iteration_start(
        self, w: Writes, opened: Callable[[], Version | None], timeline: IterationTimeline
    ) -> None:
        """The iteration's start (before the forward); ``opened()`` begins the version
        (resolving the previous one's commit) and returns it, or None if none is due."""

    def slot(self, w: Writes, v: Version, slot_id: str, timeline: IterationTimeline) -> None:
        """A slot where the rank would block on a peer (a bubble)."""

    def deadline(self, w: Writes, v: Version, timeline: IterationTimeline) -> None:
        """Just before ``optimizer.step`` (before the writer copies what is left)."""


class BubbleAware:
    """Tasks run at their planned slots; those that fit no bubble start at the iteration's
    start on the asynchronous spill copier and finish by the deadline."""

    bubble_aware = True

    def __init__(self) -> None:
        self._issuer: ThreadPoolExecutor | None = None
        self._issuing: Future[None] | None = None

    def iteration_start(
        self, w: Writes, opened: Callable[[], Version | None], timeline: IterationTimeline
    ) -> None:
        base = w.base_schedule
        if base is None or not base.by_slot.get(SPILL):
            return  # the version opens at its first slot (a bubble hides the commit vote)
        v = opened()
        if v is None:
            return
        if getattr(w.spill_copier, "issues_off_thread", False):
            # CUDA: issuing a chunk's copies costs the host ~160 us (23 ms per iteration
            # for a 1.1 GiB state, measured on an H200), time the GPU then waited for the
            # forward's launches. Here the training thread only marks where the copies
            # start in its stream; a thread issues them.
            if self._issuer is None:
                self._issuer = ThreadPoolExecutor(1, thread_name_prefix="baft-issue")
            w.spill_copier.mark()  # type: ignore[attr-defined]
            self._issuing = self._issuer.submit(self._spills, w, v, timeline)
        else:
            self._spills(w, v, timeline)

    @staticmethod
    def _spills(w: Writes, v: Version, timeline: IterationTimeline) -> None:
        for task, pieces in w.schedule.by_slot[SPILL]:
            w.snapshot(v, task, pieces, timeline, "iteration_start", copier=w.spill_copier)

    def slot(self, w: Writes, v: Version, slot_id: str, timeline: IterationTimeline) -> None:
        for task, pieces in w.schedule.by_slot.get(slot_id, ()):
            if task.chunk_id in v.done:  # a slot met again (elastic replicas' 2nd pass)
                continue
            w.snapshot(v, task, pieces, timeline, slot_id)
            if len(v.done) == 1:
                w.fire("snapshot", timeline.iteration)
        if w.has_same_host_peers:
            w.worker.submit(w.pull)  # same-host peers' progress
        w.worker.open()

    def deadline(self, w: Writes, v: Version, timeline: IterationTimeline) -> None:
        if self._issuing is not None:  # every copy issued before any is waited for
            issuing, self._issuing = self._issuing, None
            issuing.result(w.timeout_s)

    def shutdown(self) -> None:
        if self._issuer is not None:
            self._issuer.shutdown(wait=True)


class AllAtStart:
    """Every task starts at the iteration's start, on the worker, ignoring the bubbles;
    the training thread only waits for them before the step (naive async checkpointing:
    comparing it with :class:`BubbleAware` isolates what the scheduling buys)."""

    bubble_aware = False

    def __init__(self) -> None:
        self._done: dict[int, threading.Event] = {}

    def iteration_start(
        self, w: Writes, opened: Callable[[], Version | None], timeline: IterationTimeline
    ) -> None:
        v = opened()
        if v is None:
            return
        done = self._done.setdefault(v.version, threading.Event())

        def run_all() -> None:
            for task, pieces in w.schedule.all_tasks:
                if task.chunk_id not in v.done:
                    w.snapshot(v, task, pieces, None, "naive", inline=True)
            done.set()

        w.worker.submit(run_all)

    def slot(self, w: Writes, v: Version, slot_id: str, timeline: IterationTimeline) -> None:
        return

    def deadline(self, w: Writes, v: Version, timeline: IterationTimeline) -> None:
        done = self._done.pop(v.version, None)
        if done is None:
            return
        start = timeline.now()
        with w.worker.boosted():  # as drain: no inversion behind other ranks
            done.wait()
        v.exposed_s += timeline.now() - start
        timeline.add("snapshot-join", "ckpt", start, timeline.now(), slot="pre_step", exposed=True)

    def shutdown(self) -> None:
        return
