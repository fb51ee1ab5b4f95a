"""The training loop of one rank: pipeline stages (with TP), DP gradient all-reduce, AdamW.

A :class:`Trainer` owns the model stages, the optimizer, the data source and the
:class:`~baft.pipeline.ProtectedSchedule`. Checkpointing plugs in through
:class:`StepHooks` (slot work inside waits, the pre-step window, after the step) so the
loop itself knows nothing about snapshots.
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
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from baft.config import TrainConfig
from baft.model.gpt import TP_PLAN_COLWISE, TP_PLAN_ROWWISE, build_stage_module, loss_fn
from baft.pipeline import IterationTimeline, ProtectedSchedule, build_schedule, stage_indices
from baft.train.data import ByteDataSource
from baft.train.mesh import Mesh


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


class Trainer(StepRunner):
    """One rank's share of the reference model, built from a config, and its data."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, hooks: StepHooks | None = None) -> None:
        self.cfg = cfg
        self.mesh = mesh
        par = cfg.parallel
        self.stage_ids = stage_indices(par.schedule, mesh.coords.pp, par.num_pp, par.num_virtual)
        modules = [self._build_module(i) for i in self.stage_ids]
        stages = [
            PipelineStage(m, i, par.num_stages, mesh.device, group=mesh.pp_group)
            for m, i in zip(modules, self.stage_ids, strict=True)
        ]
        schedule = build_schedule(par.schedule, stages, par.num_microbatches, loss_fn)
        params = [p for m in modules for p in m.parameters()]
        optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False
        )
        super().__init__(
            mesh=mesh,
            modules=modules,
            stages=stages,
            schedule=schedule,
            optimizer=optimizer,
            num_dp=par.num_dp,
            num_tp=par.num_tp,
            instrument=cfg.instrument,
            hooks=hooks,
        )
        self.data = ByteDataSource(
            seq_len=cfg.model.seq_len, global_batch=cfg.global_batch, seed=cfg.seed
        )

    def _build_module(self, stage: int) -> nn.Module:
        par = self.cfg.parallel
        module: nn.Module = build_stage_module(self.cfg.model, stage, par.num_stages, self.cfg.seed)
        if par.num_tp > 1:
            plan: dict[str, Any] = {n: ColwiseParallel() for n in TP_PLAN_COLWISE}
            plan.update({n: RowwiseParallel() for n in TP_PLAN_ROWWISE})
            for block in module.layers.values():  # type: ignore[union-attr,operator]
                parallelize_module(block, self.mesh.tp_mesh, plan)
        if self.cfg.compute == "emulated":
            from baft.model.emulated import wrap_emulated

            times = self.cfg.emulated_times or {}
            module = wrap_emulated(module, times["fwd"][stage], times["bwd"][stage])
        return module.to(self.mesh.device)

    def train_step(self, iteration: int) -> StepResult:
        """Run iteration ``iteration`` (0-based) on its batch of the bundled corpus."""
        c = self.mesh.coords
        self.data.position = iteration
        x, y = self.data.next_batch(c.dp, self.cfg.parallel.num_dp)
        return self.run_step(iteration, x.to(self.mesh.device), y.to(self.mesh.device))
