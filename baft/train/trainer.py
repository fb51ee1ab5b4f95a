"""The reference app's model on one rank: GPT stages (with TP), schedule, AdamW and data.

:class:`Trainer` builds what a user's script would build (stage modules, pipeline stages,
the schedule, the optimizer) from a :class:`~baft.config.TrainConfig`, and the bundled
byte-level data; the training step itself is the library's
:class:`~baft.pipeline.step.StepRunner` behind ``baft.protect``, the door users take.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from baft.api import Protected, protect
from baft.config import TrainConfig
from baft.model.gpt import TP_PLAN_COLWISE, TP_PLAN_ROWWISE, build_stage_module, loss_fn
from baft.pipeline import build_schedule, stage_indices
from baft.pipeline.mesh import Mesh
from baft.pipeline.step import StepResult, StepRunner
from baft.train.data import ByteDataSource

__all__ = ["StepResult", "Trainer"]


class Trainer:
    """One rank's share of the reference model, built from a config, its data, and the
    protected step: the model goes through ``baft.protect`` like any user's script."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh) -> None:
        self.cfg = cfg
        self.mesh = mesh
        par = cfg.parallel
        self.stage_ids = stage_indices(par.schedule, mesh.coords.pp, par.num_pp, par.num_virtual)
        self.modules = [self._build_module(i) for i in self.stage_ids]
        self.stages = [
            PipelineStage(m, i, par.num_stages, mesh.device, group=mesh.pp_group)
            for m, i in zip(self.modules, self.stage_ids, strict=True)
        ]
        self.schedule = build_schedule(par.schedule, self.stages, par.num_microbatches, loss_fn)
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False
        )
        self.data = ByteDataSource(
            seq_len=cfg.model.seq_len, global_batch=cfg.global_batch, seed=cfg.seed
        )
        ck = cfg.checkpoint
        if ck is not None and cfg.compute == "emulated":
            ck.snapshot_copy = "thread"  # the host is free while the emulated device computes
        self.ft: Protected = protect(
            schedule=self.schedule,
            stages=self.stages,
            optimizer=self.optimizer,
            run_dir=cfg.out_dir,
            device_mesh=mesh.mesh,
            checkpoint=ck,
            ranks_per_node=par.ranks_per_node,
            checkpointing=ck is not None,
            instrument=cfg.instrument,
        )
        self.runner: StepRunner = self.ft.runner
        """The library's step runner (benchmarks switch its hooks between modes)."""

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

    def batch(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets of ``iteration`` (a pure function of it)."""
        self.data.position = iteration
        x, y = self.data.next_batch(self.mesh.coords.dp, self.cfg.parallel.num_dp)
        return x.to(self.mesh.device), y.to(self.mesh.device)

    def train_step(self, iteration: int) -> StepResult:
        """Iteration ``iteration`` through the public door (``Protected.step``)."""
        self.ft.step(iteration, *self.batch(iteration))
        assert self.ft.last_step is not None
        return self.ft.last_step

    def run_step(self, iteration: int) -> StepResult:
        """Iteration ``iteration`` on the bare runner with whatever hooks a benchmark set."""
        return self.runner.run_step(iteration, *self.batch(iteration))

    # what benchmarks and tests read of the runner
    @property
    def hooks(self) -> Any:
        return self.runner.hooks

    @hooks.setter
    def hooks(self, hooks: Any) -> None:
        self.runner.hooks = hooks

    def named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.runner.named_state()

    def state_digests(self) -> dict[str, str]:
        return self.runner.state_digests()

    def rank_digests(self) -> dict[str, str]:
        return self.runner.rank_digests()

    def state_digest(self) -> str:
        return self.runner.state_digest()
