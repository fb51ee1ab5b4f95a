"""Restore at start-up: inventory every store, agree on a plan, rebuild, load, resume.

Every process runs :func:`recover_and_start` right after the process group is up (a
fresh job finds empty stores and starts at iteration 0). It runs against a
:class:`~baft.recover.restorable.Restorable` (what recovery needs of one rank's engine),
in phases:

1. **Inventory and agree** (:mod:`baft.recover.inventory`, :mod:`baft.recover.window`).
   Every store of the job on each host is inventoried by one rank of it; inventories are
   all-gathered and every rank runs the pure coordinator on the same inputs, so all
   reach the same :class:`RecoveryPlan`: shards read on the needing rank's host, moved
   from another host's memory, copied from a replica or decoded from parity; for
   differential payloads, a whole rotation window. Only the bytes the plan reads are
   checksummed unless that finds a problem. A job that made progress never starts over
   silently (:mod:`baft.recover.startover`).
2. **Check.** A changed model is refused before any byte is written: the layout saved
   with the plan input, and the layout digest recorded with every shard or checkpoint.
3. **Rebuild and load** (:mod:`baft.recover.transfer`, :mod:`baft.recover.load`). Peer
   pieces move on the checkpoint group in plan order and decoding ranks rebuild their
   shard; DP replicas exchange shards to rebuild the full flat state, which is written
   into the live tensors, and the small state is applied. From disk: the DCP checkpoint.
4. **Reclaim.** Stores no current rank writes and no later restore needs are freed.
5. **Report.** Rank 0 appends the recovery (version, lost iterations, source of every
   shard and the store and host it came from, seconds per phase) to
   ``RUN_DIR/recoveries.jsonl``. After a hang the record also says who hung (``hang``)
   and splits ``detect`` (freeze to the first rank that noticed) from ``restart``, from
   the watchdog's ``hangs.jsonl``.
6. **Start** the engine at the restored version.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from baft.liveness.generation import describe as describe_generation
from baft.liveness.generation import recovery_phases
from baft.liveness.watchdog import attempt_key
from baft.recover.coordinator import Located, RecoveryPlan
from baft.recover.identity import check_identity, layout_key, shard_records
from baft.recover.inventory import HostStores, agree, reclaim_stores, sizes
from baft.recover.load import (
    load_from_disk,
    load_from_shards,
    load_resized,
    load_window,
    rebuild_payload,
)
from baft.recover.report import RecoveryReport, completed_iterations, report_hang
from baft.recover.reshard import layout_change
from baft.recover.restorable import Restorable
from baft.recover.startover import never_silently_fresh
from baft.recover.transfer import rebuild_shard
from baft.recover.window import Window, agree_window
from baft.store.disk import list_versions, read_metadata
from baft.store.paths import host_id
from baft.store.records import PlanInput

log = logging.getLogger("baft")


@dataclass
class Agreement:
    """What every rank agreed to restore, and where its inputs are."""

    stores: HostStores
    plan: RecoveryPlan
    reason: str
    located: Located
    window: Window | None
    """The rotation window of a differential restore (None: a full snapshot, or none)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per phase so far (inventory, transfer_decode, load)."""


def recover_and_start(
    engine: Restorable, run_dir: Path, *, t_launch: float, t_rdzv: float
) -> tuple[int, RecoveryReport | None]:
    """Restore the newest recoverable version into ``engine``'s state and start it.

    Returns the iteration to resume from and the recovery's report (None on a fresh
    job). Collective: every rank calls it once, right after building its engine.
    """
    attempt, generation = attempt_key()
    agreed = _inventory_and_agree(engine)
    plan = agreed.plan
    never_silently_fresh(
        plan, agreed.reason, agreed.located, run_dir, engine.allow_fresh_start, engine.rank,
        began_by=engine.first_checkpoint_by,
    )  # fmt: skip
    if (
        plan.source == "fresh"
        and (attempt, generation) == (0, 0)
        and not agreed.located.holds_shards()
    ):
        engine.start(0)
        return 0, None
    report = RecoveryReport(run_dir, attempt)
    reshard = _layout_change(engine, plan)
    if reshard is not None:  # checked key by key against the checkpoint's metadata instead
        agreed.reason += f"; {reshard}"
        report.record["resharded"] = reshard
    elif plan.source in ("memory", "disk"):
        _check_saved_layout(engine)  # a changed model is refused before any byte is written
        _check_identity(engine, agreed)
    if engine.injector is not None:
        engine.injector.fire("recovery", plan.version or 0)
    _rebuild_and_load(engine, agreed, report, resharded=reshard is not None)
    resize = agreed.located.resize
    reclaimed = reclaim_stores(
        agreed.stores, engine.transport, engine.topology,
        plan if resize is None else RecoveryPlan(version=None, source="disk"),
        agreed.located if resize is None else Located(dict(resize.physical_hosts), []),
    )  # fmt: skip
    if resize is not None:  # after the reclaim's barrier: every rank has read its shards
        engine.forget_versions()  # the old job's versions cannot mix with this job's
    resume = plan.version or 0
    _fill_report(report, engine, agreed, reclaimed, run_dir, t_launch=t_launch, t_rdzv=t_rdzv)
    if engine.rank == 0:
        log.info("recovery: %s", agreed.reason)
    agreed.stores.drop_read_caches()
    window = agreed.window
    t_start = time.time()
    resumed = plan.source == "memory" and resize is None  # its versions stay committed
    engine.start(
        resume,
        restored_version=plan.version if resumed else None,
        first_version=window.first_version if window is not None and resumed else None,
        rotation_k=window.k if window is not None and resumed else None,
    )
    report.phase("engine_start", time.time() - t_start)
    report.first_iteration_started()
    return resume, report


def _persisted(persist_dir: str | None) -> tuple[int, ...]:
    """Complete DCP versions of the disk tier, ascending (none without one)."""
    if not persist_dir or not Path(persist_dir).exists():
        return ()
    return tuple(list_versions(persist_dir))


def _inventory_and_agree(engine: Restorable) -> Agreement:
    """Phase 1: every rank's inventory, one plan (and window) for all. Collective."""
    t0 = time.time()
    persisted = _persisted(engine.persist_dir)
    stores = HostStores(engine.store, engine.location or host_id())
    args = (engine.transport, engine.topology, engine.redundancy)
    elastic = int(getattr(engine, "elastic_replicas", 0))
    plan, reason, located = agree(stores, *args, persisted, elastic=elastic)
    window = None
    if plan.source == "memory":  # after a resize, planned for the old job's ranks
        topo, red = sizes(located, engine.topology, engine.redundancy)
        plan, reason, window = agree_window(
            stores, engine.transport, topo, red, located, plan, reason, persisted
        )
        if window is not None and located.resize is not None:
            reason += f" ({located.resize.describe(engine.topology)})"
    agreed = Agreement(stores, plan, reason, located, window)
    agreed.seconds["inventory"] = time.time() - t0
    return agreed


