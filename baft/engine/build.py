"""The one place that builds a rank's checkpoint engine and its collaborators.

:func:`build_engine` makes the transport (a dedicated gloo group), the snapshot store,
the device copiers, the protect worker, the same-host peer views, the persister and the
fault injector, and hands them to :class:`~baft.engine.engine.CheckpointEngine`. Its
collectives (the new groups, the host gather) run here, in the same order on every rank,
never in a constructor. ``baft.protect`` (users, the reference trainer) and the
measurement harness all build engines through it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from baft.config import CheckpointConfig
from baft.engine import admission
from baft.engine.device import ThreadCopy, device_copy_for
from baft.engine.engine import CheckpointEngine, EngineParts
from baft.engine.peers import find_same_host_peers
from baft.engine.priority import background_priority, lower_thread_priority
from baft.engine.scheduling import BubbleAware, Scheduling
from baft.engine.transport import GlooTransport, Transport, destroy_group
from baft.engine.worker import ProtectWorker
from baft.liveness import generation
from baft.liveness.termination import Termination
from baft.pipeline.layout import GlobalLayout
from baft.pipeline.mesh import Mesh
from baft.pipeline.replicas import ReplicaRecords, replicated_digest
from baft.pipeline.step import StepRunner
from baft.plan import names
from baft.store.disk import Persister, PersistKeys, choose_persist_keys
from baft.store.disk_process import ProcessPersister, agree_prefix
from baft.store.paths import host_id, job_path
from baft.store.policy import Redundancy
from baft.store.shm import SnapshotStore

log = logging.getLogger("baft")


class RunnerState:
    """The engine's :class:`~baft.pipeline.live.LiveState` for a step runner: all of
    its :class:`~baft.pipeline.state.TrainingState` (parameters, persistent buffers,
    optimizer state and hyperparameters, RNG, the ``state=`` objects).

    The small-state records (``extra.*``) get this rank's pipeline and tensor-parallel
    coordinates in their names, as the engine's RNG record always had: the names of the
    records are the same on every stage, and DCP keeps one copy of same-named plain
    tensors. DP replicas share the optimizer record; every replica's ``state=`` objects
    and RNG are in the layout once per replica, kept current on every replica by an
    exchange at each version's start (:class:`~baft.pipeline.replicas.ReplicaRecords`, on
    ``transport``), so that a restore gives each replica its own. Parameters stay
    ``model.<fqn>`` and optimizer state ``optim.<fqn>.<key>``; everything else (buffers,
    records) is copied every version by differential checkpoints
    (:func:`baft.plan.names.group_of` is None for it).

    :meth:`capture` is the version's start (its first ``schedule.step``): the LR schedulers
    and the hyperparameters they set. The rest of the small state is captured by the runner
    right after the previous optimizer step (:meth:`StepRunner.capture_after_step`),
    before the loop fetches the next batch or draws from the RNG.
    """

    def __init__(self, runner: StepRunner, transport: Transport, num_replicas: int = 0) -> None:
        self.runner = runner
        self.ts = runner.state
        self.transport = transport
        mesh = runner.mesh
        c = mesh.coords
        self._prefix = prefix = names.extra_prefix(c.pp, c.tp)
        self.replicas = ReplicaRecords(
            self.ts.tensors(), rank=mesh.rank, replicas=mesh.topology.replicas(mesh.rank),
            num_replicas=num_replicas,
        )  # fmt: skip
        self.elastic = runner.elastic
        """The runner's virtual replicas (None without): their records fill this rank's
        copies at a version's start and take the restored ones."""
        named = self.replicas.named()
        self._rename = {n: names.with_coords(n, prefix) for n, _ in named}
        self._named = [(self._rename[n], t) for n, t in named]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._named)

    @property
    def layout_digests(self) -> dict[str, str]:
        """Every ``(pp, tp)``'s layout digest (names, shapes, placements, offsets) by
        ``"pp{p}.tp{t}"``, as ``baft.protect`` gathered them (this rank's alone when it
        did not): recorded with every shard and persisted checkpoint, checked by restores."""
        c = self.runner.mesh.coords
        mine = dict(self.runner.layout_digests) or {f"pp{c.pp}.tp{c.tp}": self.ts.layout_digest}
        return {k: replicated_digest(d, self.replicas.num_dp) for k, d in mine.items()}

    def global_layouts(self) -> dict[str, GlobalLayout]:
        """The DTensor entries' global layouts (TP shards), by engine name."""
        return {self._rename[n]: g for n, g in self.ts.global_layouts().items()}

    def capture(self) -> None:
        self.runner.capture_at_start()
        if self.elastic is not None:  # the hosted replicas' records, kept apart
            self.replicas.fill_hosted(self.elastic.record)
        self.replicas.exchange(self.transport)  # every replica's own records, everywhere

    def named_params(self) -> dict[str, torch.Tensor]:
        return {fqn: p for m in self.runner.modules for fqn, p in m.named_parameters()}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.runner.optimizer

    def check_layout(self, saved: list[tuple[str, int]]) -> None:
        """Raise ValueError naming what differs unless ``saved`` (names, bytes as the
        engine named them) is this state's layout. Before any restored byte is written."""
        plain = [(names.without_coords(n, self._prefix), b) for n, b in saved]
        self.ts.check_layout(self.replicas.own_layout(plain))

    def apply(self) -> None:
        if self.elastic is not None:
            self.replicas.load_first_hosted()
            self.elastic.restored(self.replicas.hosted_copy)
        self.ts.apply()

    def deferred_flags(self) -> tuple[str, list[str]] | None:
        """See :meth:`TrainingState.deferred_flags` (the flags' name as the engine names it)."""
        flags = self.ts.deferred_flags()
        return None if flags is None else (self._rename[flags[0]], flags[1])

    def place_deferred(self, created: Sequence[bool]) -> None:
        self.ts.place_deferred(created)

    def adopt_deferred(self) -> None:
        self.ts.adopt_deferred()


