"""The reference app's model on one rank: GPT stages (with TP), schedule, AdamW and data.

:class:`Trainer` builds what a user's script would build (stage modules, pipeline stages,
the schedule, the optimizer) from a :class:`~baft.config.TrainConfig`, and the bundled
byte-level data; the training step itself is the library's
:class:`~baft.pipeline.step.StepRunner`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from baft.config import TrainConfig
from baft.model.gpt import TP_PLAN_COLWISE, TP_PLAN_ROWWISE, build_stage_module, loss_fn
from baft.pipeline import build_schedule, stage_indices
from baft.pipeline.mesh import Mesh
from baft.pipeline.step import StepHooks, StepResult, StepRunner
from baft.train.data import ByteDataSource

__all__ = ["StepResult", "Trainer"]


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
