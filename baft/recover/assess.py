"""Whether every rank can obtain its shard of one version, and how.

A shard is known by what it holds, not by who opens it: the store directory of rank ``L``
holds logical shard ``L`` (the rank with the manifest's ``(pp, dp, tp)`` coordinates under
the recorded topology), wherever that directory now sits and whichever rank the process
on that host got this time (torchrun may hand out ranks differently after a node is
replaced). :func:`assess` finds, for every current rank, how it obtains its shard of one
version: read on the host of the rank that needs it (possibly from another rank's
directory there), moved from the memory of another host, copied from a replica, or
decoded from parity in its coding group; or why the version cannot be had. The
coordinator (:mod:`baft.recover.coordinator`) asks it about each candidate, newest first.

No processes, threads or I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baft.recover.plans import (
    Decode,
    LocatedInventory,
    PieceTransfer,
    ShardSource,
    StoreRef,
    TopologyMismatchError,
    VersionAssessment,
)
from baft.store.coding import GroupLayout, UnrecoverableError
from baft.store.manifest import RankInventory, VersionInfo
from baft.topology import Topology


def assess_version(
    topology: Topology,
    inventories: Mapping[int, RankInventory | None],
    version: int,
    committed: int | None,
) -> VersionAssessment:
    """Can every rank obtain its shard of ``version``? (``ok`` and, if not, why); one
    store per rank, as in ``coordinate``."""
    located, hosts = one_store_per_rank(topology, inventories)
    return assess(topology, readable_copies(topology, located, hosts), hosts, version, committed)


@dataclass(frozen=True, slots=True)
class ShardCopy:
    """A store of one logical shard and the current rank that reads it."""

    reader: int
    store: StoreRef
    inventory: RankInventory


def one_store_per_rank(
    topology: Topology, inventories: Mapping[int, RankInventory | None]
) -> tuple[list[LocatedInventory], dict[int, str]]:
    """Every rank's store on a host of its own (None: store lost), as located stores
    and current hosts: the picture of ``coordinate`` and :func:`assess_version`."""
    hosts = {r: f"rank{r}" for r in range(topology.world_size)}
    located = [
        LocatedInventory(StoreRef(hosts.get(r, f"rank{r}"), inv.node, inv.rank), inv)
        for r, inv in sorted(inventories.items())
        if inv is not None
    ]
    return located, hosts


def readable_copies(
    topology: Topology, located: Sequence[LocatedInventory], hosts: Mapping[int, str]
) -> dict[int, list[ShardCopy]]:
    """Logical shard -> its stores that a current rank can read, each with that reader:
    the rank needing the shard when it is on the store's host, else the lowest rank there."""
    seen: set[StoreRef] = set()
    out: dict[int, list[ShardCopy]] = {}
    for loc in located:
        if loc.store in seen:
            continue
        seen.add(loc.store)
        _check_topology(topology, loc)
        reader = reader_of(loc.store, hosts)
        if reader is None:
            continue
        out.setdefault(loc.inventory.rank, []).append(ShardCopy(reader, loc.store, loc.inventory))
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
    copies: Mapping[int, list[ShardCopy]], hosts: Mapping[int, str], version: int
) -> tuple[dict[int, VersionInfo], dict[int, ShardCopy]]:
    """Per logical shard, the best copy of ``version``: usable, on the needing rank's host,
    lowest reader (deterministic: every rank picks the same)."""
    infos: dict[int, VersionInfo] = {}
    where: dict[int, ShardCopy] = {}
    for logical, cs in copies.items():
        best: tuple[tuple[object, ...], VersionInfo, ShardCopy] | None = None
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


def assess(
    topology: Topology,
    copies: Mapping[int, list[ShardCopy]],
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
    where: Mapping[int, ShardCopy],
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
    copies: Mapping[int, list[ShardCopy]],
    info: VersionInfo | None,
) -> str:
    if not copies.get(rank):
        return f"store lost with node {topology.node_of(rank)}"
    if info is None:
        return "version absent from its store"
    if info.state != "complete":
        return f"version {info.state} in its store"
    return "shard failed its checksum"


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)
