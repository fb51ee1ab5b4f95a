"""Restore at start-up: inventory every store, agree on a plan, rebuild, load, resume.

Every process runs :func:`recover_and_start` right after the process group is up (a
fresh job finds empty stores and starts at iteration 0):

1. **Inventory.** The hosts of all ranks are gathered; every store directory of the job
   in a host's store root (the rank's own, and any left by an earlier rank numbering) is
   inventoried by one rank of that host (:class:`HostStores`, ``reader_of``). A shard is
   known by what it holds (the manifest's rank and ``(pp, dp, tp)``), not by who reads it.
2. **Agree.** Inventories are all-gathered on the checkpoint group and every rank runs
   the pure coordinator on the same inputs, so all reach the same :class:`RecoveryPlan`:
   shards read on the needing rank's host, moved from another host's memory, copied from
   a replica or decoded from parity. Only the bytes the plan reads are checksummed unless
   that finds a problem. A job that made progress never starts over silently.
3. **Rebuild.** Peer pieces (whole shards, replicas, parity inputs) move on the
   checkpoint group, in plan order, tags = position in the plan; decoding ranks rebuild
   their shard. Every byte is read through the store (``SnapshotStore.read``).
4. **Load.** DP replicas exchange shards point to point on the transport to rebuild the
   full flat state, which is written into the live parameters and optimizer state; the
   RNG state travels inside the flat state; the data position is the version itself.
   Then stores no current rank writes and no later restore needs are freed.
5. **Report.** Rank 0 appends the recovery (version, lost iterations, source of every
   shard and the store and host it came from, seconds per phase) to
   ``RUN_DIR/recoveries.jsonl``. After a hang the record also says who hung (``hang``)
   and splits ``detect`` (freeze to the first rank that noticed) from ``restart``, from
   the watchdog's ``hangs.jsonl``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from baft.engine.engine import CheckpointEngine
from baft.engine.peers import host_id
from baft.engine.persister import (
    check_persist_keys,
    list_versions,
    load_version,
    read_metadata,
    version_dir,
)
from baft.engine.transport import Handle, Transport
from baft.recover.coordinator import (
    Located,
    LocatedInventory,
    RecoveryPlan,
    StoreRef,
    coordinate_located,
    reader_of,
)
from baft.recover.differential import RestoreError
from baft.recover.identity import check_identity, layout_key, shard_records
from baft.recover.report import RecoveryReport, completed_iterations, report_hang
from baft.recover.startover import diff_meta, never_silently_fresh
from baft.store import reclaim
from baft.store.coding import Redundancy
from baft.store.manifest import RankInventory, checksum
from baft.store.paths import find_stores, job_path
from baft.store.shm import SnapshotStore, StoreReadError
from baft.topology import Topology

log = logging.getLogger("baft")


def recover_and_start(
    engine: CheckpointEngine, run_dir: Path, *, t_launch: float, t_rdzv: float
) -> tuple[int, RecoveryReport | None]:
    """Restore the newest recoverable version into ``engine``'s state and start it.

    Returns the iteration to resume from and the recovery's report (None on a fresh
    job). Collective: every rank calls it once, right after building its engine.
    """
    ck = engine.ck
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    injector = engine.injector
    t0 = time.time()
    persist_dir = ck.persist_dir
    persisted = (
        tuple(list_versions(persist_dir)) if persist_dir and Path(persist_dir).exists() else ()
    )
    stores = HostStores(engine.store, engine.location or host_id())
    plan, reason, located = _agree(
        stores, engine.transport, engine.topology, engine.redundancy, persisted
    )
    window = None
    if plan.source == "memory":
        plan, reason, window = _agree_window(
            stores, engine.transport, engine.topology, engine.redundancy, located, plan,
            reason, persisted,
        )  # fmt: skip
    t_inventory = time.time() - t0
    never_silently_fresh(
        plan, reason, located, run_dir, ck.allow_fresh_start, engine.rank,
        began_by=ck.profile_iters + ck.policy.every,
    )  # fmt: skip
    if plan.source == "fresh" and attempt == 0 and not located.holds_shards():
        engine.start(0)
        return 0, None
    report = RecoveryReport(run_dir, attempt)
    if plan.source in ("memory", "disk"):
        _check_saved_layout(engine)  # a changed model is refused before any byte is written
        _check_identity(engine, plan, located, window, persist_dir)
    if injector is not None:
        injector.fire("recovery", plan.version or 0)
    t1 = time.time()
    if window is not None:  # differential: every payload of the window, then replay
        payloads = {int(p.version or 0): _rebuild_payload(engine, stores, p) for p in window.plans}
        t_transfer = time.time() - t1
        t2 = time.time()
        done = _replay_window(engine, window, payloads)
        report.record["replay"] = done
    elif plan.source == "memory":
        shard = _rebuild_shard(stores, engine.transport, engine.rank, plan)
        t_transfer = time.time() - t1
        t2 = time.time()
        _load_from_shards(engine, plan, shard)
    elif plan.source == "disk":
        t_transfer = 0.0
        t2 = time.time()
        _load_from_disk(engine, plan, persist_dir)
        engine.store.clear_versions()
    else:  # starting over (see never_silently_fresh): no version of before is kept
        t_transfer = 0.0
        t2 = time.time()
        engine.store.clear_versions()
    t_load = time.time() - t2
    reclaimed = _reclaim(stores, engine.transport, engine.topology, plan, located)
    resume = plan.version or 0
    completed = completed_iterations(run_dir, engine.topology.world_size)
    fault_times = [r.time for r in injector.fired_records()] if injector is not None else []
    report.record.update(
        restored_version=plan.version,
        resume_iteration=resume,
        lost_iterations=max(0, completed - resume),
        source=plan.source,
        sources={str(r): s.kind for r, s in plan.shards.items()} if plan.source == "memory" else {},
        reason=reason,
    )
    if plan.source == "memory":
        report.record["origins"] = {str(r): o for r, o in plan.origins().items()}
        report.record["hosts"] = {str(r): h for r, h in located.hosts.items()}
    if reclaimed:
        report.record["reclaimed"] = reclaimed
    if fault_times:
        report.phase("detect_restart", t_launch - max(fault_times))
    report_hang(report, run_dir, attempt, t_launch)
    if t_rdzv > t_launch:
        report.phase("rendezvous", t_rdzv - t_launch)
    report.phase("inventory", t_inventory)
    report.phase("transfer_decode", t_transfer)
    report.phase("load", t_load)
    if engine.rank == 0:
        log.info("recovery: %s", reason)
    stores.drop_read_caches()
    engine.start(
        resume,
        restored_version=plan.version if plan.source == "memory" else None,
        first_version=window.first_version if window is not None else None,
        rotation_k=window.k if window is not None else None,
    )
    report.first_iteration_started()
    return resume, report


def _check_saved_layout(engine: CheckpointEngine) -> None:
    """Raise ValueError naming the tensors that differ unless this rank's state has the
    layout (names, sizes) saved with the run's plan input (every rank's, at plan time)."""
    from baft.store.records import PlanInput

    saved = PlanInput.load(engine.run_dir)
    tensors = saved.saved_tensors(engine.rank) if saved is not None else None
    if tensors is not None:
        engine.state.check_layout(tensors)


def _check_identity(
    engine: CheckpointEngine,
    plan: RecoveryPlan,
    located: Located,
    window: Window | None,
    persist_dir: str | None,
) -> None:
    """Raise ShardIdentityError unless the shards (or the DCP checkpoint) ``plan``
    restores were saved from this rank's tensors (layout digest of its ``(pp, tp)``:
    names, shapes, placements, offsets); before any byte is written."""
    c = engine.topology.coords(engine.rank)
    key = layout_key(c.pp, c.tp)
    mine = getattr(engine.state, "layout_digests", {}).get(key)
    if not mine or plan.version is None:
        return
    if plan.source == "disk":
        assert persist_dir is not None
        where = f"DCP checkpoint v{plan.version} in {persist_dir}"
        records = [(where, read_metadata(persist_dir, plan.version).get("layouts"))]
    else:
        versions = [p.version for p in window.plans] if window is not None else [plan.version]
        records = shard_records(located.stores, [v for v in versions if v is not None])
    check_identity(records, key, mine)


@dataclasses.dataclass(frozen=True)
class Window:
    """A differential restore: the payload versions of one rotation window and how to
    obtain each (one RecoveryPlan per version, all from memory)."""

    k: int
    first_version: int
    plans: tuple[RecoveryPlan, ...]


def _only(located: Located, version: int) -> list[LocatedInventory]:
    return [
        dataclasses.replace(
            loc,
            inventory=dataclasses.replace(
                loc.inventory,
                versions=tuple(x for x in loc.inventory.versions if x.version == version),
            ),
        )
        for loc in located.stores
    ]


def _window_plans(
    topology: Topology, redundancy: Redundancy, located: Located, newest: int
) -> tuple[Window | None, list[str]]:
    """The newest version ``<= newest`` whose whole rotation window every rank can
    rebuild, with a plan per payload; or None and why each candidate failed."""
    from baft.recover.differential import window_of

    meta = diff_meta(located)
    why: list[str] = []
    for v in sorted((u for u in meta if u <= newest), reverse=True):
        k, first = int(meta[v]["k"]), int(meta[v]["first_version"])
        win = window_of(v, k, first)
        if win is None:
            why.append(f"v={v}: rotation from v{first} not a whole window of {k} old")
            continue
        plans = []
        for u in win:
            if (meta.get(u) or {}).get("k") != k or (meta.get(u) or {}).get(
                "first_version"
            ) != first:
                why.append(
                    f"v={v}: payload v{u} is not of the same rotation "
                    f"(k={(meta.get(u) or {}).get('k')}, first_version="
                    f"{(meta.get(u) or {}).get('first_version')}; v{v}: k={k}, first_version={first})"
                )
                break
            p, reason = coordinate_located(topology, redundancy, _only(located, u), located.hosts)
            if p.source != "memory" or p.version != u:
                why.append(f"v={v}: payload v{u} cannot be rebuilt ({reason})")
                break
            plans.append(p)
        else:
            return Window(k, first, tuple(plans)), why
    return None, why


def _agree_window(
    stores: HostStores,
    transport: Transport,
    topology: Topology,
    redundancy: Redundancy,
    located: Located,
    plan: RecoveryPlan,
    reason: str,
    persisted: tuple[int, ...],
) -> tuple[RecoveryPlan, str, Window | None]:
    """For differential payloads: the newest version whose whole window is rebuildable
    (verifying the bytes each payload's plan reads; a problem anywhere re-inventories
    with every checksum, as ``_agree`` does), else DCP or a fresh start. Versions of full
    snapshots pass through unchanged (window None). Collective."""
    if plan.version is None or not diff_meta(located):
        return plan, reason, None
    me = transport.rank
    window, why = _window_plans(topology, redundancy, located, plan.version)
    if window is not None:
        problems = [m for p in window.plans for m in _verify_reads(stores, me, p)]
        if any(transport.all_gather_object(problems)):
            mine = [ref for ref in stores.refs() if reader_of(ref, located.hosts) == me]
            full = stores.inventories(mine, verify=True)
            located = Located(located.hosts, _gathered(transport.all_gather_object(full)))
            window, why = _window_plans(topology, redundancy, located, plan.version)
    if window is not None:
        v = window.plans[-1]
        bases = f"payloads v{window.plans[0].version}..v{v.version} (full_every={window.k})"
        return v, f"v={v.version} from memory, differential: {bases}", window
    detail = "; ".join(why) or "no differential payloads"
    if persisted:
        version = max(persisted)
        return (
            RecoveryPlan(version=version, source="disk"),
            (
                f"v={version} from disk (newest persisted): no rotation window rebuildable "
                f"from memory ({detail})"
            ),
            None,
        )
    return (
        RecoveryPlan(version=None, source="fresh"),
        (f"fresh start: no rotation window rebuildable from memory ({detail})"),
        None,
    )


def _rebuild_payload(
    engine: CheckpointEngine, stores: HostStores, plan: RecoveryPlan
) -> torch.Tensor:
    """The whole stage's payload of ``plan.version``: this rank's shard (local, replica or
    decoded) and the DP replicas' shares, assembled. Collective."""
    shard = _rebuild_shard(stores, engine.transport, engine.rank, plan)
    total = sum(plan.shard_nbytes[r] for r in engine.topology.replicas(engine.rank))
    out = torch.empty(total, dtype=torch.uint8)

    def write(pos: int, piece: torch.Tensor) -> None:
        out[pos : pos + piece.numel()].copy_(piece)

    _exchange_replicas(engine.transport, engine.topology, engine.rank, plan, shard, write)
    return out


