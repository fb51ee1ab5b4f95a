"""The reference app's model on one rank: GPT stages (with TP and FSDP2), schedule, AdamW
and data.

:class:`Trainer` builds what a user's script would build (stage modules, pipeline stages,
the schedule, the optimizer) from a :class:`~baft.train.config.TrainConfig`, and the bundled
byte-level data; the training step itself is the library's
:class:`~baft.pipeline.step.StepRunner` behind ``baft.protect``, the door users take. A
run without checkpoints (no ``checkpoint``, or ``instrument`` off: the bare torch
schedule) drives the runner itself: no engine, nothing to restore.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from baft.api import Protected, protect
from baft.config import CheckpointConfig
from baft.liveness.watchdog import NoWatchdog, Watchdog, start_watchdog
from baft.model.gpt import TP_PLAN_COLWISE, TP_PLAN_ROWWISE, build_stage_module, loss_fn
from baft.pipeline import build_schedule, stage_indices
from baft.pipeline.mesh import Mesh
from baft.pipeline.step import StepResult, StepRunner
from baft.train.config import TrainConfig
from baft.train.data import ByteDataSource

__all__ = ["StepResult", "Trainer"]


class Trainer:
    """One rank's share of the reference model, built from a config, its data, and the
    protected step: the model goes through ``baft.protect`` like any user's script (when
    the run checkpoints)."""

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
            # the host is free while the emulated device computes: a copy thread plays DMA
            ck.exchange.snapshot_copy = "thread"
        self.ft: Protected | None = None
        """The protected loop; None when the run has no checkpoints."""
        self._watchdog: Watchdog | NoWatchdog = NoWatchdog()
        """The watchdog of a run without checkpoints (``ft`` has its own)."""
        if ck is not None and cfg.instrument:
            self.ft = protect(
                schedule=self.schedule,
                stages=self.stages,
                optimizer=self.optimizer,
                run_dir=cfg.out_dir,
                device_mesh=mesh.mesh,
                checkpoint=ck,
                ranks_per_node=par.ranks_per_node,
            )
            self.ft.inject(cfg.inject)
            self.runner: StepRunner = self.ft.runner
            """The library's step runner (its ``hooks`` may be swapped: see ``hooks``)."""
        else:
            self.runner = self._bare_runner((ck or CheckpointConfig()).timeouts.collective_s)

    def _bare_runner(self, timeout_s: float) -> StepRunner:
        """The step runner without an engine: the same loop with no checkpoints (with
        ``instrument`` off, the bare torch schedule), waits bounded and watched as in
        ``baft.protect``."""
        self._watchdog = start_watchdog(self.mesh, self.stages, timeout_s, self.cfg.out_dir)
        return StepRunner(
            mesh=self.mesh,
            modules=self.modules,
            stages=self.stages,
            schedule=self.schedule,
            optimizer=self.optimizer,
            num_dp=self.mesh.topology.num_dp,  # replicas: FSDP2 reduces over dp_shard itself
            num_tp=self.mesh.topology.num_tp,
            instrument=self.cfg.instrument,
            section=self._watchdog.section,
            wait_timeout_s=timeout_s,
        )

    def restore(self) -> int:
        """The iteration to start from: the protected loop's restore (collective), 0 for
        a run without checkpoints."""
        return self.ft.restore() if self.ft is not None else 0

    @property
    def metrics(self) -> dict[str, Any]:
        """Checkpoint metrics of the last iteration (empty without checkpoints)."""
        return self.ft.metrics if self.ft is not None else {}

    def close(self) -> None:
        """End the run: the protected loop's close (collective), or give the schedule and
        optimizer back and stop the watchdog."""
        if self.ft is not None:
            self.ft.close()
            return
        self.runner.close()
        self._watchdog.stop()

    def _build_module(self, stage: int) -> nn.Module:
        par = self.cfg.parallel
        module: nn.Module = build_stage_module(self.cfg.model, stage, par.num_stages, self.cfg.seed)
        names = self.mesh.mesh.mesh_dim_names or ()
        if par.num_tp > 1:
            plan: dict[str, Any] = {n: ColwiseParallel() for n in TP_PLAN_COLWISE}
            plan.update({n: RowwiseParallel() for n in TP_PLAN_ROWWISE})
            tp_mesh = self.mesh.mesh["tp"] if "dp_shard" in names else self.mesh.tp_mesh
            for block in module.layers.values():  # type: ignore[union-attr,operator]
                parallelize_module(block, tp_mesh, plan)
        if par.num_dp_shard > 1:
            # as torchtitan's parallelize: FSDP2 after TP, each block then the stage root,
            # over the dp_shard dim; no reshard after forward under pipelining (the
            # microbatches' backwards would gather every block again)
            dp_shard = self.mesh.mesh["dp_shard"]
            module.to(self.mesh.device)
            for block in module.layers.values():  # type: ignore[union-attr,operator]
                fully_shard(block, mesh=dp_shard, reshard_after_forward=False)
            fully_shard(module, mesh=dp_shard, reshard_after_forward=False)
        if self.cfg.compute == "emulated":
            from baft.model.emulated import wrap_emulated

            times = self.cfg.emulated_times or {}
            module = wrap_emulated(module, times["fwd"][stage], times["bwd"][stage])
        return module.to(self.mesh.device)

    @property
    def data_rank(self) -> int:
        """Which slice of a global batch this rank reads: one per replica and FSDP2 shard
        (``dp * num_dp_shard + dp_shard``); TP ranks of a shard read the same slice. baft's
        shard coordinate is ``dp_shard * num_tp + tp`` (:func:`baft.pipeline.mesh.mesh_from_user`)."""
        c, par = self.mesh.coords, self.cfg.parallel
        return c.dp * par.num_dp_shard + c.tp // par.num_tp

    def batch(
        self, iteration: int, replica: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets of ``iteration`` (a pure function of it); with
        elastic replicas, those of virtual replica ``replica``."""
        self.data.position = iteration
        par = self.cfg.parallel
        rank, ranks = self.data_rank, par.num_data_ranks
        if replica is not None:  # the same slice whichever rank computes the replica
            shard = self.mesh.coords.tp // par.num_tp
            rank, ranks = replica * par.num_dp_shard + shard, self.elastic * par.num_dp_shard
        x, y = self.data.next_batch(rank, ranks)
        return x.to(self.mesh.device), y.to(self.mesh.device)

    @property
    def elastic(self) -> int:
        """The run's elastic replicas (0: its DP ranks are the replicas)."""
        ck = self.cfg.checkpoint
        return ck.elastic.num_replicas if ck is not None and self.ft is not None else 0

    def train_step(self, iteration: int) -> StepResult:
        """Iteration ``iteration`` through the public door (``Protected.step``, or with
        elastic replicas the loop over ``ft.replicas()``), or on the runner of a run
        without checkpoints."""
        if self.ft is None:
            return self.run_step(iteration)
        if self.elastic:
            self.optimizer.zero_grad(set_to_none=True)
            first, last = (
                self.runner.protected.has_first_stage,
                self.runner.protected.has_last_stage,
            )
            for r in self.ft.replicas():  # through the schedule's step, as a user's loop
                x, y = self.batch(iteration, r)
                self.schedule.step(*((x,) if first else ()), **({"target": y} if last else {}))
            self.optimizer.step()
        else:
            self.ft.step(iteration, *self.batch(iteration))
        assert self.ft.last_step is not None
        return self.ft.last_step

    def run_step(self, iteration: int) -> StepResult:
        """Iteration ``iteration`` on the runner with whatever ``hooks`` are set (a
        protected runner only once restored)."""
        return self.runner.run_step(iteration, *self.batch(iteration))

    # what measurement harnesses and tests read of the runner
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
