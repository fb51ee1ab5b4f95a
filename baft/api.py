"""Library face: protect the torch.distributed.pipelining training loop you already have.

    ft = baft.protect(schedule=schedule, stages=[stage], optimizer=optimizer,       # baft
                      run_dir="runs/x", checkpoint=baft.CheckpointConfig(...),      # baft
                      ranks_per_node=8, state={"lr_scheduler": scheduler, "data": sampler})
    start = ft.restore()                      # baft: collective; 0 on a fresh job
    for it in range(start, num_iterations):
        optimizer.zero_grad()
        schedule.step(x, target=y)            # or schedule.step() / schedule.step(x) by stage
        torch.nn.utils.clip_grad_norm_(stage.submod.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    ft.close()                                # baft

baft finds the pipeline's bubbles through the schedule object it was given (its ``step``
runs through baft's slots, with the same arithmetic) and takes its checkpoint work from
the optimizer's step hooks: iteration (version) ``v`` is the ``v``-th optimizer step, and
``restore`` returns the step to continue from. ``ft.step(it, inputs, target)`` is a
shorthand for the loop body without clipping or a scheduler (the same trajectory).

What is saved, every version: the parameters and persistent buffers of every stage
module, the optimizer's state (created up front as its first step would, so the layout
is fixed) and every param group's hyperparameters, the CPU (and CUDA) RNG states, and
every ``state=`` object's ``state_dict()`` (LR schedulers, samplers, data loaders, your
counters), encoded without pickle. LR schedulers are saved as of the next
``schedule.step`` (your ``scheduler.step()`` follows ``optimizer.step()``), every other
object as of the end of ``optimizer.step()``: advance your own counters before the step.

Launch the script with torchrun, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and
``--max-restarts N``: after a crash every process restarts and ``restore`` brings back
the newest version it can rebuild, bit-identical to where the loop was. With the loop in
a function run through :func:`baft.run` and ``torchrun ... -m baft.inprocess script.py``, only
the failed process restarts: the others re-enter the function (:mod:`baft.inprocess`).

This is the one door to the engine: the reference trainer (``baft train``) goes through
it too. It wires restore -> engine once and keeps the run's one progress record.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage

from baft.config import T_IMPORT, CheckpointConfig, default_job_id
from baft.engine.closing import JobNotEnded
from baft.engine.transport import destroy_group
from baft.errors import refusal
from baft.liveness import generation
from baft.liveness.watchdog import NoWatchdog, Watchdog, start_watchdog
from baft.pipeline import elastic
from baft.pipeline.elastic import elastic_dp
from baft.pipeline.layout import (
    check_fsdp_supported,
    check_no_sharded_replicas,
    check_replica_layouts,
    detect_mesh,
    fsdp_reduces_over,
)
from baft.pipeline.mesh import Mesh, mesh_from_user, mesh_view, pick_device
from baft.pipeline.state import DEFAULT_EXTRA_CAPACITY, Stateful, check_optimizer
from baft.pipeline.step import NOT_RESTORED, Phase, StepResult, StepRunner
from baft.topology import Topology

log = logging.getLogger("baft")
__all__ = ["Protected", "elastic_dp", "protect"]


def _mesh_from(
    device_mesh: DeviceMesh | None, ranks_per_node: int, modules: Sequence[torch.nn.Module]
) -> tuple[Mesh, DeviceMesh | None]:
    """baft's view of the job's mesh and the DeviceMesh baft made for it (None when it
    made none): the user's ``device_mesh``, else the mesh the stages' DTensor parameters
    (FSDP2, TP) live on, else every rank a pipeline stage."""
    if not dist.is_initialized():
        raise ValueError("initialise torch.distributed first (torchrun + init_process_group)")
    device = pick_device()
    if device_mesh is None:
        device_mesh = detect_mesh(modules, dist.get_world_size())
        if device_mesh is not None:
            log.info("device mesh from the stages' DTensor parameters: %s", device_mesh)
    if device_mesh is None:
        own = init_device_mesh(
            device.type, (dist.get_world_size(), 1, 1), mesh_dim_names=("pp", "dp", "tp")
        )
        topo = Topology(num_pp=dist.get_world_size(), ranks_per_node=ranks_per_node)
        return mesh_view(own, topo, device), own
    return mesh_from_user(device_mesh, ranks_per_node, device)


def _exchange_layouts(runner: StepRunner, mesh: Mesh) -> dict[str, str]:
    """Every ``(pp, tp)``'s state layout digest, after checking that the DP ranks of this
    rank's ``(pp, tp)`` hold the same tensors (names, shapes, placements, offsets): ranks
    that do not are shards, not replicas, and baft refuses them here, before the first
    step (ValueError naming the first differing tensor), on every rank: a refusal seen by
    one DP group travels with the digests, so no other rank waits for it in a collective.
    Collective: the layouts over the dp group, the digests over the world."""
    c = mesh.coords
    problem = ""
    if mesh.topology.num_dp > 1:
        layouts: list[Any] = [None] * dist.get_world_size(mesh.dp_group)
        dist.all_gather_object(
            layouts, ((c.pp, c.dp, c.tp), runner.state.layout()), group=mesh.dp_group
        )
        try:
            check_replica_layouts(layouts)
        except ValueError as e:
            problem = str(e)
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, (f"pp{c.pp}.tp{c.tp}", runner.state.layout_digest, problem))
    problems = sorted({p for _, _, p in digests if p})
    if problems:
        raise ValueError(problems[0])
    return {key: digest for key, digest, _ in digests}


class _Phase(enum.Enum):
    NEW = "new"
    """Protected; faults may be armed; the loop raises until :meth:`Protected.restore`."""
    RESTORING = "restoring"
    """restore() began (a failed one never ends the job: close keeps the stores)."""
    RUNNING = "running"
    """Restored: every step is checkpointed."""
    ENDED = "ended"
    """Closed, or abandoned by an in-process recovery."""


class _AfterStep:
    """What follows every optimizer step of a protected loop: the progress record (a
    later recovery counts the iterations it lost), the supervisor's progress message,
    and the recovery report's first iteration. Built before the runner that calls it."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self._recording = False
        self._report: Any = None

    def start(self, report: Any) -> None:
        """The engine runs: record progress from now on, and end ``report`` (a recovery's,
        or None) at the first iteration."""
        self._recording = True
        self._report = report

    def __call__(self, result: StepResult) -> None:
        from baft.recover.report import write_progress

        if self._recording:
            write_progress(self.run_dir, self.rank, result.iteration)
        link = generation.current()
        if link is not None:
            link.progress()
        if self._report is not None:
            self._report.first_iteration_done(self.rank == 0)
            self._report = None


