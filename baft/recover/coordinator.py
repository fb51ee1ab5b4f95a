"""Pure recovery coordinator: which version to resume from, and where each shard comes from.

A shard is known by what it holds, not by who opens it: the store directory of rank ``L``
holds logical shard ``L`` (the rank with the manifest's ``(pp, dp, tp)`` coordinates under
the recorded topology), wherever that directory now sits and whichever rank the process
on that host got this time (torchrun may hand out ranks differently after a node is
replaced). ``coordinate_located`` takes every store every host can see
(:class:`LocatedInventory`: host, directory, inventory) and the host of every current
rank, and picks the newest version whose every shard can be obtained: read on the host of
the rank that needs it (possibly from another rank's directory there), moved from the
memory of another host, copied from a replica, or decoded from parity in its coding group.
``coordinate`` is the same over one store per rank (each rank on a host of its own, None =
store lost). A store written under other pp/dp/tp sizes is a :class:`TopologyMismatchError`. Versions at or below the
newest commit record count when rebuildable; a newer version counts only if every
surviving store holds it complete and checksum-clean (and lost shards are rebuildable).
Versions are never mixed across ranks. Failing memory, the newest persisted (DCP)
version; failing that, a fresh start. Returns ``(RecoveryPlan, reason)``.

No processes, threads or I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from baft.errors import Refusal
from baft.store.coding import GroupLayout, Recipe, Redundancy, UnrecoverableError
from baft.store.manifest import RankInventory, VersionInfo
from baft.topology import Topology

SOURCES = ("memory", "disk", "fresh")
SHARD_KINDS = ("local", "remote", "replica", "parity")


class TopologyMismatchError(ValueError, Refusal):
    """Stores hold snapshots written under other pp/dp/tp sizes than the job's now."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message
        """What differs, without the advice."""


@dataclass(frozen=True, slots=True, order=True)
class StoreRef:
    """One store directory and the host whose memory holds it."""

    host: str
    """Host id (same machine, same boot; ``BAFT_HOST_ID`` in tests)."""
    node: int
    """Node number in the directory name."""
    rank: int
    """Rank number in the directory name: the logical shard it holds."""

    def __str__(self) -> str:
        return f"{self.host}:node{self.node}/rank{self.rank}"


@dataclass(frozen=True, slots=True)
class LocatedInventory:
    """A store's inventory and where the store is."""

    store: StoreRef
    """The directory and its host."""
    inventory: RankInventory
    """What it holds."""


@dataclass(frozen=True)
class Located:
    """What the agreement saw: every rank's host and every store on any host."""

    hosts: dict[int, str]
    stores: list[LocatedInventory]

    def holds_shards(self) -> bool:
        """Whether any store holds any version of the job (complete or not)."""
        return any(loc.inventory.versions for loc in self.stores)


@dataclass(frozen=True, slots=True)
class ShardSource:
    """Where one rank's shard of the chosen version comes from."""

    kind: str
    """``local`` (a store on the rank's own host), ``remote`` (the whole shard moved from
    another host's memory), ``replica`` (a peer's replica region) or ``parity``."""
    holders: tuple[int, ...]
    """Ranks providing bytes: the rank itself, the sender, the replica holder, or the
    decode inputs."""
    region_ids: tuple[int, ...] = ()
    """Redundancy regions used (ids in the group's ``GroupLayout``)."""
    slot: int | None = None
    """For ``local`` and ``remote``: the slot of ``store`` holding the version."""
    store: StoreRef | None = None
    """For ``local`` and ``remote``: the store directory holding the shard."""


@dataclass(frozen=True, slots=True)
class PieceTransfer:
    """Bytes one rank sends to another during recovery."""

    src_rank: int
    """Sender."""
    dst_rank: int
    """Receiver (the rank whose shard is being rebuilt)."""
    kind: str
    """``shard`` (a range of the sender's data file) or ``region`` (of its redundancy file)."""
    src_slot: int
    """Slot of the sender's store holding the version."""
    offset: int
    """Start inside the sender's data or redundancy file."""
    nbytes: int
    """Length (never 0)."""
    region_id: int = -1
    """Region id for ``region`` transfers, -1 for ``shard``."""
    src_store: StoreRef | None = None
    """Store directory the sender reads (None: the sender's own)."""


