"""One protected training step of one rank, driven by the user's own loop.

:class:`StepRunner` holds a user's stages, schedule and optimizer (``baft.protect`` wraps
them) and the rank's :class:`~baft.pipeline.state.TrainingState`. It puts itself into the
loop the user already has, without changing its arithmetic:

* the schedule object's ``step`` is wrapped: its first call of an iteration opens the
  iteration (``before_iteration``), and every blocking pipeline wait inside is a slot;
* an optimizer step pre-hook is the step deadline (``before_optimizer_step``, after the
  ``pre_step`` slot), a post-hook ends the iteration (``after_step``), so the iteration
  (version) count is the number of optimizer steps.

Checkpointing plugs in through :class:`StepHooks`, so the step itself knows nothing about
snapshots. :meth:`StepRunner.run_step` is the shorthand ``zero_grad`` + ``schedule.step``
(+ DP averaging) + ``optimizer.step()``, through the same hooks.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from baft.pipeline.adapter import ProtectedSchedule
from baft.pipeline.mesh import Mesh
from baft.pipeline.recorder import IterationTimeline
from baft.pipeline.state import (
    DEFAULT_EXTRA_CAPACITY,
    Stateful,
    TrainingState,
    check_optimizer,
    local,
)
from baft.plan import names

__all__ = [
    "Phase",
    "StepHooks",
    "StepResult",
    "StepRunner",
    "check_optimizer",
    "combine_digests",
    "local",
]


class Phase(enum.Enum):
    """Where a runner's state stands against its checkpoints."""

    UNRESTORED = "unrestored"
    """Protected, not restored yet: the loop raises (nothing would be checkpointed)."""
    RESTORING = "restoring"
    """A restore may replay optimizer steps: the hooks stand aside."""
    RUNNING = "running"
    """Every step runs through the hooks."""


NOT_RESTORED = (
    "step() before restore(): call start = ft.restore() first (it opens the snapshot "
    "stores and returns the iteration to resume from); without it nothing would be "
    "checkpointed"
)


class StepHooks(Protocol):
    """Where checkpoint work enters the training step."""

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        """At the start of ``iteration`` (its first ``schedule.step``), before any compute."""

    def on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        """At a slot, before the rank blocks (runs work planned for that bubble)."""

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        """Last point where live state still equals version ``iteration``."""

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        """After the optimizer step of ``iteration``."""


@dataclass
class StepResult:
    iteration: int
    loss: float | None
    """Mean microbatch loss on ranks holding the last stage, else None."""
    timeline: IterationTimeline


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


DP_AVERAGE_HELP = (
    "call ft.average_gradients() after schedule.step(...) and before clipping and "
    "optimizer.step() (or pass average_gradients=True to baft.protect to average just "
    "before optimizer.step(), after any clipping; or average_gradients=False if your loop "
    "averages them itself)"
)


