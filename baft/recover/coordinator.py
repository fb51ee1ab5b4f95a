"""Pure recovery coordinator: which version to resume from, and where each shard comes from.

``coordinate_located`` takes every store every host can see
(:class:`LocatedInventory`: host, directory, inventory) and the host of every current
rank, and picks the newest version whose every shard can be obtained
(:func:`baft.recover.assess.assess` says whether and how, one version at a time).
``coordinate`` is the same over one store per rank (each rank on a host of its own, None =
store lost). A store written under other pp/dp/tp sizes is a :class:`TopologyMismatchError`. Versions at or below the
newest commit record count when rebuildable; a newer version counts only if every
surviving store holds it complete and checksum-clean (and lost shards are rebuildable).
Versions are never mixed across ranks. Failing memory, the newest persisted (DCP)
version; failing that, a fresh start. Returns ``(RecoveryPlan, reason)``.

The records of the decision live in :mod:`baft.recover.plans`; this module re-exports
them with :func:`assess_version` and :func:`reader_of`, as the rest of recovery imports
them from here.

No processes, threads or I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from baft.recover.assess import (
    assess,
    assess_version,
    one_store_per_rank,
    readable_copies,
    reader_of,
)
from baft.recover.plans import (
    SHARD_KINDS,
    SOURCES,
    Decode,
    Located,
    LocatedInventory,
    PieceTransfer,
    RecoveryPlan,
    ShardSource,
    StoreRef,
    TopologyMismatchError,
    VersionAssessment,
)
from baft.store.coding import Redundancy
from baft.store.manifest import RankInventory
from baft.topology import Topology

__all__ = [
    "SHARD_KINDS",
    "SOURCES",
    "Decode",
    "Located",
    "LocatedInventory",
    "PieceTransfer",
    "RecoveryPlan",
    "ShardSource",
    "StoreRef",
    "TopologyMismatchError",
    "VersionAssessment",
    "assess_version",
    "coordinate",
    "coordinate_located",
    "reader_of",
]


def coordinate(
    topology: Topology,
    redundancy: Redundancy,
    inventories: Mapping[int, RankInventory | None],
    persisted_versions: tuple[int, ...] = (),
) -> tuple[RecoveryPlan, str]:
    """``coordinate_located`` over one store per rank, each rank on a host of its own."""
    located, hosts = one_store_per_rank(topology, inventories)
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
        copies = readable_copies(topology, located, hosts)
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
        a = assess(topology, copies, hosts, version, committed)
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


def _policy_note(inventories: Sequence[RankInventory], version: int, redundancy: Redundancy) -> str:
    for inv in inventories:
        info = inv.get(version)
        if info is not None and info.manifest is not None:
            if info.manifest.redundancy != str(redundancy):
                return f"written with {info.manifest.redundancy} (current policy {redundancy})"
            return ""
    return ""