@dataclass(frozen=True, slots=True)
class Decode:
    """A rank rebuilds its shard from received pieces with ``layout.rebuild``."""

    rank: int
    """Rank whose shard is rebuilt (it does the decoding)."""
    layout: GroupLayout
    """Its coding group's layout."""
    recipe: Recipe
    """Which shard ranges and regions the decode reads."""


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """What every rank does to resume; ``version`` is the state to load."""

    version: int | None
    """Version to restore (None for a fresh start)."""
    source: str
    """``memory``, ``disk`` or ``fresh``."""
    shards: Mapping[int, ShardSource] = field(default_factory=dict)
    """Per rank, where its shard comes from (memory only)."""
    transfers: tuple[PieceTransfer, ...] = ()
    """Peer-to-peer sends needed before decoding / copying replicas."""
    decodes: tuple[Decode, ...] = ()
    """Parity rebuilds, one per rank that decodes."""
    shard_nbytes: Mapping[int, int] = field(default_factory=dict)
    """Shard size of every rank at ``version`` (memory only)."""

    def origins(self) -> dict[int, dict[str, object]]:
        """Per rank, how its shard was obtained and from which stores (host:directory)
        read by which ranks: what ``recoveries.jsonl`` records."""
        out: dict[int, dict[str, object]] = {}
        for rank, src in self.shards.items():
            if src.store is not None:
                stores = [str(src.store)]
            else:
                stores = sorted(
                    {str(t.src_store) for t in self.transfers if t.dst_rank == rank and t.src_store}
                )
            out[rank] = {"kind": src.kind, "ranks": list(src.holders), "stores": stores}
        return out


@dataclass(slots=True)
class VersionAssessment:
    """Whether one version is recoverable from memory, and how (from ``assess_version``)."""

    ok: bool
    why_not: str = ""
    shards: dict[int, ShardSource] = field(default_factory=dict)
    transfers: list[PieceTransfer] = field(default_factory=list)
    decodes: list[Decode] = field(default_factory=list)
    shard_nbytes: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def coordinate(
    topology: Topology,
    redundancy: Redundancy,
    inventories: Mapping[int, RankInventory | None],
    persisted_versions: tuple[int, ...] = (),
) -> tuple[RecoveryPlan, str]:
    """``coordinate_located`` over one store per rank, each rank on a host of its own."""
    located, hosts = _one_store_per_rank(topology, inventories)
    return coordinate_located(topology, redundancy, located, hosts, persisted_versions)


def coordinate_located(
    topology: Topology,
    redundancy: Redundancy,
    located: Sequence[LocatedInventory],
    hosts: Mapping[int, str],
    persisted_versions: tuple[int, ...] = (),
) -> tuple[RecoveryPlan, str]:
    """Choose the version to resume from and how to obtain every shard of it.

    ``located``: every store seen on any host (duplicates of one directory are merged);
    ``hosts``: the host of every current rank. Raises :class:`TopologyMismatchError` when
    a store was written under other pp/dp/tp sizes and nothing is persisted (memory
    cannot serve a changed layout; a persisted checkpoint can, resharded by DCP)."""
    try:
        copies = _copies(topology, located, hosts)
    except TopologyMismatchError as err:
        if not persisted_versions:
            raise
        version = max(persisted_versions)
        return RecoveryPlan(version=version, source="disk"), (
            f"v={version} from disk (newest persisted): memory holds another layout ({err.detail})"
        )
    present = [c.inventory for cs in copies.values() for c in cs]
    committed = max((i.committed for i in present if i.committed is not None), default=None)
    candidates = sorted({v.version for inv in present for v in inv.versions}, reverse=True)
    skipped: list[str] = []
    for version in candidates:
        a = _assess(topology, copies, hosts, version, committed)
        if not a.ok:
            skipped.append(f"v={version} {a.why_not}")
            continue
        newer_disk = [p for p in persisted_versions if p > version]
        if newer_disk:
            skipped.append(f"v={version} from memory is older than persisted v={max(newer_disk)}")
            break
        plan = RecoveryPlan(
            version=version,
            source="memory",
            shards=a.shards,
            transfers=tuple(a.transfers),
            decodes=tuple(a.decodes),
            shard_nbytes=a.shard_nbytes,
        )
        reason = f"v={version} from memory: " + "; ".join(a.notes)
        if redundancy_note := _policy_note(present, version, redundancy):
            reason += f"; {redundancy_note}"
        return plan, reason + "".join(f"; {s}" for s in skipped)
    why = "; ".join(skipped) if skipped else "no snapshot in any store"
    if persisted_versions:
        version = max(persisted_versions)
        return RecoveryPlan(version=version, source="disk"), (
            f"v={version} from disk (newest persisted): nothing newer recoverable from memory ({why})"
        )
    return RecoveryPlan(version=None, source="fresh"), (
        f"fresh start: nothing recoverable from memory ({why}) and nothing persisted"
    )