def make_injector(faults: Sequence[str], ck: CheckpointConfig, run_dir: Path, mesh: Mesh) -> Any:
    """The fault injector of the ``faults`` specs (None when nothing is injected)."""
    if not faults:
        return None
    from baft.faults.injector import FaultInjector
    from baft.faults.spec import FaultSpec

    injector = FaultInjector(
        [FaultSpec.parse(s) for s in faults],
        run_dir=run_dir,
        rank=mesh.rank,
        topology=mesh.topology,
        store_root=Path(ck.store.root),
        job_id=ck.store.job_id,
    )
    injector.load()
    return injector


def agree_persist_keys(transport: Transport, mesh: Mesh, names: list[str]) -> PersistKeys:
    """This rank's DCP keys: plain FQNs unless two pipeline stages share one (then every
    key names its stage, see :class:`PersistKeys`). Collective; one rank per stage sends
    its names, every rank reaches the same scheme."""
    c = mesh.coords
    mine = (c.pp, names) if c.dp == 0 and c.tp == 0 else None
    gathered = [s for s in transport.all_gather_object(mine) if s is not None]
    scheme, reason = choose_persist_keys(gathered)
    if mesh.rank == 0:
        log.info("%s", reason)
    return PersistKeys(scheme=scheme, pp=c.pp)


def budget_stores(
    ck: CheckpointConfig, transport: Transport, mesh: Mesh, state: RunnerState, store: SnapshotStore
) -> CheckpointConfig:
    """The job's store budget (configured, or derived from every host: the smallest rank's
    share, see :mod:`baft.engine.admission`), set on ``store``; refuses the job before its
    first step when even the smallest layout cannot fit it. Collective. Returns ``ck``
    with the agreed budget (what ``full_every=auto`` plans under)."""
    nbytes = sum(t.numel() * t.element_size() for _, t in state.named_tensors())
    seen = admission.observe(host_id(), store.root, job_path(store.root, store.job_id))
    mine = (seen, nbytes, ck.store.budget_bytes)
    gathered = transport.all_gather_object(mine)
    if ck.store.budget_bytes is not None:
        budget, reason = ck.store.budget_bytes, "StoreConfig.budget_bytes"
    else:
        derived = [
            admission.derive_budget([g[0] for g in gathered], r) for r in range(len(gathered))
        ]
        worst = min(range(len(derived)), key=lambda r: derived[r][0])
        budget, reason = derived[worst][0], f"derived on rank {worst}: {derived[worst][1]}"
    topo = mesh.topology
    needed = admission.smallest_store_bytes(
        [g[1] for g in gathered], [len(topo.replicas(r)) for r in range(len(gathered))], topo,
        Redundancy.parse(ck.policy.redundancy),
    )  # fmt: skip
    admission.admit(needed, budget, reason, Redundancy.parse(ck.policy.redundancy))
    if mesh.rank == 0:
        log.info(
            "store budget %s B per rank (%s); the smallest layout needs %s B", f"{budget:,}",
            reason, f"{max(needed):,}",
        )  # fmt: skip
    store.budget_bytes = budget
    return dataclasses.replace(ck, store=dataclasses.replace(ck.store, budget_bytes=budget))


