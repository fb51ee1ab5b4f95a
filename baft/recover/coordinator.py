"""Pure recovery coordinator: which version to resume from, and where each shard comes from.

``coordinate`` looks at every rank's store inventory (None = store lost) and picks the
newest version whose every shard can be obtained from the rank's own store, from a
replica on a peer, or by parity decoding in its coding group. Versions at or below the
newest commit record count when rebuildable; a newer version counts only if every
surviving store holds it complete and checksum-clean (and lost shards are rebuildable).
Versions are never mixed across ranks. Failing memory, the newest persisted (DCP)
version; failing that, a fresh start. Returns ``(RecoveryPlan, reason)``.

No processes, threads or I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from baft.store.coding import GroupLayout, Recipe, Redundancy, UnrecoverableError
from baft.store.manifest import RankInventory, VersionInfo
from baft.topology import Topology

SOURCES = ("memory", "disk", "fresh")
SHARD_KINDS = ("local", "replica", "parity")


@dataclass(frozen=True, slots=True)
class ShardSource:
    """Where one rank's shard of the chosen version comes from."""

    kind: str
    """``local`` (own store), ``replica`` (a peer's replica region) or ``parity``."""
    holders: tuple[int, ...]
    """Ranks providing bytes: the rank itself, the replica holder, or the decode inputs."""
    region_ids: tuple[int, ...] = ()
    """Redundancy regions used (ids in the group's ``GroupLayout``)."""
    slot: int | None = None
    """For ``local``: the slot of the rank's store holding the version."""


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
    """Choose the version to resume from and how to obtain every shard of it."""
    present = {r: inv for r, inv in inventories.items() if inv is not None}
    committed = max(
        (i.committed for i in present.values() if i.committed is not None), default=None
    )
    candidates = sorted({v.version for inv in present.values() for v in inv.versions}, reverse=True)
    skipped: list[str] = []
    for version in candidates:
        a = assess_version(topology, present, version, committed)
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
    """Can every rank obtain its shard of ``version``? (``ok`` and, if not, why)."""
    infos: dict[int, VersionInfo] = {}
    for r, inv in inventories.items():
        info = inv.get(version) if inv is not None else None
        if info is not None:
            infos[r] = info
    alive = {r for r, inv in inventories.items() if inv is not None}
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
        a.shard_nbytes[rank] = layout.shard_nbytes[layout.members.index(rank)]
        info = infos.get(rank)
        if info is not None and info.usable:
            a.shards[rank] = ShardSource("local", (rank,), slot=info.slot)
            local.append(rank)
            continue
        try:
            how = _rebuild(a, rank, layout, infos)
        except UnrecoverableError as err:
            return VersionAssessment(False, f"cannot be rebuilt: {err}")
        lost.append(f"rank {rank} ({_describe_loss(rank, topology, inventories, info)}) {how}")
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
        if m.topology() != topology:
            return {}, f"was written under {m.topology()}, now {topology}"
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
    a: VersionAssessment, rank: int, layout: GroupLayout, infos: Mapping[int, VersionInfo]
) -> str:
    shards = {g for g in layout.members if g in infos and infos[g].usable}
    regions = {
        r.region_id
        for r in layout.all_regions()
        if r.holder in infos and infos[r.holder].region_ok(r.region_id)
    }
    recipe = layout.recipe(rank, shards, regions)
    holders: list[int] = []
    for seg in recipe.segments:
        if seg.nbytes:
            a.transfers.append(
                PieceTransfer(seg.rank, rank, "shard", infos[seg.rank].slot, seg.offset, seg.nbytes)
            )
            holders.append(seg.rank)
    for rid in recipe.region_ids:
        region = layout.region(rid)
        if region.nbytes:
            a.transfers.append(
                PieceTransfer(
                    region.holder,
                    rank,
                    "region",
                    infos[region.holder].slot,
                    region.offset,
                    region.nbytes,
                    rid,
                )
            )
        holders.append(region.holder)
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
    inventories: Mapping[int, RankInventory | None],
    info: VersionInfo | None,
) -> str:
    if inventories.get(rank) is None:
        return f"store lost with node {topology.node_of(rank)}"
    if info is None:
        return "version absent from its store"
    if info.state != "complete":
        return f"version {info.state} in its store"
    return "shard failed its checksum"


def _policy_note(
    inventories: Mapping[int, RankInventory], version: int, redundancy: Redundancy
) -> str:
    for inv in inventories.values():
        info = inv.get(version)
        if info is not None and info.manifest is not None:
            if info.manifest.redundancy != str(redundancy):
                return f"written with {info.manifest.redundancy} (current policy {redundancy})"
            return ""
    return ""


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)
