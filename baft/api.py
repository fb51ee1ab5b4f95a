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
a function run through :func:`run` and ``torchrun ... -m baft.inprocess script.py``, only
the failed process restarts: the others re-enter the function (:mod:`baft.inprocess`).

This is the one door to the engine: the reference trainer (``baft train``) goes through
it too. It wires restore -> engine once and keeps the run's one progress record.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage

from baft.config import T_IMPORT, CheckpointConfig, default_job_id
from baft.engine.transport import destroy_group
from baft.errors import is_refusal, refusal
from baft.liveness import channel
from baft.liveness.termination import hold_sigterm
from baft.liveness.watchdog import NoWatchdog, Watchdog, start_watchdog
from baft.pipeline.layout import (
    check_fsdp_supported,
    check_no_sharded_replicas,
    check_replica_layouts,
    detect_mesh,
    fsdp_reduces_over,
)
from baft.pipeline.mesh import Mesh, mesh_from_user, mesh_view, pick_device
from baft.pipeline.state import DEFAULT_EXTRA_CAPACITY, Stateful, check_optimizer
from baft.pipeline.step import StepResult, StepRunner
from baft.plan.names import is_extra
from baft.topology import Topology

log = logging.getLogger("baft")
T = TypeVar("T")


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


class Protected:
    """A user's pipeline training loop with baft's checkpointing and recovery."""

    def __init__(
        self,
        runner: StepRunner,
        mesh: Mesh,
        run_dir: str,
        checkpoint: CheckpointConfig,
        watchdog: Watchdog | NoWatchdog | None = None,
    ) -> None:
        self.runner = runner
        self.mesh = mesh
        self.run_dir = Path(run_dir)
        self.checkpoint = checkpoint
        self.watchdog = watchdog or NoWatchdog()
        """Heartbeat and hang detection (see :mod:`baft.liveness.watchdog`)."""
        self.engine: Any = None
        ch = channel.current()
        # about the process start (or its re-entry in-process): the restart phase ends here
        self._t_launch = ch.entered_at if ch is not None else T_IMPORT
        self._t_ready = time.time()
        """Process group up and model built (the rendezvous phase ends here)."""
        self._report: Any = None
        self._restored = False
        self._faults: list[str] = []
        self._started = False
        self.own_mesh: DeviceMesh | None = None
        """The DeviceMesh protect() made (no ``device_mesh`` given): close() ends its groups."""
        runner.section = self.watchdog.section
        runner.on_step_end.append(self._after_step)
        runner.before_restore = self._not_restored  # the loop raises until restore()
        _LIVE.add(self)

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

    def _not_restored(self) -> None:
        raise RuntimeError(
            "step() before restore(): call start = ft.restore() first (it opens the "
            "snapshot stores and returns the iteration to resume from); without it "
            "nothing would be checkpointed"
        )

    def inject(self, faults: Sequence[str]) -> None:
        """Arm failure injections (:mod:`baft.faults` specs such as ``kill:rank=1,iter=7``
        or ``node:1,iter=9``) for this process: tests, demos and drills of your own loop.
        Call before :meth:`restore`; a bad spec raises ValueError here."""
        from baft.faults.spec import FaultSpec

        if self._restored:
            raise RuntimeError("inject() after restore(): arm faults before ft.restore()")
        for spec in faults:
            FaultSpec.parse(spec)
        self._faults = list(faults)

    def restore(self) -> int:
        """Build the engine, recover the newest rebuildable version into the live model,
        optimizer and ``state=`` objects; returns the iteration to continue from (0 on
        a fresh job). Collective."""
        from baft.engine.build import build_engine
        from baft.recover.runtime import recover_and_start

        if self._restored:
            raise RuntimeError(
                "restore() was already called: call it once, before the first step()"
            )
        self._restored = True
        self.runner.before_restore = None
        self.runner.paused = True  # a restore may replay optimizer steps: no hooks then
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.watchdog.section("restore"):
            t_build = time.time()
            self.engine = build_engine(
                self.checkpoint, self.run_dir, self.mesh, self.runner, faults=self._faults
            )
            t_built = time.time()
            resume, self._report = recover_and_start(
                self.engine, self.run_dir, t_launch=self._t_launch, t_rdzv=self._t_ready
            )
            if self._report is not None:
                self._report.phase("build_engine", t_built - t_build)
        self._started = True  # a failed restore never ends the job (close keeps stores)
        self.runner.iteration = resume
        # The restored state holds the first process's shape-inference side effects.
        self.runner.protected.undo_inference = resume > 0
        self.runner.paused = False
        # Version ``resume`` is the state now, at the top of the loop (after a restore:
        # the restored state itself; on a fresh job: whatever the script set up).
        self.runner.state.check_live()  # e.g. optimizer.load_state_dict after protect()
        self.runner.state.capture()
        if self.mesh.topology.num_dp > 1:
            self._check_replicas_share_small_state()
        return resume

    def _check_replicas_share_small_state(self) -> None:
        """Warn when DP replicas of a stage hold different small state (RNG, ``state=``
        objects): the replicas share one copy of it in a checkpoint (each holds a share
        of the stage's bytes), so a restore would give all of them the same one.
        Collective over the dp group, once."""
        mine = {n: d for n, d in self.runner.state.digests().items() if is_extra(n)}
        gathered: list[Any] = [None] * dist.get_world_size(self.mesh.dp_group)
        dist.all_gather_object(gathered, mine, group=self.mesh.dp_group)
        differ = sorted({n for g in gathered for n in mine if g.get(n) != mine[n]})
        if differ and self.mesh.coords.dp == 0:  # one line per stage
            log.warning(
                "DP replicas of pp%d.tp%d hold different %s: a checkpoint keeps one copy "
                "per stage, so after a restore every replica continues with the same one; "
                "seed the RNG and build the state= objects identically on every DP replica",
                self.mesh.coords.pp, self.mesh.coords.tp, ", ".join(differ),
            )  # fmt: skip

    def step(
        self, iteration: int, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> float | None:
        """Shorthand for one loop body without clipping or a scheduler: ``zero_grad``,
        ``schedule.step``, DP averaging, ``optimizer.step()``; returns the mean
        microbatch loss on the last stage."""
        if not self._restored:
            self._not_restored()
        return self.runner.run_step(iteration, inputs, target).loss

    def average_gradients(self) -> None:
        """Average the gradients over the DP replicas (with dp > 1): call it after
        ``schedule.step(...)``, before clipping and ``optimizer.step()``."""
        self.runner.average_gradients()

    def _after_step(self, result: StepResult) -> None:
        from baft.recover.report import write_progress

        if self.engine is not None:  # a later recovery counts the iterations it lost
            write_progress(self.run_dir, self.mesh.rank, result.iteration)
        ch = channel.current()
        if ch is not None:
            ch.progress()
        if self._report is not None:
            self._report.first_iteration_done(self.mesh.rank == 0)
            self._report = None

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
        for a restart."""
        if self.engine is not None:
            finished = self._started and not self.runner.in_iteration and sys.exc_info()[0] is None
            with self.watchdog.section("close"):
                ended = self.engine.close(finished=finished)
            ch = channel.current()
            if ch is not None:
                ch.closed(ended)
        self.runner.close()
        self.watchdog.stop()
        if self.own_mesh is not None:  # made by protect(): its groups are ours to end
            _end_groups(self.own_mesh)
            self.own_mesh = None

    def abandon(self) -> None:
        """The job's process groups broke and an in-process recovery is under way: stop
        this generation's engine and watchdog without a collective (the stores stay for
        the restore) and give the schedule and optimizer back."""
        if self.engine is not None:
            self.engine.abandon()
            self.engine = None
        self.watchdog.abandon()
        self.runner.close()
        self.own_mesh = None  # its groups go with the default group
        _LIVE.discard(self)


_LIVE: weakref.WeakSet[Protected] = weakref.WeakSet()
"""Every open :class:`Protected` of this process (what a recovery abandons)."""

ABORT_WAIT_S = 2.0
"""After the training function raised: how long to wait for a recovery announced by the
supervisors (a peer's failure is what broke this rank's collective) before reporting the
error as this rank's own failure."""