class StepRunner:
    """The user's stages, schedule and optimizer with baft's slots and step hooks.

    :class:`~baft.train.trainer.Trainer` builds everything from a config;
    ``baft.api.protect`` wraps a user's own schedule, stages and optimizer. Both reach
    the hooks the same way: through the schedule's ``step`` and the optimizer's step hooks.
    """

    def __init__(
        self,
        *,
        mesh: Mesh,
        modules: list[nn.Module],
        stages: list[PipelineStage],
        schedule: Any,
        optimizer: torch.optim.Optimizer,
        num_dp: int,
        num_tp: int,
        instrument: bool = True,
        hooks: StepHooks | None = None,
        state: Mapping[str, Stateful] | None = None,
        extra_capacity_bytes: int | Mapping[str, int] = DEFAULT_EXTRA_CAPACITY,
        average_gradients: bool | None = None,
        averaged_by: str = "",
        phase: Phase = Phase.RUNNING,
        section: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
        on_step_end: Sequence[Callable[[StepResult], None]] = (),
        wait_timeout_s: float | None = None,
    ) -> None:
        for obj, what in ((optimizer, "optimizer"), (schedule, "schedule")):
            if getattr(obj, "_baft_runner", None) is not None:
                raise ValueError(
                    f"this {what} is already protected by an earlier baft.protect(): call "
                    "that one's close() first"
                )
        self.mesh = mesh
        self.modules = modules
        self.stages = stages
        self.schedule = schedule
        self.optimizer = optimizer
        self.num_dp = num_dp
        self.num_tp = num_tp
        self.hooks = hooks
        self.average = average_gradients
        """None: the user calls :meth:`average_gradients` (checked at the step when dp > 1);
        True: averaged in the step pre-hook; False: the user's loop averages them itself."""
        self.averaged_by = averaged_by
        """Who averages the gradients over the replicas instead of baft (``"FSDP2"`` for
        HSDP): :meth:`average_gradients` is then a no-op."""
        self.state = TrainingState(
            modules,
            optimizer,
            state,
            device=mesh.device,
            extra_capacity_bytes=extra_capacity_bytes,
            install_step_hook=False,  # called first in our post-hook (SGD momentum adoption)
        )
        """Everything checkpointed: params, buffers, optimizer state and hyperparameters,
        RNG, the ``state=`` objects (see :mod:`baft.pipeline.state`)."""
        self.protected = ProtectedSchedule(
            schedule,
            stages,
            on_slot=self._on_slot,
            instrument=instrument,
            on_slot_end=self._on_slot_end,
        )
        self.params = [p for m in modules for p in m.parameters()]
        self.iteration = 0
        """The iteration (version) the next optimizer step ends."""
        self.phase = phase
        """See :class:`Phase`; a restore moves it with :meth:`begin_restore` and
        :meth:`end_restore`."""
        self.section = section or (lambda _: contextlib.nullcontext())
        """Wraps baft's work of an iteration (the watchdog's named sections)."""
        self.on_step_end = tuple(on_step_end)
        """Called with every step's result, after its hooks."""
        if wait_timeout_s is not None:
            self.protected.wait_timeout_s = wait_timeout_s
        self.layout_digests: dict[str, str] = {}
        """Every ``(pp, tp)``'s :attr:`TrainingState.layout_digest` by ``"pp{p}.tp{t}"``
        (``baft.protect`` gathers them; empty when nobody did): what each shard of a
        checkpoint records, and a restore checks before it writes."""
        self.last_step: StepResult | None = None
        self.elastic: Any = None  # VirtualReplicas (baft.pipeline.elastic) or None
        self._tl: IterationTimeline | None = None
        self._losses: list[torch.Tensor] = []
        self._averaged = False
        self._t_opt = 0.0
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]
        optimizer._baft_runner = self  # type: ignore[attr-defined]
        self._wrapped = False
        if instrument and schedule is not None:
            # An instance attribute shadows the class's method: the user's schedule.step
            # runs through the slots; ProtectedSchedule keeps the original bound method.
            schedule.step = self._schedule_step
            schedule._baft_runner = self
            self._wrapped = True

    def begin_restore(self) -> None:
        """A restore begins: optimizer steps it replays bypass the hooks."""
        self.phase = Phase.RESTORING

    def end_restore(self, iteration: int) -> None:
        """The state is version ``iteration``: the loop continues from it, protected."""
        self.iteration = iteration
        self.phase = Phase.RUNNING

    def restore_failed(self, why: str) -> None:
        """The restore raised: every later step raises ``why`` (it would run unprotected)."""
        self.phase, self._refusal = Phase.UNRESTORED, why

    def _check_restored(self) -> None:
        if self.phase is Phase.UNRESTORED:
            raise RuntimeError(getattr(self, "_refusal", NOT_RESTORED))

    @property
    def in_iteration(self) -> bool:
        """An iteration has begun (schedule step, averaging) and its optimizer step has not
        ended yet."""
        return self._tl is not None

    def close(self) -> None:
        """Remove the hooks and the schedule wrapper (the objects are the user's again)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._wrapped and self.schedule.__dict__.get("step") == self._schedule_step:
            del self.schedule.step
            del self.schedule._baft_runner
        self._wrapped = False
        if getattr(self.optimizer, "_baft_runner", None) is self:
            del self.optimizer._baft_runner  # type: ignore[attr-defined]

    def _on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        if self.hooks is not None:
            self.hooks.on_slot(slot_id, kind, timeline)

    def _on_slot_end(self, slot_id: str) -> None:
        end = getattr(self.hooks, "after_slot", None)
        if end is not None:
            end(slot_id)

    # ---------------------------------------------------------------- the loop's points
    def _begin(self) -> IterationTimeline:
        """The open iteration's timeline; the first call of an iteration opens it."""
        if self._tl is None:
            it = self.iteration
            self._tl = IterationTimeline(it, self.mesh.rank)
            self._losses = []
            self._averaged = False
            if self.hooks is not None:
                with self.section(f"iteration {it}"):
                    self.hooks.before_iteration(it, self._tl)
        return self._tl

    def _schedule_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``schedule.step(...)``: the same call, with its waits as slots."""
        self._check_restored()
        if self.phase is Phase.RESTORING:
            return self.protected.raw_step(*args, **kwargs)
        tl = self._begin()
        if kwargs.get("losses") is None and self.protected.has_last_stage:
            kwargs["losses"] = self._losses  # for StepResult.loss; the arithmetic is unchanged
        elif kwargs.get("losses") is not None:
            self._losses = kwargs["losses"]
        with self.section(f"iteration {tl.iteration}"):
            return self.protected.call(tl, *args, **kwargs)

    def average_gradients(self) -> None:
        """Average this rank's gradients over its DP replicas (an all-reduce whose wait is
        a slot). Call it after ``schedule.step(...)`` and before clipping and
        ``optimizer.step()``; a no-op without DP replicas, or when FSDP2 (HSDP) averages
        them already (:attr:`averaged_by`)."""
        if self.num_dp == 1 or self.averaged_by or self.elastic is not None:
            return  # elastic: reduced at the end of ft.replicas()
        if self._tl is None:
            raise RuntimeError(
                "average_gradients() before schedule.step(...): call it after the "
                "iteration's schedule.step, before optimizer.step()"
            )
        with self.section(f"iteration {self._tl.iteration}"):
            self._allreduce_grads(self._tl)
        self._averaged = True

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._check_restored()
        if self.phase is Phase.RESTORING:
            return
        tl = self._begin()
        if self.elastic is not None:
            self.elastic.check_reduced()
        elif self.num_dp > 1 and not self._averaged:
            if self.average is None:
                raise RuntimeError(
                    f"optimizer.step() with {self.num_dp} DP replicas but gradients not "
                    f"averaged: {DP_AVERAGE_HELP}"
                )
            if self.average:
                self.average_gradients()
        with self.section(f"iteration {tl.iteration}"):
            self.protected.slot(tl, "pre_step", "pre_step", lambda: None)
            if self.hooks is not None:
                self.hooks.before_optimizer_step(tl.iteration, tl)
        self._t_opt = tl.now()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.phase is Phase.RESTORING or self._tl is None:
            return
        tl = self._tl
        tl.add("optimizer", "compute", self._t_opt, tl.now())
        self.state.after_optimizer_step()  # SGD's first momentum buffers into the layout
        if self.hooks is not None:
            with self.section(f"iteration {tl.iteration}"):
                self.hooks.after_step(tl.iteration, tl)
            self.capture_after_step()
        tl.finish()
        losses = [x for x in self._losses if isinstance(x, torch.Tensor)]
        loss = float(torch.stack(losses).detach().float().mean()) if losses else None
        self.last_step = StepResult(iteration=tl.iteration, loss=loss, timeline=tl)
        self._tl = None
        self._losses = []
        self.iteration = tl.iteration + 1
        for fn in self.on_step_end:
            fn(self.last_step)

    def capture_after_step(self) -> None:
        """The next version's small state that the loop changes before its next
        ``schedule.step``: buffers, RNG and every ``state=`` object but LR schedulers
        (``scheduler.step()`` follows ``optimizer.step()``: those, and the hyperparameters
        they set, are captured at the next ``schedule.step``, see
        :meth:`capture_at_start`)."""
        sched = set(self.state.lr_scheduler_keys())
        self.state.capture(
            optimizer=False, state=[k for k in self.state.stateful if k not in sched]
        )

    def capture_at_start(self) -> None:
        """The version's LR schedulers and hyperparameters, at its first ``schedule.step``;
        and its buffers again: between the step and here a loop with DP replicas syncs
        them from the first replica (as DDP does), and only a forward moves them (the
        copy after the step stays for a version no iteration follows)."""
        self.state.capture(
            buffers=True, rng=False, optimizer=True, state=self.state.lr_scheduler_keys()
        )

    # ---------------------------------------------------------------- the step
    def run_step(
        self,
        iteration: int,
        inputs: torch.Tensor | None,
        target: torch.Tensor | None,
    ) -> StepResult:
        """The shorthand: ``zero_grad``, ``schedule.step``, DP averaging, ``optimizer.step()``
        of iteration ``iteration``, through the same hooks as a user's loop."""
        if self._tl is not None:
            raise RuntimeError(
                f"iteration {self._tl.iteration} is still open (schedule.step without "
                "optimizer.step)"
            )
        self.iteration = iteration
        self.optimizer.zero_grad(set_to_none=True)
        tl = self._begin()
        with self.section(f"iteration {iteration}"):
            self.protected.step(tl, inputs, target, self._losses)
        if self.num_dp > 1 and self.average is not False:
            self.average_gradients()
        self.optimizer.step()
        assert self.last_step is not None and self.last_step.iteration == iteration
        return self.last_step

    def _allreduce_grads(self, tl: IterationTimeline) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.mesh.dp_group, async_op=True)
        assert work is not None
        self.protected.slot(tl, "dp_allreduce", "collective", work.wait)
        flat.div_(self.num_dp)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    # ---------------------------------------------------------------- state
    def named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live parameters (``model.<fqn>``) and optimizer state (``optim.<fqn>.<key>``)
        of this rank, canonical order, DTensors as their local shard. Read from the live
        objects (another checkpointing library may replace optimizer state tensors); what
        baft checkpoints, buffers and small state included, is ``self.state.tensors()``."""
        fqn_of = {}
        for m in self.modules:
            for fqn, p in m.named_parameters():
                fqn_of[id(p)] = fqn
                yield names.model(fqn), local(p.data)
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    yield names.optim(fqn_of[id(p)], key), local(value)

    def state_digests(self) -> dict[str, str]:
        """sha256 of this rank's parameters, buffers and optimizer state, per tensor.

        Keys are canonical names (``model.<fqn>``, ``buffer.<fqn>``, ``optim.<fqn>.<key>``);
        DTensors contribute their local shard.
        """
        out = {name: hashlib.sha256(_tensor_bytes(t)).hexdigest() for name, t in self.named_state()}
        for m in self.modules:
            for fqn, b in m.named_buffers():
                out[names.buffer(fqn)] = hashlib.sha256(_tensor_bytes(local(b))).hexdigest()
        return out

    def rank_digests(self) -> dict[str, str]:
        """Collective: one digest per rank (``dp{d}.pp{p}.tp{t}``) over its whole state.

        Every rank contributes: TP shards, pipeline stages and DP replicas. DP replicas
        must hold identical state; if any differs this raises ``RuntimeError`` naming the
        tensors, since a replica restored wrongly would otherwise only show iterations later.
        """
        c = self.mesh.coords
        mine = (c.dp, c.pp, c.tp, sorted(self.state_digests().items()))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        by_stage: dict[tuple[int, int], tuple[int, list[tuple[str, str]]]] = {}
        out: dict[str, str] = {}
        for dp, pp, tp, items in sorted(gathered, key=lambda g: (g[0], g[1], g[2])):
            h = hashlib.sha256()
            for key, digest in items:
                h.update(f"{key}={digest}\n".encode())
            out[f"dp{dp}.pp{pp}.tp{tp}"] = h.hexdigest()
            first = by_stage.setdefault((pp, tp), (dp, items))
            if first[1] != items:
                differ = sorted(
                    {k for k, _ in set(items) ^ set(first[1])},
                )
                raise RuntimeError(
                    f"DP replicas dp{first[0]} and dp{dp} of pp{pp}.tp{tp} hold different "
                    f"state: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}"
                )
        return out

    def state_digest(self) -> str:
        """Collective: one sha256 over every rank's :meth:`rank_digests`. Identical
        trajectories give identical digests; raises if DP replicas differ."""
        return combine_digests(self.rank_digests())


def combine_digests(rank_digests: dict[str, str]) -> str:
    """One sha256 over per-rank digests, in key order."""
    h = hashlib.sha256()
    for key, digest in sorted(rank_digests.items()):
        h.update(f"{key}={digest}\n".encode())
    return h.hexdigest()