def assess_version(
    topology: Topology,
    inventories: Mapping[int, RankInventory | None],
    version: int,
    committed: int | None,
) -> VersionAssessment:
    """Can every rank obtain its shard of ``version``? (``ok`` and, if not, why); one
    store per rank, as in ``coordinate``."""
    located, hosts = _one_store_per_rank(topology, inventories)
    return _assess(topology, _copies(topology, located, hosts), hosts, version, committed)


@dataclass(frozen=True, slots=True)
class _Copy:
    """A store of one logical shard and the current rank that reads it."""

    reader: int
    store: StoreRef
    inventory: RankInventory


def _one_store_per_rank(
    topology: Topology, inventories: Mapping[int, RankInventory | None]
) -> tuple[list[LocatedInventory], dict[int, str]]:
    hosts = {r: f"rank{r}" for r in range(topology.world_size)}
    located = [
        LocatedInventory(StoreRef(hosts.get(r, f"rank{r}"), inv.node, inv.rank), inv)
        for r, inv in sorted(inventories.items())
        if inv is not None
    ]
    return located, hosts


def _copies(
    topology: Topology, located: Sequence[LocatedInventory], hosts: Mapping[int, str]
) -> dict[int, list[_Copy]]:
    """Logical shard -> its stores that a current rank can read, each with that reader:
    the rank needing the shard when it is on the store's host, else the lowest rank there."""
    seen: set[StoreRef] = set()
    out: dict[int, list[_Copy]] = {}
    for loc in located:
        if loc.store in seen:
            continue
        seen.add(loc.store)
        _check_topology(topology, loc)
        reader = reader_of(loc.store, hosts)
        if reader is None:
            continue
        out.setdefault(loc.inventory.rank, []).append(_Copy(reader, loc.store, loc.inventory))
    return out


def reader_of(store: StoreRef, hosts: Mapping[int, str]) -> int | None:
    """The current rank that reads (inventories, verifies, sends from) ``store``: the rank
    of its directory when that rank runs on the store's host, else the lowest rank there
    (None: no current rank runs on that host)."""
    if hosts.get(store.rank) == store.host:
        return store.rank
    return min((r for r, h in hosts.items() if h == store.host), default=None)


def _check_topology(topology: Topology, loc: LocatedInventory) -> None:
    want = (topology.num_pp, topology.num_dp, topology.num_tp)
    for v in loc.inventory.versions:
        m = v.manifest
        if m is None:
            continue
        got = (m.num_pp, m.num_dp, m.num_tp)
        if got != want:
            detail = (
                f"store {loc.store} holds v{m.version} written under pp={got[0]} dp={got[1]} "
                f"tp={got[2]}, but this job runs pp={want[0]} dp={want[1]} tp={want[2]}"
            )
            raise TopologyMismatchError(
                f"{detail}: restart with the old sizes, or remove the job's snapshot stores "
                "(baft inspect shows them) to start from a DCP checkpoint or afresh",
                detail,
            )
        if m.rank != loc.inventory.rank or m.rank >= topology.world_size:
            raise TopologyMismatchError(
                f"store {loc.store} holds a manifest of rank {m.rank} (v{m.version})"
            )
        c = topology.coords(m.rank)
        if m.coords and tuple(m.coords) != (c.pp, c.dp, c.tp):
            raise TopologyMismatchError(
                f"store {loc.store} holds shard (pp, dp, tp)={tuple(m.coords)} of v{m.version} "
                f"under rank {m.rank}, which is {(c.pp, c.dp, c.tp)} in this topology"
            )