def run(main: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run the training function ``main(*args, **kwargs)`` and return its result.

    Under ``torchrun ... -m baft.inprocess script.py`` (see :mod:`baft.inprocess`), when
    any rank fails, every surviving process re-enters ``main`` in the same process, in the
    job's next generation of process groups (``MASTER_PORT`` then names its store), and
    the failed process is replaced; ``ft.restore()`` inside ``main`` brings the newest
    committed version back from memory, each survivor from its own store. Everything built
    inside ``main`` is built again (it holds the old generation's groups); what lives
    outside it (a dataset, a tokenizer, imports) stays. TCP connections opened inside
    ``main`` are shut down when a peer fails (that is how a blocked gloo collective is
    aborted). Without the supervisor this is just ``main(*args, **kwargs)``."""
    ch = channel.current()
    if ch is None:
        return main(*args, **kwargs)
    ch.keep_connections()  # what the script opened so far (module level) is not aborted
    hold_sigterm()  # a preemption during a recovery is flushed by the next generation
    rng = _RandomState.take()  # every entry starts from it, as a fresh process would
    # What exists now (torch, the script's imports and globals) lives for the process:
    # out of the collector's sight, the collection after an abort scans only what the
    # failed generation built (0.45-0.6 s per full collection of an unfrozen heap, here)
    gc.freeze()
    while True:
        try:
            result = main(*args, **kwargs)
        except Exception as e:  # SystemExit (a SIGTERM flush) and KeyboardInterrupt pass
            what = f"{type(e).__name__}: {e}"
            if is_refusal(e) and ch.pending() is None:
                log.error("baft: the training function refused: %s", what)
                ch.refused(what)
                raise
            # a timed-out wait: a peer is hung and no supervisor saw a failure, so none
            # will announce a recovery; any other error may be a peer's death: wait for it
            wait_s = 0.0 if _timed_out(e) else ABORT_WAIT_S
            if not ch.wait_for_generation(wait_s):
                log.error("baft: the training function raised: %s", what)
                ch.failed(what)
                ch.wait_for_generation(None)  # the supervisor announces one, or ends us
        else:
            if ch.close_agreed is not False and ch.pending() is None:
                ch.ended()  # the job's end: what follows is this rank's own work
                return result
            # close() found no agreement (a peer failed in the last iteration): the
            # supervisors recover it, and this rank re-enters with the others
            if not ch.wait_for_generation(ABORT_WAIT_S):
                ch.failed("ft.close() found no agreement on the job's end (a peer is gone)")
                ch.wait_for_generation(None)
        _abandon_generation(ch)
        rng.put()
        gen = ch.enter()
        log.warning(
            "baft: in-process recovery, generation %d (%s): re-entering the training "
            "function in process %d", gen.number, gen.cause, os.getpid(),
        )  # fmt: skip


def _timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a bounded wait that ran out (gloo's, the c10d store's, or a
    TimeoutError), not a connection a peer's death broke."""
    text = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in text or "wait timeout" in text


class _RandomState:
    """The process's global random generators as ``baft.run`` found them (torch's CPU and
    CUDA ones, Python's ``random``, NumPy's legacy one): a survivor re-enters the
    training function with them as the replacement, a fresh process, has them, whatever
    the failed generation drew (a fresh start from iteration 0, or a script seeding
    only at module level, stays bit-identical)."""

    def __init__(self, cpu: torch.Tensor, cuda: list[torch.Tensor] | None, py: Any, np_: Any):
        self.cpu, self.cuda, self.py, self.np = cpu, cuda, py, np_

    @classmethod
    def take(cls) -> _RandomState:
        import random

        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        np_state = None
        if "numpy" in sys.modules:
            np_state = sys.modules["numpy"].random.get_state()
        return cls(torch.get_rng_state(), cuda, random.getstate(), np_state)

    def put(self) -> None:
        import random

        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.py)
        if self.np is not None:
            sys.modules["numpy"].random.set_state(self.np)


def _abandon_generation(ch: channel.Channel) -> None:
    """Everything of the aborted generation goes: baft's engines and watchdogs, the
    sockets opened since, every process group; then the garbage (old model, optimizer,
    groups) before the function builds them again."""
    for protected in list(_LIVE):
        try:
            protected.abandon()
        except Exception as e:  # noqa: BLE001 - keep going: the next generation needs the rest
            log.warning("baft: abandoning the old generation: %s", e)
    ch.abort_again()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            log.debug("destroy_process_group after an abort: %s", e)
    gc.collect()


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
        protected = _protect_on(
            mesh, schedule, stages, modules, optimizer, run_dir, checkpoint, state,
            average_gradients, extra_capacity_bytes,
        )  # fmt: skip
    except BaseException as e:
        if own_mesh is not None:  # a refusal: the groups baft made for it end here
            _end_groups(own_mesh)
        if isinstance(e, ValueError):
            refusal(e)
        raise
    protected.own_mesh = own_mesh
    return protected


def _protect_on(
    mesh: Mesh,
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
    ck.validate(mesh.topology)
    replicas = dist.get_process_group_ranks(mesh.dp_group)
    check_no_sharded_replicas(modules, optimizer, replicas)
    check_fsdp_supported(modules)
    if mesh.topology.num_dp > 1 and fsdp_reduces_over(modules, replicas):
        log.info("FSDP2 (HSDP) averages the gradients over the replicas: baft does not")
        average_gradients, averaged_by = False, "FSDP2"
    else:
        averaged_by = ""
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
    )
    runner.averaged_by = averaged_by
    try:
        runner.layout_digests = _exchange_layouts(runner, mesh)
    except ValueError:
        runner.close()  # the schedule and optimizer are the user's again
        raise
    watchdog = start_watchdog(mesh, runner, ck.timeouts.collective_s, run_dir)
    return Protected(runner, mesh, run_dir, ck, watchdog)