def _check_saved_layout(engine: Restorable) -> None:
    """Raise ValueError naming the tensors that differ unless this rank's state has the
    layout (names, sizes) saved with the run's plan input (every rank's, at plan time)."""
    saved = PlanInput.load_for(engine.run_dir, engine.topology.world_size)
    tensors = saved.saved_tensors(engine.rank) if saved is not None else None
    if tensors is not None:
        engine.state.check_layout(tensors)


def _check_identity(engine: Restorable, agreed: Agreement) -> None:
    """Raise ShardIdentityError unless the shards (or the DCP checkpoint) the plan
    restores were saved from this rank's tensors (layout digest of its ``(pp, tp)``:
    names, shapes, placements, offsets); before any byte is written."""
    plan, window = agreed.plan, agreed.window
    c = engine.topology.coords(engine.rank)
    key = layout_key(c.pp, c.tp)
    mine = engine.layout_digests.get(key)
    if not mine or plan.version is None:
        return
    if plan.source == "disk":
        persist_dir = engine.persist_dir
        assert persist_dir is not None
        where = f"DCP checkpoint v{plan.version} in {persist_dir}"
        records = [(where, read_metadata(persist_dir, plan.version).get("layouts"))]
    else:
        versions = [p.version for p in window.plans] if window is not None else [plan.version]
        records = shard_records(agreed.located.stores, [v for v in versions if v is not None])
    check_identity(records, key, mine)


