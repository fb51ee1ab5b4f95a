"""Inventory and agreement: which stores of the job this host holds, and one plan for all.

- :class:`HostStores`: every store directory of the job in this host's store root (the
  rank's own, and any left by an earlier rank numbering), each inventoried by one rank of
  the host (``reader_of``). A shard is known by what it holds (the manifest's rank and
  ``(pp, dp, tp)``), not by who reads it.
- :func:`agree`: inventories are all-gathered on the checkpoint group and every rank runs
  the pure coordinator on the same inputs, so all reach the same :class:`RecoveryPlan`.
  Only the bytes the plan reads are checksummed (:func:`verify_reads`) unless that finds
  a problem; then every checksum is recomputed and the plan made again.
- :func:`reclaim_stores`: after the restore, stores no current rank writes and no later restore
  needs are freed.

Collectives run on the transport seam only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from baft.engine.transport import Transport
from baft.recover.coordinator import (
    Located,
    LocatedInventory,
    RecoveryPlan,
    StoreRef,
    coordinate_located,
    reader_of,
)
from baft.recover.differential import RestoreError
from baft.store import reclaim as reclaim_jobs
from baft.store.coding import Redundancy
from baft.store.manifest import RankInventory, mismatches
from baft.store.paths import job_stores
from baft.store.shm import SnapshotStore, StoreReadError
from baft.topology import Topology

log = logging.getLogger("baft")


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
        self.verified: set[tuple[str, int, int, int | None]] = set()
        """Reads :func:`verify_reads` found clean in this restore, by (store, slot,
        version, region id; None: the shard): a window that reads them again (its
        newest payload is the version agreed first) does not hash them twice. Nothing
        writes a store while a restore reads it."""

    def refs(self) -> list[StoreRef]:
        """Every store directory of the job on this host (the own one if it exists)."""
        if not self.scan:
            return [self._ref(self.own.node, self.own.rank)] if self.own.path.exists() else []
        return [self._ref(a.node, a.rank) for a in job_stores(self.own.root, self.own.job_id)]

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


def as_host_stores(stores: SnapshotStore | HostStores) -> HostStores:
    """``stores`` as :class:`HostStores` (a bare store: its own failure domain)."""
    return stores if isinstance(stores, HostStores) else HostStores(stores)


def agree(
    stores: SnapshotStore | HostStores,
    transport: Transport,
    topology: Topology,
    redundancy: Redundancy,
    persisted: tuple[int, ...],
    *,
    elastic: int = 0,
) -> tuple[RecoveryPlan, str, Located]:
    """Agree on a RecoveryPlan, checksumming only the bytes the plan will read.

    The hosts of all ranks are gathered first; each store on a host is then inventoried by
    one rank (``reader_of``: its own rank if that runs there, else the host's lowest).
    Round 1 trusts every complete manifest, plans, and each rank verifies just what the
    plan reads from the stores it reads (a local shard, the ranges and regions it sends).
    If all of that is clean the plan stands; otherwise round 2 verifies everything and
    plans again. A rank crash thus checks one shard per rank instead of both slots of
    data and redundancy (4x fewer bytes), and a bad byte still never gets through.
    ``elastic``: the job's virtual replicas (0: none); with them, memory written under
    another DP degree is restored too (``located.resize``, :mod:`baft.recover.resize`).
    Collective over ``transport``.
    """
    host_stores = as_host_stores(stores)
    me = transport.rank
    hosts = dict(enumerate(transport.all_gather_object(host_stores.host)))
    mine = [ref for ref in host_stores.refs() if reader_of(ref, hosts) == me]
    light = [(ref, claim(inv)) for ref, inv in host_stores.inventories(mine, verify=False)]
    located = Located(hosts, gathered(transport.all_gather_object(light)))
    for verify in (False, True):
        if verify:
            located = reinventory(host_stores, transport, Located(hosts, located.stores))
        if elastic:
            located = resized(located, topology, elastic, me)
        topo, red = sizes(located, topology, redundancy)
        plan, reason = coordinate_located(topo, red, located.stores, located.hosts, persisted)
        if located.resize is not None and plan.source == "memory":
            reason += f" ({located.resize.describe(topology)})"
        if verify or plan.source != "memory":
            break
        problems = [p for r in playing(located, me) for p in verify_reads(host_stores, r, plan)]
        if not any(transport.all_gather_object(problems)):
            break
    return plan, reason, located


def playing(located: Located, rank: int) -> list[int]:
    """The ranks of the plans that current rank ``rank`` acts for: itself, or after a
    resize the logical ranks it plays."""
    return located.resize.played_by(rank) if located.resize is not None else [rank]


def sizes(
    located: Located, topology: Topology, redundancy: Redundancy
) -> tuple[Topology, Redundancy]:
    """The topology and redundancy the coordinator plans under: the job's, or after a
    resize the old job's."""
    if located.resize is not None:
        return located.resize.old, located.resize.redundancy
    return topology, redundancy


def resized(located: Located, topology: Topology, replicas: int, me: int) -> Located:
    """Elastic replicas: only the stores of the DP degree holding the newest version,
    and the resize when that is not the job's (:func:`baft.recover.resize.plan_resize`)."""
    from baft.recover.resize import plan_resize

    resize, kept, note = plan_resize(topology, replicas, located.stores, located.hosts)
    if note and me == 0:
        log.warning("elastic replicas: %s", note)
    if resize is None:
        return Located(located.hosts, kept)
    return Located(dict(resize.hosts), kept, resize)


def reinventory(stores: HostStores, transport: Transport, located: Located) -> Located:
    """Every store this rank reads inventoried again with every checksum, gathered.
    Collective."""
    mine = [ref for ref in stores.refs() if reader_of(ref, located.hosts) == transport.rank]
    full = stores.inventories(mine, verify=True)
    return Located(located.hosts, gathered(transport.all_gather_object(full)))


def gathered(per_rank: list[Any]) -> list[LocatedInventory]:
    """Every rank's ``(store, inventory)`` pairs, flattened."""
    return [LocatedInventory(ref, inv) for part in per_rank for ref, inv in part]


def claim(inv: RankInventory) -> RankInventory:
    """An unverified inventory whose complete versions are taken at their word."""
    versions = tuple(
        dataclasses.replace(v, verified=True, data_ok=True, bad_regions=())
        if v.state == "complete" and v.manifest is not None
        else v
        for v in inv.versions
    )
    return dataclasses.replace(inv, versions=versions)


def _reads(
    rank: int, plan: RecoveryPlan
) -> tuple[set[tuple[StoreRef | None, int]], dict[tuple[StoreRef | None, int], set[int]]]:
    """The (store, slot)s whose shard this rank reads for ``plan``, and the redundancy
    regions it reads per (store, slot)."""
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
    return data_slots, region_ids


def verify_reads(stores: HostStores, rank: int, plan: RecoveryPlan) -> list[str]:
    """Checksum the store bytes this rank reads for ``plan``; returns the problems.
    Bytes already found clean in this restore (``stores.verified``) are not hashed again."""
    data_slots, region_ids = _reads(rank, plan)
    problems: list[str] = []
    if plan.version is None:  # nothing to read (only a plan from memory is verified)
        return problems
    for ref, slot in sorted(data_slots | set(region_ids), key=lambda k: (str(k[0]), k[1])):
        store = stores.get(ref)
        where = f"rank {rank} store {ref or store.path.name} slot {slot}"
        key = (str(store.path), slot, plan.version)
        shard = (ref, slot) in data_slots and (*key, None) not in stores.verified
        wanted = {i for i in region_ids.get((ref, slot), set()) if (*key, i) not in stores.verified}
        try:
            m, data, red = store.read_version(slot, plan.version, data=shard, red=bool(wanted))
        except StoreReadError as err:
            problems.append(f"{where} v{plan.version}: {err}")
            continue
        if m is None or m.version != plan.version:
            problems.append(f"{where}: v{plan.version} is not there")
            continue
        found = mismatches(m, data, red, wanted)
        problems += [
            f"{where} v{m.version} chunk {c.chunk_id}: checksum mismatch" for c, _ in found.chunks
        ]
        problems += [
            f"{where} v{m.version} region {r.region_id}: checksum mismatch" for r in found.regions
        ]
        if shard and not found.chunks:
            stores.verified.add((*key, None))
        stores.verified.update((*key, i) for i in wanted - {r.region_id for r in found.regions})
    return problems


def reclaim_stores(
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
    old_jobs = reclaim_jobs.reclaim_other_jobs(stores.own.root, stores.own.job_id)
    removed += [f"{host}:{p.name}" for p in old_jobs]
    if removed:
        log.info("reclaimed %d store(s) no rank needs any more: %s", len(removed), removed)
    return removed
