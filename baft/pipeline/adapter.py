"""The only module that touches private ``torch.distributed.pipelining`` APIs.

It builds schedules by name and runs them with **slots**: just before the rank blocks on a
pipeline wait (a p2p receive or send) it calls the slot handler with a stable slot id
(``w0``, ``w1``, ... = the k-th blocking wait of the step; static schedules make the order
identical every iteration), then waits and records how long it was blocked. Compute
actions (F, B, I, W) are timed too. The same :meth:`ProtectedSchedule.slot` wraps any other
wait (the DP gradient all-reduce, the pre-step window).

How: every schedule in torch 2.13 (GPipe and 1F1B's hard-coded loops and the
``_PipelineScheduleRuntime`` ones) waits through the module-level
``schedules._wait_batch_p2p``; we swap that function for the duration of ``step`` and wrap
the stage's ``*_one_chunk`` methods on our own stage objects. With no handler work the
arithmetic is untouched, so hooks on and off give bit-identical results. The stage's
``_forward_metadata_inference`` (torch's shape inference on a process's first step) is
wrapped too: in a process resumed from a checkpoint its side effects on the RNG and the
stage's buffers are undone (see :meth:`ProtectedSchedule._isolated`).

:class:`~baft.pipeline.step.StepRunner` calls :meth:`ProtectedSchedule.call` from the
wrapper it puts on the user's schedule object, so the user's own ``schedule.step(...)``
runs here; :attr:`ProtectedSchedule.raw_step` is the schedule's own method.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
from torch.distributed.pipelining import schedules as _sched
from torch.distributed.pipelining.stage import PipelineStage

from baft.pipeline.recorder import IterationTimeline
from baft.sim.schedules import stage_rank

_SCHEDULE_CLASSES: dict[str, Any] = {
    "gpipe": _sched.ScheduleGPipe,
    "1f1b": _sched.Schedule1F1B,
    "interleaved-1f1b": _sched.ScheduleInterleaved1F1B,
    "zbv": _sched.ScheduleZBVZeroBubble,
    "interleaved-zb": _sched.ScheduleInterleavedZeroBubble,
}
_SINGLE_STAGE = ("gpipe", "1f1b")
SCHEDULES = tuple(_SCHEDULE_CLASSES)
"""Pipeline schedules baft can run, by name: the one table (the CLI and configs use it)."""
MULTI_STAGE_SCHEDULES = tuple(s for s in SCHEDULES if s not in _SINGLE_STAGE)
"""Schedules that place several (virtual) stages on each pipeline rank."""


class SlotHandler(Protocol):
    """Called at a slot, before the rank blocks; runs checkpoint work scheduled there."""

    def __call__(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None: ...


def stage_indices(schedule: str, pp_rank: int, num_pp: int, num_virtual: int) -> list[int]:
    """Pipeline stage indices held by pipeline rank ``pp_rank`` (looped, or the V shape of
    zbv), from the same stage -> rank map the simulator uses."""
    owner = stage_rank(schedule, num_pp, 1 if schedule in _SINGLE_STAGE else num_virtual)
    return [s for s, r in enumerate(owner) if r == pp_rank]


def schedule_stages(schedule: Any) -> list[PipelineStage]:
    """The stages a torch schedule object runs on this rank (for callers that hold the
    schedule but not its stages, as torchtitan's Trainer does). ``_stage``/``_stages``
    are private attributes of torch's ``PipelineScheduleSingle``/``PipelineScheduleMulti``
    (no public accessor in torch 2.13); ValueError for anything else."""
    # torch types them as its private ``_PipelineStageBase`` (PipelineStage's base)
    if isinstance(schedule, _sched.PipelineScheduleSingle):
        return [cast(PipelineStage, schedule._stage)]
    if isinstance(schedule, _sched.PipelineScheduleMulti):
        return [cast(PipelineStage, s) for s in schedule._stages]
    raise ValueError(f"not a torch.distributed.pipelining schedule: {type(schedule).__qualname__}")


def build_schedule(
    name: str,
    stages: Sequence[PipelineStage],
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """A torch pipelining schedule by baft's CLI name."""
    if name not in _SCHEDULE_CLASSES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(_SCHEDULE_CLASSES)}")
    cls = _SCHEDULE_CLASSES[name]
    if name in _SINGLE_STAGE:
        if len(stages) != 1:
            raise ValueError(f"{name} runs one stage per rank, got {len(stages)}")
        return cls(stages[0], num_microbatches, loss_fn=loss_fn)
    return cls(list(stages), num_microbatches, loss_fn=loss_fn)