def _layout_change(engine: Restorable, plan: RecoveryPlan) -> str | None:
    """Why a restore from disk goes into another shard layout (None: the same one, or
    not from disk); see :func:`baft.recover.reshard.layout_change`."""
    if plan.source != "disk" or plan.version is None or engine.persist_dir is None:
        return None
    saved = read_metadata(engine.persist_dir, plan.version).get("layouts")
    return layout_change(saved, engine.layout_digests)


def _rebuild_and_load(
    engine: Restorable, agreed: Agreement, report: RecoveryReport, *, resharded: bool = False
) -> None:
    """Phase 3: the agreed version into the live state (or, starting over, nothing);
    the own store forgets its versions unless the restore came from memory."""
    plan, window = agreed.plan, agreed.window
    t1 = time.time()
    t_transfer = 0.0
    resize = agreed.located.resize
    if window is not None:  # differential: every payload of the window, then replay
        stores = agreed.stores
        payloads = {
            int(p.version or 0): rebuild_payload(engine, stores, p, resize) for p in window.plans
        }
        t_transfer = time.time() - t1
        try:
            report.record["replay"] = load_window(engine, window, payloads)
        finally:  # the replay may write into its records (read mappings' private pages)
            stores.drop_read_caches()  # so a later read maps the store afresh
    elif plan.source == "memory" and resize is not None:
        load_resized(engine, agreed.stores, resize, plan)
    elif plan.source == "memory":
        shard = rebuild_shard(agreed.stores, engine.transport, engine.rank, plan)
        t_transfer = time.time() - t1
        load_from_shards(engine, plan, shard)
    elif plan.source == "disk":
        assert engine.persist_dir is not None
        load_from_disk(engine, plan, engine.persist_dir, resharded=resharded)
        engine.forget_versions()
    else:  # starting over (see never_silently_fresh): no version of before is kept
        engine.forget_versions()
    agreed.seconds["transfer_decode"] = t_transfer
    agreed.seconds["load"] = time.time() - t1 - t_transfer


def _fill_report(
    report: RecoveryReport,
    engine: Restorable,
    agreed: Agreement,
    reclaimed: list[str],
    run_dir: Path,
    *,
    t_launch: float,
    t_rdzv: float,
) -> None:
    """Phase 5: what was restored, from where, what it cost and what it lost."""
    plan, located = agreed.plan, agreed.located
    resume = plan.version or 0
    completed = completed_iterations(run_dir, engine.topology.world_size)
    injector = engine.injector
    fault_times = [r.time for r in injector.fired_records()] if injector is not None else []
    memory = plan.source == "memory"
    report.record.update(
        restored_version=plan.version,
        resume_iteration=resume,
        lost_iterations=max(0, completed - resume),
        source=plan.source,
        sources={str(r): s.kind for r, s in plan.shards.items()} if memory else {},
        reason=agreed.reason,
    )
    if memory:
        report.record["origins"] = {str(r): o for r, o in plan.origins().items()}
        report.record["hosts"] = {str(r): h for r, h in located.hosts.items()}
    if reclaimed:
        report.record["reclaimed"] = reclaimed
    inprocess = recovery_phases(max(fault_times) if fault_times else None, t_launch)
    if inprocess:  # the survivors re-entered in-process, the failed rank was replaced
        report.record["inprocess"] = describe_generation()
        for name, seconds in inprocess.items():
            report.phase(name, seconds)
    elif fault_times:
        report.phase("detect_restart", t_launch - max(fault_times))
    report_hang(report, run_dir, attempt_key(), t_launch)
    if t_rdzv > t_launch:
        report.phase("rendezvous", t_rdzv - t_launch)
    for name in ("inventory", "transfer_decode", "load"):
        report.phase(name, agreed.seconds[name])