class Protected:
    """A user's pipeline training loop with baft's checkpointing and recovery: what
    :func:`protect` returns, built whole from the runner, watchdog and mesh it made."""

    def __init__(
        self,
        runner: StepRunner,
        mesh: Mesh,
        run_dir: str | Path,
        checkpoint: CheckpointConfig,
        *,
        watchdog: Watchdog | NoWatchdog,
        after_step: _AfterStep,
        own_mesh: DeviceMesh | None = None,
    ) -> None:
        self.runner = runner
        self.mesh = mesh
        self.run_dir = Path(run_dir)
        self.checkpoint = checkpoint
        self.watchdog = watchdog
        """Heartbeat and hang detection (see :mod:`baft.liveness.watchdog`)."""
        self.engine: Any = None
        self.own_mesh = own_mesh
        """The DeviceMesh protect() made (no ``device_mesh`` given): close() ends its groups."""
        self._after_step = after_step
        self.recovery: Any = None
        """The restore's recovery report (a :class:`~baft.recover.report.RecoveryReport`
        with its ``record``), or None when :meth:`restore` started the job fresh."""
        self._phase = _Phase.NEW
        self._faults: list[str] = []
        link = generation.current()
        # about the process start (or its re-entry in-process): the restart phase ends here
        self._t_launch = link.entered_at if link is not None else T_IMPORT
        self._t_ready = time.time()
        """Process group up and model built (the rendezvous phase ends here)."""
        generation.join(self)  # an in-process recovery abandons it

    @property
    def state(self) -> Any:
        """What is checkpointed: a :class:`~baft.pipeline.state.TrainingState`."""
        return self.runner.state

    @property
    def last_step(self) -> StepResult | None:
        """The last step's result (loss, timeline of slots, compute and checkpoint work)."""
        return self.runner.last_step

    @property
    def iteration(self) -> int:
        """The iteration (version) the next ``optimizer.step()`` ends."""
        return self.runner.iteration

    def inject(self, faults: Sequence[str]) -> None:
        """Arm failure injections (:mod:`baft.faults` specs such as ``kill:rank=1,iter=7``
        or ``node:1,iter=9``) for this process: tests, demos and drills of your own loop.
        Call before :meth:`restore`; a bad spec raises ValueError here."""
        from baft.faults.spec import FaultSpec

        if self._phase is not _Phase.NEW:
            raise RuntimeError("inject() after restore(): arm faults before ft.restore()")
        for spec in faults:
            FaultSpec.parse(spec)
        self._faults = list(faults)

    def restore(self) -> int:
        """Build the engine, recover the newest rebuildable version into the live model,
        optimizer and ``state=`` objects; returns the iteration to continue from (0 on
        a fresh job). Collective."""
        if self._phase is not _Phase.NEW:
            raise RuntimeError(
                "restore() was already called: call it once, before the first step()"
            )
        self._phase = _Phase.RESTORING
        self.runner.begin_restore()  # a restore may replay optimizer steps: no hooks then
        try:
            resume = self._restore()
        except BaseException as e:
            self.runner.restore_failed(
                f"restore() failed ({type(e).__name__}: {e}); nothing is checkpointed, so "
                "the loop must not go on: fix the cause and launch again"
            )
            raise
        return resume

    def _restore(self) -> int:
        from baft.engine.build import build_engine
        from baft.recover.runtime import recover_and_start

        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.watchdog.section("restore"):
            t_build = time.time()
            self.engine = build_engine(
                self.checkpoint, self.run_dir, self.mesh, self.runner,
                faults=self._faults, absent=self.watchdog.absent_peer,
            )  # fmt: skip
            t_built = time.time()
            resume, report = recover_and_start(
                self.engine, self.run_dir, t_launch=self._t_launch, t_rdzv=self._t_ready
            )
            if report is not None:
                report.phase("build_engine", t_built - t_build)
        self._phase = _Phase.RUNNING
        self.recovery = report
        self._after_step.start(report)
        # The restored state holds the first process's shape-inference side effects.
        self.runner.protected.undo_inference = resume > 0
        self.runner.end_restore(resume)
        # Version ``resume`` is the state now, at the top of the loop (after a restore:
        # the restored state itself; on a fresh job: whatever the script set up).
        self.runner.state.check_live()  # e.g. optimizer.load_state_dict after protect()
        self.runner.state.capture()
        if resume == 0 and self.runner.elastic is not None:  # every replica from here
            self.runner.elastic.fresh_start()
        return resume

    def step(
        self, iteration: int, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> float | None:
        """Shorthand for one loop body without clipping or a scheduler: ``zero_grad``,
        ``schedule.step``, DP averaging, ``optimizer.step()``; returns the mean
        microbatch loss on the last stage."""
        if self._phase is _Phase.NEW:
            raise RuntimeError(NOT_RESTORED)
        self.runner._check_restored()  # a failed restore() says so
        return self.runner.run_step(iteration, inputs, target).loss

    def replicas(self) -> Iterator[int]:
        """The DP replicas this rank computes, in order: run each one's forward and
        backward in the loop's body (``for r in ft.replicas(): schedule.step(...)``).
        With elastic replicas (``CheckpointConfig.elastic``) each gets its own RNG and
        ``state=`` objects and the gradients are reduced over all of them when the loop
        ends (:mod:`baft.pipeline.elastic`); without, it is this rank's DP index alone."""
        if self._phase is _Phase.NEW:
            raise RuntimeError(NOT_RESTORED)
        if self.runner.elastic is None:
            yield self.mesh.coords.dp
            return
        yield from self.runner.elastic.run(self.runner)

    def average_gradients(self) -> None:
        """Average the gradients over the DP replicas (with dp > 1): call it after
        ``schedule.step(...)``, before clipping and ``optimizer.step()``."""
        self.runner.average_gradients()

    @property
    def metrics(self) -> dict[str, Any]:
        """Checkpoint metrics of the last iteration (committed version, bytes, seconds)."""
        return dict(self.engine.last_metrics) if self.engine is not None else {}

    def close(self) -> None:
        """Finish the last commit and any background persist; stop the watchdog; give the
        schedule and optimizer back (no more hooks). Collective. Called between
        iterations on every rank (after the loop, no exception in flight), it ends the
        job: the snapshot stores are freed unless ``CheckpointConfig.store.keep_on_close``
        (the log says whether the newest version is persisted to DCP); otherwise they stay
        for a restart. A peer that did not end with it (died in ``close()``) makes it raise
        :class:`~baft.engine.closing.JobNotEnded` under a group restart (see there)."""
        not_ended = None
        if self.engine is not None:
            finished = (
                self._phase is _Phase.RUNNING
                and not self.runner.in_iteration
                and sys.exc_info()[0] is None
            )
            with self.watchdog.section("close"):
                ended, why_not = self.engine.close(finished=finished)
            link = generation.current()
            if link is not None:  # in-process: the survivors re-enter with the others
                link.closed(ended)
            elif finished and not ended:
                not_ended = JobNotEnded.because(why_not)
        self._phase = _Phase.ENDED
        self.runner.close()
        self.watchdog.stop()
        if self.own_mesh is not None:  # made by protect(): its groups are ours to end
            _end_groups(self.own_mesh)
            self.own_mesh = None
        generation.leave(self)
        if not_ended is not None:
            raise not_ended

    def abandon(self) -> None:
        """The job's process groups broke and an in-process recovery is under way: stop
        this generation's engine and watchdog without a collective (the stores stay for
        the restore) and give the schedule and optimizer back."""
        if self.engine is not None:
            self.engine.abandon()
            self.engine = None
        self._phase = _Phase.ENDED
        self.watchdog.abandon()
        self.runner.close()
        self.own_mesh = None  # its groups go with the default group
        generation.leave(self)


def _end_groups(mesh: DeviceMesh) -> None:
    """Destroy the process groups of a DeviceMesh baft made (never the default group)."""
    for group in mesh.get_all_groups():
        if group is not dist.GroupMember.WORLD:
            destroy_group(group)


def protect(
    *,
    schedule: Any,
    stages: list[PipelineStage],
    optimizer: torch.optim.Optimizer,
    run_dir: str,
    device_mesh: DeviceMesh | None = None,
    checkpoint: CheckpointConfig | None = None,
    ranks_per_node: int = 0,
    state: Mapping[str, Stateful] | None = None,
    average_gradients: bool | None = None,
    extra_capacity_bytes: int | Mapping[str, int] = DEFAULT_EXTRA_CAPACITY,
) -> Protected:
    """Protect the loop over a schedule, its stages (on this rank) and their optimizer.

    ``optimizer``: torch's SGD, Adam, AdamW, Adagrad or RMSprop (their state is created
    now, as the first step would create it). ``state``: objects with ``state_dict()`` /
    ``load_state_dict()`` to save with every version (LR schedulers, samplers, data
    loaders, counters); keys are names of letters, digits, ``_ . -``. Each object's
    encoded state must fit ``extra_capacity_bytes`` (per object, or a mapping by key).

    ``device_mesh``: the job's DeviceMesh with dims named as torchtitan names them, any
    subset: ``pp``, ``dp_replicate`` (replicas; ``dp`` is accepted for it), ``dp_shard``
    (FSDP2's shard dim), ``cp`` (size 1 only), ``tp``; ranks numbered in that order, as
    ``init_device_mesh`` numbers them. Default: the mesh of the stages' DTensor
    parameters when they have any, else every rank a pipeline stage. Ranks along
    ``dp_shard`` and ``tp`` hold different shards, each checkpointed as its local piece;
    ranks along ``dp_replicate`` are replicas. With replicas the gradients must be
    averaged over them before ``optimizer.step()`` (do not wrap the stages in DDP): call
    ``ft.average_gradients()`` after ``schedule.step(...)`` and before clipping; or pass
    ``average_gradients=True`` to average just before the step (after any clipping), or
    ``False`` if your loop averages them itself. Without either, ``optimizer.step()``
    raises. FSDP2 over ``mesh["dp_replicate", "dp_shard"]`` (HSDP) averages them itself:
    baft then does not. The small state (RNG, ``state=`` objects) must be the same on every
    replica of a stage.

    ``checkpoint`` defaults to every iteration, xor:2 parity, persisted to
    ``run_dir/checkpoints`` every 50 checkpoints. Every wait of the mesh's groups and
    the pipeline is bounded by ``checkpoint.timeouts.collective_s`` from here on, and a watchdog
    ends this process when a peer freezes (see :mod:`baft.liveness.watchdog`).
    """
    try:
        check_optimizer(optimizer)
        modules = [s.submod for s in stages]
        mesh, own_mesh = _mesh_from(device_mesh, ranks_per_node, modules)
    except ValueError as e:  # the same script refuses on every attempt: no restart
        refusal(e)
        raise
    try:
        return _protect_on(
            mesh, own_mesh, schedule, stages, modules, optimizer, run_dir, checkpoint, state,
            average_gradients, extra_capacity_bytes,
        )  # fmt: skip
    except BaseException as e:
        if own_mesh is not None:  # a refusal: the groups baft made for it end here
            _end_groups(own_mesh)
        if isinstance(e, ValueError):
            refusal(e)
        raise


def _protect_on(
    mesh: Mesh,
    own_mesh: DeviceMesh | None,
    schedule: Any,
    stages: list[PipelineStage],
    modules: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    run_dir: str,
    checkpoint: CheckpointConfig | None,
    state: Mapping[str, Stateful] | None,
    average_gradients: bool | None,
    extra_capacity_bytes: int | Mapping[str, int],
) -> Protected:
    """:func:`protect` on baft's view of the job's mesh."""
    # the caller's config stays as given (one config may protect several runs): the
    # run's job id and persist directory go into a copy
    ck = copy.deepcopy(checkpoint) if checkpoint is not None else CheckpointConfig()
    ck.store.job_id = ck.store.job_id or default_job_id(run_dir)
    ck.persist.dir = ck.persist.dir or str(Path(run_dir) / "checkpoints")
    if ck.elastic.num_replicas:  # a job resized to fewer hosts than its code needs
        red, every, why = elastic.protection(
            ck.policy.redundancy, ck.policy.persist_every, mesh.topology
        )
        if why:
            if mesh.rank == 0:
                log.warning("%s", why)
            ck.policy = dataclasses.replace(ck.policy, redundancy=red, persist_every=every)
    ck.validate(mesh.topology)
    replicas = dist.get_process_group_ranks(mesh.dp_group)
    check_no_sharded_replicas(modules, optimizer, replicas)
    check_fsdp_supported(modules)
    if mesh.topology.num_dp > 1 and fsdp_reduces_over(modules, replicas):
        log.info("FSDP2 (HSDP) averages the gradients over the replicas: baft does not")
        average_gradients, averaged_by = False, "FSDP2"
    else:
        averaged_by = ""
    # The watchdog first: every wait from here on (the layouts' collective) is bounded
    # and watched, and the runner is built with its sections.
    watchdog = start_watchdog(mesh, stages, ck.timeouts.collective_s, run_dir)
    after_step = _AfterStep(Path(run_dir), mesh.rank)
    runner = None
    try:
        runner = StepRunner(
            mesh=mesh,
            modules=modules,
            stages=stages,
            schedule=schedule,
            optimizer=optimizer,
            num_dp=mesh.topology.num_dp,
            num_tp=mesh.topology.num_tp,
            state=state,
            extra_capacity_bytes=extra_capacity_bytes,
            average_gradients=average_gradients,
            averaged_by=averaged_by,
            phase=Phase.UNRESTORED,
            section=watchdog.section,
            on_step_end=[after_step],
            wait_timeout_s=ck.timeouts.collective_s,
        )
        elastic.attach(runner, ck.elastic)
        runner.layout_digests = _exchange_layouts(runner, mesh)
    except BaseException:
        if runner is not None:
            runner.close()  # the schedule and optimizer are the user's again
        watchdog.stop()
        raise
    return Protected(
        runner, mesh, run_dir, ck, watchdog=watchdog, after_step=after_step, own_mesh=own_mesh
    )