def _replay_window(
    engine: CheckpointEngine, window: Window, payloads: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """Newest slices + replayed records into the live state, then the small state."""
    from baft.plan.payload import PayloadLayout
    from baft.recover.differential import DeferredState, rebuild_from_payloads

    layout = PayloadLayout.of(engine.flat.specs(), window.k)
    v = window.plans[-1].version
    assert v is not None
    t0 = time.time()
    state = engine.state
    done = rebuild_from_payloads(
        layout, payloads, v, window.first_version, dict(state.named_tensors()),
        state.optimizer, state.named_params(),
        deferred=state if isinstance(state, DeferredState) else None,
    )  # fmt: skip
    engine.apply_rng()
    done["seconds"] = round(time.time() - t0, 6)
    return done


def _reclaim(
    stores: HostStores,
    transport: Transport,
    topology: Topology,
    plan: RecoveryPlan,
    located: Located,
) -> list[str]:
    """Free the memory of this job's stores on this host that no current rank writes and
    no later restore needs, once every rank is done reading: after a restore from memory,
    the ones holding no copy of the restored version (a store holding it keeps only that
    version, until the job's own stores commit a newer one and ``reclaim_foreign`` frees
    it); after DCP or a fresh start, all of them. The own store of a current rank is left
    to its engine. Stores of other jobs on this host that no live process holds and that
    were idle long enough go too (``reclaim.reclaim_other_jobs``). Collective (one
    small gather as a barrier); the host's lowest rank removes."""
    transport.all_gather_object(None)  # every rank has read what it needs
    host = stores.host
    here = [r for r, h in located.hosts.items() if h == host]
    if not stores.scan or min(here) != transport.rank:
        return []
    own = {(topology.node_of(r), r) for r in here}
    keep_version = plan.version if plan.source == "memory" else None
    removed = []
    for ref in stores.refs():
        if (ref.node, ref.rank) in own:
            continue  # a current rank's own store on this host
        if stores.get(ref).reclaim_unless_holding(keep_version):
            removed.append(str(ref))
    old_jobs = reclaim.reclaim_other_jobs(stores.own.root, stores.own.job_id)
    removed += [f"{host}:{p.name}" for p in old_jobs]
    if removed:
        log.info("reclaimed %d store(s) no rank needs any more: %s", len(removed), removed)
    return removed


class HostStores:
    """The stores of one job this process may read: its own, and with a ``host`` every
    other rank directory of the job in this host's store root (shards left by an earlier
    rank numbering, or by ranks now on this host). Without a host only the own store
    counts (each rank its own failure domain, as tests that share one root play it)."""

    def __init__(self, own: SnapshotStore, host: str | None = None) -> None:
        self.own = own
        self.host = host if host is not None else f"rank{own.rank}"
        self.scan = host is not None
        self._open: dict[tuple[int, int], SnapshotStore] = {}

    def refs(self) -> list[StoreRef]:
        """Every store directory of the job on this host (the own one if it exists)."""
        if not self.scan:
            return [self._ref(self.own.node, self.own.rank)] if self.own.path.exists() else []
        job = job_path(self.own.root, self.own.job_id)
        return [self._ref(a.node, a.rank) for a in find_stores(job) if a.job_id == self.own.job_id]

    def _ref(self, node: int, rank: int) -> StoreRef:
        return StoreRef(self.host, node, rank)

    def get(self, ref: StoreRef | None) -> SnapshotStore:
        """The store ``ref`` names (None: the own store)."""
        if ref is None or (ref.node, ref.rank) == (self.own.node, self.own.rank):
            return self.own
        if ref.host != self.host:
            raise RestoreError(f"rank {self.own.rank} on {self.host} cannot read store {ref}")
        key = (ref.node, ref.rank)
        if key not in self._open:
            self._open[key] = SnapshotStore(self.own.root, self.own.job_id, ref.node, ref.rank, 0)
        return self._open[key]

    def inventories(
        self, refs: list[StoreRef], verify: bool
    ) -> list[tuple[StoreRef, RankInventory]]:
        return [(ref, self.get(ref).inventory(verify=verify)) for ref in refs]

    def drop_read_caches(self) -> None:
        self.own.drop_read_cache()
        for s in self._open.values():
            s.close()
        self._open.clear()


def _agree(
    stores: SnapshotStore | HostStores,
    transport: Transport,
    topology: Topology,
    redundancy: Redundancy,
    persisted: tuple[int, ...],
) -> tuple[RecoveryPlan, str, Located]:
    """Agree on a RecoveryPlan, checksumming only the bytes the plan will read.

    The hosts of all ranks are gathered first; each store on a host is then inventoried by
    one rank (``reader_of``: its own rank if that runs there, else the host's lowest).
    Round 1 trusts every complete manifest, plans, and each rank verifies just what the
    plan reads from the stores it reads (a local shard, the ranges and regions it sends).
    If all of that is clean the plan stands; otherwise round 2 verifies everything and
    plans again. A rank crash thus checks one shard per rank instead of both slots of
    data and redundancy (4x fewer bytes), and a bad byte still never gets through.
    Collective over ``transport``.
    """
    host_stores = stores if isinstance(stores, HostStores) else HostStores(stores)
    me = transport.rank
    hosts = dict(enumerate(transport.all_gather_object(host_stores.host)))
    mine = [ref for ref in host_stores.refs() if reader_of(ref, hosts) == me]
    light = [(ref, _claim(inv)) for ref, inv in host_stores.inventories(mine, verify=False)]
    located = Located(hosts, _gathered(transport.all_gather_object(light)))
    plan, reason = coordinate_located(topology, redundancy, located.stores, hosts, persisted)
    problems = _verify_reads(host_stores, me, plan) if plan.source == "memory" else []
    if not any(transport.all_gather_object(problems)):
        return plan, reason, located
    full = host_stores.inventories(mine, verify=True)
    located = Located(hosts, _gathered(transport.all_gather_object(full)))
    plan, reason = coordinate_located(topology, redundancy, located.stores, hosts, persisted)
    return plan, reason, located


def _gathered(per_rank: list[Any]) -> list[LocatedInventory]:
    return [LocatedInventory(ref, inv) for part in per_rank for ref, inv in part]


def _claim(inv: RankInventory) -> RankInventory:
    """An unverified inventory whose complete versions are taken at their word."""
    versions = tuple(
        dataclasses.replace(v, verified=True, data_ok=True, bad_regions=())
        if v.state == "complete" and v.manifest is not None
        else v
        for v in inv.versions
    )
    return dataclasses.replace(inv, versions=versions)


def _verify_reads(stores: HostStores, rank: int, plan: RecoveryPlan) -> list[str]:
    """Checksum the store bytes this rank reads for ``plan``; returns the problems."""
    data_slots: set[tuple[StoreRef | None, int]] = set()
    region_ids: dict[tuple[StoreRef | None, int], set[int]] = {}
    src = plan.shards.get(rank)
    if src is not None and src.kind == "local" and src.slot is not None:
        data_slots.add((src.store, src.slot))
    for t in plan.transfers:
        if t.src_rank == rank and t.kind == "shard":
            data_slots.add((t.src_store, t.src_slot))
        elif t.src_rank == rank:
            region_ids.setdefault((t.src_store, t.src_slot), set()).add(t.region_id)
    problems: list[str] = []
    for ref, slot in sorted(data_slots | set(region_ids), key=lambda k: (str(k[0]), k[1])):
        store = stores.get(ref)
        where = f"rank {rank} store {ref or store.path.name} slot {slot}"
        m = store.read_manifest(slot)
        if m is None or m.version != plan.version:
            problems.append(f"{where}: v{plan.version} is not there")
            continue
        try:
            if (ref, slot) in data_slots:
                data = store.read(slot, "data", 0, m.data_nbytes)
                problems += [
                    f"{where} v{m.version} chunk {c.chunk_id}: checksum mismatch"
                    for c in m.chunks
                    if checksum(data[c.offset : c.offset + c.nbytes]) != c.xxh3
                ]
            wanted = region_ids.get((ref, slot), set())
            if wanted:
                red = store.read(slot, "red", 0, m.red_nbytes)
                problems += [
                    f"{where} v{m.version} region {r.region_id}: checksum mismatch"
                    for r in m.regions
                    if r.region_id in wanted
                    and checksum(red[r.offset : r.offset + r.nbytes]) != r.xxh3
                ]
        except StoreReadError as err:
            problems.append(f"{where} v{m.version}: {err}")
    return problems


def _read(store: SnapshotStore, slot: int, kind: str, offset: int, nbytes: int) -> np.ndarray:
    try:
        return store.read(slot, kind, offset, nbytes)
    except StoreReadError as err:
        raise RestoreError(str(err)) from err


def _rebuild_shard(
    stores: SnapshotStore | HostStores, transport: Transport, rank: int, plan: RecoveryPlan
) -> np.ndarray:
    """This rank's shard of ``plan.version``: local read, or peer pieces (+ decode).

    Collective over ``transport`` (tags = position in ``plan.transfers``). A peer that dies
    mid-transfer makes the wait raise (the transport's timeout or its failure signal),
    re-raised as a :class:`RestoreError` naming the transfer."""
    host_stores = stores if isinstance(stores, HostStores) else HostStores(stores)
    handles = []
    received: dict[int, np.ndarray] = {}
    for tag, t in enumerate(plan.transfers):
        if t.src_rank == rank:
            kind = "data" if t.kind == "shard" else "red"
            src = _read(host_stores.get(t.src_store), t.src_slot, kind, t.offset, t.nbytes)
            if t.dst_rank == rank:  # a store on this rank's own host: no message
                received[tag] = src
                continue
            buf = torch.from_numpy(src)
            handles.append((transport.isend(buf, t.dst_rank, tag), t))
        elif t.dst_rank == rank:
            rbuf = torch.empty(t.nbytes, dtype=torch.uint8)
            handles.append((transport.irecv(rbuf, t.src_rank, tag), t))
            received[tag] = rbuf.numpy()
    for h, t in handles:
        try:
            h.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with the transfer named
            raise RestoreError(
                f"rank {rank}: {t.kind} transfer of v{plan.version} rank {t.src_rank} -> "
                f"rank {t.dst_rank} ({t.nbytes} B) failed: {e}"
            ) from e
    source = plan.shards[rank]
    n = plan.shard_nbytes[rank]
    if source.kind == "local":
        assert source.slot is not None
        return _read(host_stores.get(source.store), source.slot, "data", 0, n)
    if source.kind == "remote":  # the whole shard, moved from another host's memory
        if n == 0:
            return np.zeros(0, np.uint8)
        (tag,) = [i for i, t in enumerate(plan.transfers) if t.dst_rank == rank]
        return received[tag]
    if source.kind == "replica":  # a peer's replica region holds the whole shard
        (rid,) = source.region_ids[:1]
        tag = next(
            tag
            for tag, t in enumerate(plan.transfers)
            if t.dst_rank == rank and t.kind == "region" and t.region_id == rid
        )
        if received[tag].size < n:
            raise RestoreError(
                f"rank {rank}: replica region {rid} of v{plan.version} holds "
                f"{received[tag].size} bytes, shard has {n}"
            )
        return received[tag][:n]
    decode = next((d for d in plan.decodes if d.rank == rank), None)
    if decode is None:
        raise RestoreError(f"rank {rank}: no local shard of v{plan.version} and no decode planned")
    shards: dict[int, np.ndarray] = {}
    regions: dict[int, np.ndarray] = {}
    for tag, t in enumerate(plan.transfers):
        if t.dst_rank != rank:
            continue
        if t.kind == "shard":
            owner = t.src_store.rank if t.src_store is not None else t.src_rank
            full = shards.setdefault(owner, np.zeros(plan.shard_nbytes[owner], np.uint8))
            full[t.offset : t.offset + t.nbytes] = received[tag]
        else:
            region = decode.layout.region(t.region_id)
            part = regions.setdefault(t.region_id, np.zeros(region.nbytes, np.uint8))
            start = t.offset - region.offset
            part[start : start + t.nbytes] = received[tag]
    try:
        return decode.layout.rebuild(rank, shards, regions, recipe=decode.recipe)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise RestoreError(f"rank {rank}: cannot rebuild shard of v{plan.version}: {e}") from e


def _exchange_replicas(
    transport: Transport,
    topology: Topology,
    rank: int,
    plan: RecoveryPlan,
    shard: np.ndarray,
    write: Callable[[int, torch.Tensor], None],
) -> int:
    """Hand every DP replica's shard to the others, point to point on ``transport``, and
    ``write(position, bytes)`` each (own one included) at its place in the full flat state;
    returns the bytes written. Owned ranges are contiguous in dp order. Tags follow the
    plan's transfers, so they never meet a piece of the rebuild."""
    replicas = topology.replicas(rank)
    base = len(plan.transfers)
    mine = torch.from_numpy(shard)
    sends = [
        (transport.isend(mine, peer, base + replicas.index(rank)), peer)
        for peer in replicas
        if peer != rank
    ]
    pos = 0
    for i, r in enumerate(replicas):
        n = plan.shard_nbytes[r]
        if r == rank:
            piece = mine
        else:
            piece = torch.empty(n, dtype=torch.uint8)
            _wait(transport.irecv(piece, r, base + i), rank, f"shard of rank {r}", plan)
        write(pos, piece)
        pos += n
    for h, peer in sends:
        _wait(h, rank, f"shard to rank {peer}", plan)
    return pos


def _wait(handle: Handle, rank: int, what: str, plan: RecoveryPlan) -> None:
    try:
        handle.wait()
    except Exception as e:  # noqa: BLE001 - re-raised with the message named
        raise RestoreError(
            f"rank {rank}: DP exchange ({what}) of v{plan.version} failed: {e}"
        ) from e


def _load_from_shards(engine: CheckpointEngine, plan: RecoveryPlan, shard: np.ndarray) -> None:
    """Assemble the full flat state from the DP replicas' shards and load it."""
    replicas = engine.topology.replicas(engine.rank)
    total = sum(plan.shard_nbytes[r] for r in replicas)
    if total != engine.flat.nbytes:
        raise RestoreError(
            f"rank {engine.rank}: shards of v{plan.version} cover {total} bytes, "
            f"state has {engine.flat.nbytes}"
        )
    with torch.no_grad():  # straight into the live tensors
        _exchange_replicas(
            engine.transport, engine.topology, engine.rank, plan, shard, engine.flat.write_from
        )
    engine.apply_rng()


def _evict_page_cache(path: Path) -> None:
    """Drop a checkpoint's clean pages from the page cache (benchmarks: a cold read)."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _load_from_disk(engine: CheckpointEngine, plan: RecoveryPlan, directory: str) -> None:
    assert plan.version is not None
    where = version_dir(directory, plan.version)
    check_persist_keys(read_metadata(directory, plan.version), engine.persist_keys, str(where))
    if os.environ.get("BAFT_COLD_DISK_RESTORE") == "1":
        _evict_page_cache(where)
    key = engine.persist_keys
    state = {key(n): t for n, t in zip(engine.flat.names, engine.flat.tensors, strict=True)}
    group = getattr(engine.transport, "group", None)
    with torch.no_grad():
        load_version(
            directory, plan.version, state, process_group=group, layouts=engine.persist_layouts
        )
    engine.apply_rng()
