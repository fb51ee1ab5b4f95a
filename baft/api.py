"""Library face: protect your own torch.distributed.pipelining training loop.

    ft = baft.protect(schedule=schedule, stages=[stage], optimizer=opt, run_dir="runs/x")
    start = ft.restore()                      # collective: resume point (0 on a fresh job)
    for it in range(start, num_iterations):
        loss = ft.step(it, inputs, target)    # pipeline step, DP grad sync, optimizer step
    ft.close()

``step`` replaces the ``schedule.step(...)`` + ``optimizer.step()`` pair of a usual loop;
between them baft runs checkpoint work in the pipeline's bubbles. Launch the script with
torchrun and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and ``--max-restarts N``: after a
crash every process restarts and ``restore`` brings back the newest version it can
rebuild. Your data must be a pure function of the iteration (or restored by you from it),
which is what makes the resumed trajectory bit-identical.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage

from baft.config import CheckpointConfig, TrainConfig, default_job_id
from baft.engine.watchdog import NoWatchdog, Watchdog, start_watchdog
from baft.pipeline.mesh import Mesh, mesh_view, pick_device
from baft.pipeline.step import StepRunner, check_optimizer
from baft.topology import Topology


def _mesh_from(device_mesh: DeviceMesh | None, ranks_per_node: int) -> Mesh:
    if not dist.is_initialized():
        raise ValueError("initialise torch.distributed first (torchrun + init_process_group)")
    device = pick_device()
    if device_mesh is None:
        device_mesh = init_device_mesh(
            device.type, (dist.get_world_size(), 1, 1), mesh_dim_names=("pp", "dp", "tp")
        )
    names = device_mesh.mesh_dim_names or ()
    if set(names) != {"pp", "dp", "tp"}:
        raise ValueError(
            f"device_mesh must have dims named pp, dp, tp (size 1 where unused), got {names}"
        )
    sizes = {n: device_mesh.size(names.index(n)) for n in names}
    topo = Topology(
        num_pp=sizes["pp"], num_dp=sizes["dp"], num_tp=sizes["tp"], ranks_per_node=ranks_per_node
    )
    return mesh_view(device_mesh, topo, device)


class Protected:
    """A user's pipeline training step with baft's checkpointing and recovery."""

    def __init__(
        self,
        runner: StepRunner,
        cfg: TrainConfig,
        mesh: Mesh,
        watchdog: Watchdog | NoWatchdog | None = None,
    ) -> None:
        self.runner = runner
        self.cfg = cfg
        self.mesh = mesh
        self.watchdog = watchdog or NoWatchdog()
        """Heartbeat and hang detection (see :mod:`baft.engine.watchdog`)."""
        self.engine: Any = None
        self._t_launch = time.time()
        self._reported = False
        self._restored = False

    def restore(self) -> int:
        """Open the stores, recover the newest rebuildable version; returns the start iteration."""
        from baft.recover.runtime import recover_and_start

        if self._restored:
            raise RuntimeError(
                "restore() was already called: call it once, before the first step()"
            )
        self._restored = True
        if self.cfg.checkpoint is None:
            return 0
        Path(self.cfg.out_dir).mkdir(parents=True, exist_ok=True)
        with self.watchdog.section("restore"):
            self.engine, resume = recover_and_start(
                self.cfg, self.mesh, self.runner, t_launch=self._t_launch, t_rdzv=self._t_launch
            )
        return resume

    def step(
        self, iteration: int, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> float | None:
        """One training iteration; returns the mean microbatch loss on the last stage."""
        if not self._restored:
            raise RuntimeError(
                "step() before restore(): call start = ft.restore() first (it opens the "
                "snapshot stores and returns the iteration to resume from); without it "
                "nothing would be checkpointed"
            )
        with self.watchdog.section(f"iteration {iteration}"):
            res = self.runner.run_step(iteration, inputs, target)
        if self.mesh.rank == 0 and self.engine is not None:
            # lets a later recovery count the iterations it loses
            (Path(self.cfg.out_dir) / "progress.json").write_text(f'{{"iteration": {iteration}}}')
        if self.engine is not None and self.engine.recovery is not None:
            if not self._reported:
                self.engine.recovery.first_iteration_done(self.mesh.rank == 0)
                self._reported = True
        return res.loss

    @property
    def metrics(self) -> dict[str, Any]:
        """Checkpoint metrics of the last iteration (committed version, bytes, seconds)."""
        return dict(self.engine.last_metrics) if self.engine is not None else {}

    def close(self) -> None:
        """Finish the last commit and any background persist; stop the watchdog."""
        if self.engine is not None:
            with self.watchdog.section("close"):
                self.engine.close()
        self.watchdog.stop()


def protect(
    *,
    schedule: Any,
    stages: list[PipelineStage],
    optimizer: torch.optim.Optimizer,
    run_dir: str,
    device_mesh: DeviceMesh | None = None,
    checkpoint: CheckpointConfig | None = None,
    ranks_per_node: int = 0,
) -> Protected:
    """Wrap a schedule, its stages (on this rank) and an Adam/AdamW optimizer.

    ``device_mesh`` has dims named ``pp``, ``dp``, ``tp`` (default: every rank a pipeline
    stage). With dp > 1 baft averages gradients over the ``dp`` dim itself (do not wrap the
    stages in DDP). ``checkpoint`` defaults to every iteration, xor:2 parity, persisted to
    ``run_dir/checkpoints`` every 50 checkpoints. Every wait of the mesh's groups and
    the pipeline is bounded by ``checkpoint.timeout_s`` from here on, and a watchdog
    ends this process when a peer freezes (see :mod:`baft.engine.watchdog`).
    """
    check_optimizer(optimizer)
    mesh = _mesh_from(device_mesh, ranks_per_node)
    ck = checkpoint if checkpoint is not None else CheckpointConfig()
    ck.job_id = ck.job_id or default_job_id(run_dir)
    ck.persist_dir = ck.persist_dir or str(Path(run_dir) / "checkpoints")
    cfg = TrainConfig(out_dir=run_dir, checkpoint=ck)
    modules = [s.submod for s in stages]
    runner = StepRunner(
        mesh=mesh,
        modules=modules,
        stages=stages,
        schedule=schedule,
        optimizer=optimizer,
        num_dp=mesh.topology.num_dp,
        num_tp=mesh.topology.num_tp,
    )
    watchdog = start_watchdog(mesh, runner, ck.timeout_s, run_dir)
    return Protected(runner, cfg, mesh, watchdog)
