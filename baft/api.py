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

This is the one door to the engine: the reference trainer (``baft train``) goes through
it too. It wires restore -> engine once and keeps the run's one progress record.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage

from baft.config import T_IMPORT, CheckpointConfig, default_job_id
from baft.engine.watchdog import NoWatchdog, Watchdog, start_watchdog
from baft.pipeline.mesh import Mesh, mesh_view, pick_device
from baft.pipeline.step import StepResult, StepRunner, check_optimizer
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
        mesh: Mesh,
        run_dir: str,
        checkpoint: CheckpointConfig | None,
        watchdog: Watchdog | NoWatchdog | None = None,
        engine_cls: Any = None,
    ) -> None:
        self.runner = runner
        self.mesh = mesh
        self.run_dir = Path(run_dir)
        self.checkpoint = checkpoint
        """None: the same loop without checkpoints (a baseline)."""
        self.watchdog = watchdog or NoWatchdog()
        """Heartbeat and hang detection (see :mod:`baft.engine.watchdog`)."""
        self.engine: Any = None
        self.last_step: StepResult | None = None
        """The last step's result (loss, timeline of slots, compute and checkpoint work)."""
        self._engine_cls = engine_cls
        self._t_launch = T_IMPORT  # about the process start: the restart phase ends here
        self._t_ready = time.time()
        """Process group up and model built (the rendezvous phase ends here)."""
        self._report: Any = None
        self._restored = False

    def restore(self) -> int:
        """Build the engine, recover the newest rebuildable version; returns the start
        iteration (0 on a fresh job). Collective."""
        from baft.engine.build import build_engine
        from baft.recover.runtime import recover_and_start

        if self._restored:
            raise RuntimeError(
                "restore() was already called: call it once, before the first step()"
            )
        self._restored = True
        if self.checkpoint is None:
            return 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.watchdog.section("restore"):
            kwargs = {"engine_cls": self._engine_cls} if self._engine_cls else {}
            self.engine = build_engine(
                self.checkpoint, self.run_dir, self.mesh, self.runner, **kwargs
            )
            resume, self._report = recover_and_start(
                self.engine, self.run_dir, t_launch=self._t_launch, t_rdzv=self._t_ready
            )
        return resume

    def step(
        self, iteration: int, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> float | None:
        """One training iteration; returns the mean microbatch loss on the last stage."""
        from baft.recover.runtime import write_progress

        if not self._restored:
            raise RuntimeError(
                "step() before restore(): call start = ft.restore() first (it opens the "
                "snapshot stores and returns the iteration to resume from); without it "
                "nothing would be checkpointed"
            )
        with self.watchdog.section(f"iteration {iteration}"):
            self.last_step = self.runner.run_step(iteration, inputs, target)
        if self.engine is not None:  # a later recovery counts the iterations it lost
            write_progress(self.run_dir, self.mesh.rank, iteration)
        if self._report is not None:
            self._report.first_iteration_done(self.mesh.rank == 0)
            self._report = None
        return self.last_step.loss

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
    checkpointing: bool = True,
    instrument: bool = True,
    engine_cls: Any = None,
) -> Protected:
    """Wrap a schedule, its stages (on this rank) and an Adam/AdamW optimizer.

    ``device_mesh`` has dims named ``pp``, ``dp``, ``tp`` (default: every rank a pipeline
    stage). With dp > 1 baft averages gradients over the ``dp`` dim itself (do not wrap the
    stages in DDP). ``checkpoint`` defaults to every iteration, xor:2 parity, persisted to
    ``run_dir/checkpoints`` every 50 checkpoints. Every wait of the mesh's groups and
    the pipeline is bounded by ``checkpoint.timeout_s`` from here on, and a watchdog
    ends this process when a peer freezes (see :mod:`baft.engine.watchdog`).

    For baselines: ``checkpointing=False`` runs the same step without checkpoints,
    ``instrument=False`` the bare torch schedule (no slots, implies no checkpoints), and
    ``engine_cls`` swaps the engine's scheduling (benchmarks' naive-async).
    """
    check_optimizer(optimizer)
    mesh = _mesh_from(device_mesh, ranks_per_node)
    ck = checkpoint if checkpoint is not None else CheckpointConfig()
    ck.job_id = ck.job_id or default_job_id(run_dir)
    ck.persist_dir = ck.persist_dir or str(Path(run_dir) / "checkpoints")
    ck.validate(mesh.topology)
    runner = StepRunner(
        mesh=mesh,
        modules=[s.submod for s in stages],
        stages=stages,
        schedule=schedule,
        optimizer=optimizer,
        num_dp=mesh.topology.num_dp,
        num_tp=mesh.topology.num_tp,
        instrument=instrument,
    )
    watchdog = start_watchdog(mesh, runner, ck.timeout_s, run_dir)
    enabled = checkpointing and instrument
    return Protected(runner, mesh, run_dir, ck if enabled else None, watchdog, engine_cls)