def _pick(
    copies: Mapping[int, list[_Copy]], hosts: Mapping[int, str], version: int
) -> tuple[dict[int, VersionInfo], dict[int, _Copy]]:
    """Per logical shard, the best copy of ``version``: usable, on the needing rank's host,
    lowest reader (deterministic: every rank picks the same)."""
    infos: dict[int, VersionInfo] = {}
    where: dict[int, _Copy] = {}
    for logical, cs in copies.items():
        best: tuple[tuple[object, ...], VersionInfo, _Copy] | None = None
        for c in cs:
            info = c.inventory.get(version)
            if info is None:
                continue
            key = (
                not info.usable,
                info.state != "complete",
                hosts.get(logical) != c.store.host,
                c.reader,
                c.store,
            )
            if best is None or key < best[0]:
                best = (key, info, c)
        if best is not None:
            infos[logical], where[logical] = best[1], best[2]
    return infos, where


def _assess(
    topology: Topology,
    copies: Mapping[int, list[_Copy]],
    hosts: Mapping[int, str],
    version: int,
    committed: int | None,
) -> VersionAssessment:
    infos, where = _pick(copies, hosts, version)
    alive = set(copies)
    if committed is None or version > committed:
        flaws: dict[str, list[int]] = {}
        for r in sorted(alive):
            if flaw := _flaw(infos.get(r)):
                flaws.setdefault(flaw, []).append(r)
        if flaws:
            label = "uncommitted" if committed is None else f"newer than committed v={committed}"
            parts = [_on_ranks(flaw, ranks) for flaw, ranks in flaws.items()]
            return VersionAssessment(False, f"({label}) was " + ", ".join(parts))
    layouts, problem = _layouts(topology, infos, version)
    if problem:
        return VersionAssessment(False, problem)
    a = VersionAssessment(True)
    local, lost = [], []
    for rank in range(topology.world_size):
        layout = layouts[rank]
        n = layout.shard_nbytes[layout.members.index(rank)]
        a.shard_nbytes[rank] = n
        info = infos.get(rank)
        if info is not None and info.usable:
            c = where[rank]
            if c.store.host == hosts.get(rank):
                a.shards[rank] = ShardSource("local", (rank,), slot=info.slot, store=c.store)
                local.append(rank)
                if c.store.rank != rank or c.store.node != topology.node_of(rank):
                    lost.append(f"rank {rank} read from store {c.store} on its host")
                continue
            if n:
                a.transfers.append(
                    PieceTransfer(c.reader, rank, "shard", info.slot, 0, n, src_store=c.store)
                )
            a.shards[rank] = ShardSource("remote", (c.reader,), slot=info.slot, store=c.store)
            lost.append(
                f"rank {rank} (on host {hosts.get(rank)}) moved from store {c.store} "
                f"by rank {c.reader}"
            )
            continue
        try:
            how = _rebuild(a, rank, layout, infos, where, hosts)
        except UnrecoverableError as err:
            return VersionAssessment(False, f"cannot be rebuilt: {err}")
        lost.append(f"rank {rank} ({_describe_loss(rank, topology, copies, info)}) {how}")
    a.notes = [f"ranks {_ranks(local)} local" if local else "no rank local", *lost]
    return a


def _flaw(info: VersionInfo | None) -> str:
    if info is None:
        return "absent"
    if info.state != "complete":
        return f"incomplete ({info.state})"
    if not info.verified:
        return "unverified"
    if not info.data_ok or info.bad_regions:
        return "corrupt"
    return ""


