"""One protected training step of one rank: the pipeline schedule with slots, DP gradient
all-reduce, the pre-step window and the optimizer step.

:class:`StepRunner` runs a user's stages, schedule and optimizer (``baft.protect`` wraps
them). Checkpointing plugs in through :class:`StepHooks` (slot work inside waits, the
pre-step window, after the step), so the step itself knows nothing about snapshots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from baft.pipeline.adapter import ProtectedSchedule
from baft.pipeline.mesh import Mesh
from baft.pipeline.recorder import IterationTimeline


class StepHooks(Protocol):
    """Where checkpoint work enters the training step."""

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        """At the start of ``iteration``, before any compute."""

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


def check_optimizer(optimizer: Any) -> None:
    """Raise ValueError unless baft can checkpoint this optimizer's state (Adam/AdamW)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(
            f"baft checkpoints Adam/AdamW state; got {type(optimizer).__name__}: "
            "use torch.optim.AdamW or Adam"
        )


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a (possibly DTensor) parameter or state."""
    return t.to_local() if isinstance(t, DTensor) else t


class StepRunner:
    """Runs protected training steps over given stages, schedule and optimizer.

    The part of a training loop baft needs to own: the pipeline step with slots, the DP
    gradient all-reduce (itself a slot), the pre-step window and the optimizer step, with
    the checkpoint hooks in between. :class:`Trainer` builds everything from a config;
    ``baft.api.protect`` wraps a user's own schedule, stages and optimizer.
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
    ) -> None:
        self.mesh = mesh
        self.modules = modules
        self.stages = stages
        self.optimizer = optimizer
        self.num_dp = num_dp
        self.num_tp = num_tp
        self.hooks = hooks
        self.protected = ProtectedSchedule(
            schedule,
            stages,
            on_slot=self._on_slot,
            instrument=instrument,
            on_slot_end=self._on_slot_end,
        )
        self.params = [p for m in modules for p in m.parameters()]

    def _on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        if self.hooks is not None:
            self.hooks.on_slot(slot_id, kind, timeline)

    def _on_slot_end(self, slot_id: str) -> None:
        end = getattr(self.hooks, "after_slot", None)
        if end is not None:
            end(slot_id)

    # ---------------------------------------------------------------- the step
    def run_step(
        self,
        iteration: int,
        inputs: torch.Tensor | None,
        target: torch.Tensor | None,
    ) -> StepResult:
        """Forward/backward of every microbatch, DP all-reduce, optimizer step, with hooks."""
        tl = IterationTimeline(iteration, self.mesh.rank)
        self.optimizer.zero_grad(set_to_none=True)
        if self.hooks is not None:
            self.hooks.before_iteration(iteration, tl)
        losses: list[torch.Tensor] = []
        self.protected.step(tl, inputs, target, losses)
        if self.num_dp > 1:
            self._allreduce_grads(tl)
        self.protected.slot(tl, "pre_step", "pre_step", lambda: None)
        if self.hooks is not None:
            self.hooks.before_optimizer_step(iteration, tl)
        start = tl.now()
        self.optimizer.step()
        tl.add("optimizer", "compute", start, tl.now())
        if self.hooks is not None:
            self.hooks.after_step(iteration, tl)
        tl.finish()
        loss = float(torch.stack(losses).detach().mean()) if losses else None
        return StepResult(iteration=iteration, loss=loss, timeline=tl)

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
    @torch.no_grad()
    def init_optimizer_state(self) -> None:
        """Create AdamW's state now, exactly as its first step would (zeros, step 0).

        Makes the checkpointed layout fixed from iteration 0 and lets a restore load
        optimizer state into a fresh optimizer; the trajectory is unchanged.
        """
        check_optimizer(self.optimizer)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every checkpointable tensor of this rank, by canonical name, in canonical order.

        Model parameters as ``model.<fqn>``, AdamW state as ``optim.<fqn>.<key>``; DTensors
        are yielded as their local shard. Optimizer state exists only after the first step.
        """
        names = {}
        for m in self.modules:
            for fqn, p in m.named_parameters():
                names[id(p)] = fqn
                yield f"model.{fqn}", local(p.data)
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    yield f"optim.{names[id(p)]}.{key}", local(value)

    def state_digests(self) -> dict[str, str]:
        """sha256 of this rank's parameters, buffers and optimizer state, per tensor.

        Keys are canonical names (``model.<fqn>``, ``buffer.<fqn>``, ``optim.<fqn>.<key>``);
        DTensors contribute their local shard.
        """
        out = {name: hashlib.sha256(_tensor_bytes(t)).hexdigest() for name, t in self.named_state()}
        for m in self.modules:
            for fqn, b in m.named_buffers():
                out[f"buffer.{fqn}"] = hashlib.sha256(_tensor_bytes(local(b))).hexdigest()
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