class ProtectedSchedule:
    """A pipeline schedule whose blocking waits are slots, with a per-iteration timeline."""

    def __init__(
        self,
        schedule: Any,
        stages: Sequence[PipelineStage],
        *,
        on_slot: SlotHandler | None = None,
        instrument: bool = True,
        on_slot_end: Callable[[str], None] | None = None,
    ) -> None:
        self.schedule = schedule
        self.raw_step: Any = schedule.step if schedule is not None else None
        """The schedule's own ``step`` (taken before :class:`StepRunner` puts its wrapper
        on the schedule object: the wrapper calls this one)."""
        self.stages = list(stages)
        self.on_slot = on_slot
        self.on_slot_end = on_slot_end
        """Called when the wait of a slot returned (the rank computes again)."""
        self.instrument = instrument
        """False runs the bare torch schedule: no slots, no timeline (the baseline)."""
        self.wait_timeout_s: float | None = None
        """Bound of every pipeline send/receive wait (None: wait forever). gloo applies a
        group's timeout to collectives but not to ``Work.wait()`` of a p2p op, so a rank
        whose peer froze mid-iteration would block here forever without it."""
        self.undo_inference = False
        """Set in a process resumed from a checkpoint: see :meth:`_isolated`."""
        self._timeline: IterationTimeline | None = None
        self._numbered: IterationTimeline | None = None
        """The iteration whose waits ``_num_waits`` counts."""
        self._num_waits = 0
        if instrument:
            for stage in self.stages:
                self._instrument(stage)

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    def _instrument(self, stage: PipelineStage) -> None:
        idx = stage.stage_index

        def timed(fn: Callable[..., Any], label: str | Callable[..., str]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                tl = self._timeline
                if tl is None:
                    return fn(*args, **kwargs)
                start = tl.now()
                out = fn(*args, **kwargs)
                name = label(*args, **kwargs) if callable(label) else label
                tl.add(name, "compute", start, tl.now(), stage=idx, mb=args[0] if args else -1)
                return out

            return wrapper

        def bwd_label(*args: Any, full_backward: bool = True, **_: Any) -> str:
            return "B" if full_backward else "I"

        inference = getattr(stage, "_forward_metadata_inference", None)
        if inference is not None:
            stage._forward_metadata_inference = self._isolated(stage, inference)  # type: ignore[method-assign]
        stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")  # type: ignore[method-assign]
        stage.backward_one_chunk = timed(stage.backward_one_chunk, bwd_label)  # type: ignore[method-assign]
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "W")  # type: ignore[method-assign]

    def _isolated(self, stage: PipelineStage, inference: Callable[..., Any]) -> Callable[..., Any]:
        """torch's shape inference (dynamic metadata: a stage built without
        ``input_args``) runs a real forward on the first step of every process: dropout
        draws from the RNG, BatchNorm updates its statistics. A restored state already
        holds the effects of the first process's inference, so in a resumed process
        (``undo_inference``) the RNG and the stage's buffers are put back afterwards."""

        @functools.wraps(inference)
        def isolated(*args: Any, **kwargs: Any) -> Any:
            if not self.undo_inference:
                return inference(*args, **kwargs)
            cuda = stage.device.type == "cuda"
            rng = torch.get_rng_state()
            rng_cuda = torch.cuda.get_rng_state(stage.device) if cuda else None
            with torch.no_grad():
                buffers = [(b, b.clone()) for b in stage.submod.buffers()]
            try:
                return inference(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for b, saved in buffers:
                        b.copy_(saved)
                torch.set_rng_state(rng)
                if rng_cuda is not None:
                    torch.cuda.set_rng_state(rng_cuda, stage.device)

        return isolated

    def slot(
        self, timeline: IterationTimeline, slot_id: str, kind: str, wait: Callable[[], Any]
    ) -> Any:
        """Run the slot handler, then ``wait()``, recording the blocked time as a wait event."""
        if not self.instrument:
            return wait()
        if self.on_slot is not None:
            self.on_slot(slot_id, kind, timeline)
        start = timeline.now()
        try:
            out = wait()
        finally:
            if self.on_slot_end is not None:
                self.on_slot_end(slot_id)
        timeline.add("wait", "wait", start, timeline.now(), slot=slot_id, kind=kind)
        return out

    def _wait_batch_p2p(self, work: list[Any]) -> None:
        assert self._timeline is not None
        slot_id = f"w{self._num_waits}"
        self._num_waits += 1

        timeout = self.wait_timeout_s

        def wait_all() -> None:
            if timeout is None:
                for w in work:
                    w.wait()
                return
            deadline = time.monotonic() + timeout  # the batch as a whole, not each op
            try:
                for w in work:
                    w.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    raise
                raise TimeoutError(
                    f"pipeline wait {slot_id} (p2p) found no peer for {timeout:g} s: "
                    f"a pipeline neighbour stopped responding ({e})"
                ) from e

        self.slot(self._timeline, slot_id, "p2p", wait_all)

    def step(
        self,
        timeline: IterationTimeline,
        inputs: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
    ) -> None:
        """One pipeline step (forward and backward of every microbatch); no optimizer step."""
        args = (inputs,) if self.has_first_stage and inputs is not None else ()
        kwargs: dict[str, Any] = {}
        if self.has_last_stage:
            kwargs = {"target": target, "losses": losses}
        self.call(timeline, *args, **kwargs)

    def call(self, timeline: IterationTimeline, *args: Any, **kwargs: Any) -> Any:
        """The schedule's own ``step(*args, **kwargs)``, its blocking waits as slots.

        Several calls in one iteration (gradient accumulation) number their waits on
        from the previous call's: slot ids stay unique within the iteration."""
        assert self.raw_step is not None
        if not self.instrument:
            return self.raw_step(*args, **kwargs)
        if self._numbered is not timeline:
            self._num_waits = 0
            self._numbered = timeline
        self._timeline = timeline
        original = _sched._wait_batch_p2p
        _sched._wait_batch_p2p = self._wait_batch_p2p  # type: ignore[assignment]
        try:
            return self.raw_step(*args, **kwargs)
        finally:
            _sched._wait_batch_p2p = original
            self._timeline = None