def _on_ranks(flaw: str, ranks: list[int]) -> str:
    word, _, detail = flaw.partition(" ")
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
    return f"{word} on {where}" + (f" {detail}" if detail else "")


def _layouts(
    topology: Topology, infos: Mapping[int, VersionInfo], version: int
) -> tuple[dict[int, GroupLayout], str]:
    layouts: dict[int, GroupLayout] = {}
    for r, info in sorted(infos.items()):
        m = info.manifest
        if m is None or info.state != "complete":
            continue
        # pp/dp/tp sizes were checked (_check_topology); another ranks_per_node is fine: the
        # manifest records its coding group's layout, and that is all a rebuild needs.
        try:
            layout = m.layout()
        except ValueError as err:
            return {}, f"has a bad manifest on rank {r} ({err})"
        for member in layout.members:
            if member in layouts and layouts[member].digest() != layout.digest():
                return {}, f"has disagreeing group layouts for rank {member}"
            layouts[member] = layout
    missing = [r for r in range(topology.world_size) if r not in layouts]
    if missing:
        return {}, (
            f"cannot be rebuilt: no surviving member of the coding group of ranks "
            f"{_ranks(missing)} holds it complete"
        )
    return layouts, ""


def _rebuild(
    a: VersionAssessment,
    rank: int,
    layout: GroupLayout,
    infos: Mapping[int, VersionInfo],
    where: Mapping[int, _Copy],
    hosts: Mapping[int, str],
) -> str:
    shards = {g for g in layout.members if g in infos and infos[g].usable}
    regions = {
        r.region_id
        for r in layout.all_regions()
        if r.holder in infos and infos[r.holder].region_ok(r.region_id)
    }
    recipe = layout.recipe(rank, shards, regions)
    holders: list[int] = []

    def reader(logical: int) -> int:  # inputs in the decoding rank's own host: it reads them
        src = where[logical]
        return rank if hosts.get(rank) == src.store.host else src.reader

    for seg in recipe.segments:
        if seg.nbytes:
            src = where[seg.rank]
            a.transfers.append(
                PieceTransfer(
                    reader(seg.rank),
                    rank,
                    "shard",
                    infos[seg.rank].slot,
                    seg.offset,
                    seg.nbytes,
                    src_store=src.store,
                )
            )
            holders.append(reader(seg.rank))
    for rid in recipe.region_ids:
        region = layout.region(rid)
        src = where[region.holder]
        if region.nbytes:
            a.transfers.append(
                PieceTransfer(
                    reader(region.holder),
                    rank,
                    "region",
                    infos[region.holder].slot,
                    region.offset,
                    region.nbytes,
                    rid,
                    src_store=src.store,
                )
            )
        holders.append(reader(region.holder))
    unique = tuple(sorted(set(holders)))
    a.shards[rank] = ShardSource(recipe.kind, unique, recipe.region_ids)
    if recipe.kind == "parity":
        a.decodes.append(Decode(rank, layout, recipe))
    red = layout.redundancy
    if recipe.kind == "replica":
        return f"copied from the {red} replica on rank {unique[0]}"
    return f"rebuilt from {red} parity using ranks {_ranks(unique)}"


def _describe_loss(
    rank: int,
    topology: Topology,
    copies: Mapping[int, list[_Copy]],
    info: VersionInfo | None,
) -> str:
    if not copies.get(rank):
        return f"store lost with node {topology.node_of(rank)}"
    if info is None:
        return "version absent from its store"
    if info.state != "complete":
        return f"version {info.state} in its store"
    return "shard failed its checksum"


def _policy_note(inventories: Sequence[RankInventory], version: int, redundancy: Redundancy) -> str:
    for inv in inventories:
        info = inv.get(version)
        if info is not None and info.manifest is not None:
            if info.manifest.redundancy != str(redundancy):
                return f"written with {info.manifest.redundancy} (current policy {redundancy})"
            return ""
    return ""


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)