def build_engine(
    ck: CheckpointConfig,
    run_dir: str | Path,
    mesh: Mesh,
    runner: StepRunner,
    *,
    scheduling: Scheduling | None = None,
    transport: Transport | None = None,
    persist: bool = True,
    faults: Sequence[str] = (),
    absent: Callable[[], str | None] = lambda: None,
) -> CheckpointEngine:
    """Build the engine of this rank and install it as ``runner``'s hooks. Collective.

    ``scheduling``: when snapshot tasks start (default :class:`BubbleAware`; a baseline
    passes :class:`~baft.engine.scheduling.AllAtStart`); ``persist=False`` builds no DCP
    persister; ``faults``: failure injections (:mod:`baft.faults` specs) the engine fires
    at their points (tests, the demo; ``Protected.inject`` hands them here); ``absent``:
    why a peer can no longer vote on a SIGTERM flush (the running watchdog's probe)."""
    scheduling = scheduling if scheduling is not None else BubbleAware()
    run_dir = Path(run_dir)
    transport = transport or GlooTransport(ck.timeouts.collective_s)
    store = SnapshotStore(
        Path(ck.store.root),
        ck.store.job_id,
        mesh.topology.node_of(mesh.rank),
        mesh.rank,
        ck.store.budget_bytes or 0,  # the agreed budget is set by budget_stores below
    )
    thread_copy = ck.exchange.snapshot_copy == "thread"
    copier = device_copy_for(mesh.device, emulated=thread_copy)
    # Copies that fit no bubble never stall the host either: with a synchronous copier
    # (CPU training) they go to a copy thread started at the iteration's start, where
    # they overlap compute as naive-async's would (bubble-aware is never worse).
    spill_copier = copier if copier.asynchronous else ThreadCopy()
    # Host-side protect work waits for bubbles only when the host also computes.
    gated = mesh.device.type == "cpu" and not thread_copy and scheduling.bubble_aware
    worker = ProtectWorker(
        gated=gated if ck.exchange.host_work == "auto" else ck.exchange.host_work == "bubbles"
    )
    location, peers = find_same_host_peers(
        transport, store.path, store.root, mesh.topology, enabled=ck.exchange.paths == "auto"
    )
    policy = ck.policy
    state = RunnerState(runner, transport, ck.elastic.num_replicas)
    link = generation.current()
    if link is not None and ck.elastic.num_replicas:  # a lost host may shrink it in-process
        link.elastic(ck.elastic.num_replicas, mesh.topology.world_size // mesh.topology.num_dp)
    ck = budget_stores(ck, transport, mesh, state, store)
    persister: Persister | None = None
    if persist and ck.persist.dir and (policy.persist_every or ck.persist.flush_on_sigterm):
        group = dist.new_group(backend="gloo")
        common: dict[str, Any] = dict(
            keep_latest=policy.keep_latest,
            process_group=group,
            release_group=destroy_group,
            rank=mesh.rank,
            timeout_s=ck.timeouts.collective_s * 10,
            # the DCP writer yields the core to training (waiters raise it: Persisting)
            on_thread_start=lower_thread_priority,
        )
        if ck.persist.writer == "process":  # periodic saves in a writer process
            persister = ProcessPersister(
                ck.persist.dir, prefix=agree_prefix(group), buffer_dir=store.path,
                idle=background_priority() != "normal", **common,
            )  # fmt: skip
        else:
            persister = Persister(ck.persist.dir, **common)
    parts = EngineParts(
        store=store,
        transport=transport,
        copier=copier,
        spill_copier=spill_copier,
        worker=worker,
        peers=peers,
        location=location,
        persister=persister,
        injector=make_injector(faults, ck, run_dir, mesh),
        termination=(
            Termination(max_grace_s=ck.timeouts.flush_s, absent=absent).install()
            if persister and ck.persist.flush_on_sigterm
            else None
        ),
        scheduling=scheduling,
        keys=agree_persist_keys(transport, mesh, [n for n, _ in state.named_tensors()]),
    )
    engine = CheckpointEngine(
        ck, run_dir, topology=mesh.topology, rank=mesh.rank, device=mesh.device,
        state=state, parts=parts,
    )  # fmt: skip
    runner.hooks = engine
    return engine
