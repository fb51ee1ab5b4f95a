"""Manifest, commit and inventory records of a snapshot store, and their checksums.

A *manifest* describes one version held in one slot of one rank's store: the shard it
owns, per-chunk xxh3_64 checksums of the data, the redundancy regions with checksums,
the topology and coding group it was written under, and free-form JSON ``meta``.
A *RankInventory* is what a rank publishes on restart: which versions its store holds,
in which state, and whether their checksums verified. Both are plain data (JSON
round-trip) so the pure recovery coordinator can reason about them. :func:`mismatches`
is the one check of store bytes against a manifest (``SnapshotStore.inventory`` and a
restore's reads both use it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import xxhash

from baft.store.coding import GroupLayout, Region
from baft.store.policy import Redundancy
from baft.topology import Topology

FORMAT = 1
"""Manifest format version written to every record."""
STATES = ("writing", "complete")


def checksum(buf: np.ndarray | memoryview | bytes) -> int:
    """xxh3_64 of a contiguous buffer, without copying."""
    return xxhash.xxh3_64_intdigest(buf.data if isinstance(buf, np.ndarray) else buf)


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """Checksum of one byte range of the shard."""

    chunk_id: int
    """Stable id of the chunk (engine's numbering)."""
    offset: int
    """Start inside the shard (data file)."""
    nbytes: int
    """Length."""
    xxh3: int
    """xxh3_64 of the bytes."""


@dataclass(frozen=True, slots=True)
class RegionRecord:
    """Checksum of one redundancy region (replica or parity block)."""

    region_id: int
    """Id from ``GroupLayout``."""
    offset: int
    """Start inside the redundancy file."""
    nbytes: int
    """Length."""
    xxh3: int
    """xxh3_64 of the bytes."""


def chunk_records(
    data: np.ndarray, chunk_nbytes: int, first_id: int = 0
) -> tuple[ChunkRecord, ...]:
    """Checksums of ``data`` cut into chunks of ``chunk_nbytes`` (last one shorter)."""
    if chunk_nbytes < 1:
        raise ValueError(f"chunk_nbytes must be >= 1, got {chunk_nbytes}")
    out = []
    for i, start in enumerate(range(0, data.size, chunk_nbytes)):
        view = data[start : start + chunk_nbytes]
        out.append(ChunkRecord(first_id + i, start, view.size, checksum(view)))
    return tuple(out)


def region_records(
    red: np.ndarray, regions: Sequence[Region], known: Mapping[int, int] | None = None
) -> tuple[RegionRecord, ...]:
    """Checksums of the given regions of a redundancy area; ``known`` holds those already
    computed where the bytes were written (region id -> xxh3), the rest are hashed here."""
    out = []
    known = known or {}
    for r in regions:
        digest = known.get(r.region_id)
        if digest is None:
            digest = checksum(red[r.offset : r.offset + r.nbytes])
        out.append(RegionRecord(r.region_id, r.offset, r.nbytes, digest))
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Everything needed to trust and use one version of one rank's shard."""

    version: int
    """Snapshot version (state before optimizer step ``version``)."""
    iteration: int
    """Training iteration the snapshot was taken in."""
    rank: int
    """Rank that owns the store."""
    node: int
    """Node (failure domain) of that rank."""
    owned_start: int
    """Start of the shard inside the rank's flat state."""
    owned_stop: int
    """End (exclusive) of the shard inside the flat state."""
    data_nbytes: int
    """Bytes of the data file used (= owned_stop - owned_start)."""
    red_nbytes: int
    """Bytes of the redundancy area used."""
    chunks: tuple[ChunkRecord, ...]
    """Checksums covering ``[0, data_nbytes)`` contiguously, in order."""
    regions: tuple[RegionRecord, ...]
    """Checksums of this rank's redundancy regions."""
    num_pp: int
    """Topology the version was written under (to rebuild ``Topology``)."""
    num_dp: int
    """See ``num_pp``."""
    num_tp: int
    """See ``num_pp``."""
    ranks_per_node: int
    """See ``num_pp``."""
    redundancy: str
    """Redundancy policy, ``str(Redundancy)``."""
    group: tuple[int, ...]
    """Members of this rank's coding group."""
    group_shard_nbytes: tuple[int, ...]
    """Shard size of each group member."""
    layout_digest: str
    """``GroupLayout.digest()`` of the group."""
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras (RNG, data position, ...); not protected by redundancy."""
    coords: tuple[int, ...] = ()
    """``(pp, dp, tp)`` of the shard's owner: what the shard holds, whatever rank or
    directory it is found under later (empty in manifests written before it was kept)."""
    state: str = "complete"
    """``complete`` (a writing slot has no full manifest)."""

    @property
    def shard_nbytes(self) -> int:
        return self.owned_stop - self.owned_start

    def topology(self) -> Topology:
        return Topology(
            num_pp=self.num_pp,
            num_dp=self.num_dp,
            num_tp=self.num_tp,
            ranks_per_node=self.ranks_per_node,
        )

    def layout(self) -> GroupLayout:
        """The coding-group layout recorded here (checked against its digest)."""
        layout = GroupLayout(Redundancy.parse(self.redundancy), self.group, self.group_shard_nbytes)
        if layout.digest() != self.layout_digest:
            raise ValueError(f"rank {self.rank} v{self.version}: layout digest mismatch")
        return layout

    @classmethod
    def for_layout(
        cls,
        *,
        topology: Topology,
        layout: GroupLayout,
        rank: int,
        version: int,
        iteration: int,
        owned_start: int,
        owned_stop: int,
        chunks: tuple[ChunkRecord, ...],
        regions: tuple[RegionRecord, ...],
        meta: dict[str, Any] | None = None,
    ) -> Manifest:
        """Fill topology and group fields from ``topology`` and ``layout``."""
        return cls(
            version=version,
            iteration=iteration,
            rank=rank,
            node=topology.node_of(rank),
            owned_start=owned_start,
            owned_stop=owned_stop,
            data_nbytes=owned_stop - owned_start,
            red_nbytes=layout.redundancy_nbytes(rank),
            chunks=chunks,
            regions=regions,
            num_pp=topology.num_pp,
            num_dp=topology.num_dp,
            num_tp=topology.num_tp,
            ranks_per_node=topology.ranks_per_node,
            redundancy=str(layout.redundancy),
            group=layout.members,
            group_shard_nbytes=layout.shard_nbytes,
            layout_digest=layout.digest(),
            meta=dict(meta or {}),
            coords=tuple(dataclasses.astuple(topology.coords(rank))),
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["chunks"] = [[c.chunk_id, c.offset, c.nbytes, f"{c.xxh3:016x}"] for c in self.chunks]
        d["regions"] = [[r.region_id, r.offset, r.nbytes, f"{r.xxh3:016x}"] for r in self.regions]
        d["group"] = list(self.group)
        d["group_shard_nbytes"] = list(self.group_shard_nbytes)
        d["coords"] = list(self.coords)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        d = dict(d)
        if d.pop("format", None) != FORMAT:
            raise ValueError(f"unsupported manifest format (expected {FORMAT})")
        d["chunks"] = tuple(ChunkRecord(a, b, c, int(h, 16)) for a, b, c, h in d["chunks"])
        d["regions"] = tuple(RegionRecord(a, b, c, int(h, 16)) for a, b, c, h in d["regions"])
        d["group"] = tuple(d["group"])
        d["group_shard_nbytes"] = tuple(d["group_shard_nbytes"])
        d["coords"] = tuple(d.get("coords", ()))
        return cls(**d)

    def check(self) -> None:
        """Raise ``ValueError`` if chunks do not tile the shard or sizes disagree."""
        if self.data_nbytes != self.owned_stop - self.owned_start:
            raise ValueError(
                f"data_nbytes={self.data_nbytes} != owned_stop-owned_start="
                f"{self.owned_stop - self.owned_start}"
            )
        pos = 0
        for c in self.chunks:
            if c.offset != pos or c.nbytes < 0:
                raise ValueError(f"chunk {c.chunk_id} starts at {c.offset}, expected {pos}")
            pos += c.nbytes
        if pos != self.data_nbytes:
            raise ValueError(f"chunks cover {pos} bytes, shard has {self.data_nbytes}")
        for r in self.regions:
            if r.offset < 0 or r.offset + r.nbytes > self.red_nbytes:
                raise ValueError(f"region {r.region_id} outside redundancy area {self.red_nbytes}")


@dataclass(frozen=True, slots=True)
class Mismatches:
    """What of a version's bytes does not match its manifest."""

    chunks: tuple[tuple[ChunkRecord, int], ...] = ()
    """Data chunks whose bytes hash otherwise: (record, xxh3 found)."""
    regions: tuple[RegionRecord, ...] = ()
    """Redundancy regions whose bytes hash otherwise."""


def mismatches(
    manifest: Manifest,
    data: np.ndarray | None,
    red: np.ndarray | None,
    region_ids: Collection[int] | None = None,
) -> Mismatches:
    """Which chunks of ``data`` (the shard) and regions of ``red`` (the redundancy area)
    do not match ``manifest``'s checksums; ``region_ids``: only those regions. A buffer
    given as None is not checked (the caller did not read it, or could not)."""
    chunks: tuple[tuple[ChunkRecord, int], ...] = ()
    if data is not None:
        found = ((c, checksum(data[c.offset : c.offset + c.nbytes])) for c in manifest.chunks)
        chunks = tuple((c, got) for c, got in found if got != c.xxh3)
    regions: tuple[RegionRecord, ...] = ()
    if red is not None:
        regions = tuple(
            r
            for r in manifest.regions
            if (region_ids is None or r.region_id in region_ids)
            and checksum(red[r.offset : r.offset + r.nbytes]) != r.xxh3
        )
    return Mismatches(chunks, regions)


def dumps(manifest: Manifest) -> str:
    return json.dumps(manifest.to_dict(), separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """One version found in a rank's store."""

    version: int
    """Snapshot version."""
    slot: int
    """Slot (0 or 1) holding it."""
    state: str
    """``writing`` or ``complete``."""
    verified: bool
    """Checksums were recomputed (``inventory(verify=True)``)."""
    data_ok: bool
    """Complete and (if verified) every data chunk matched."""
    bad_regions: tuple[int, ...]
    """Region ids whose checksum failed (or all of them if the file is unusable)."""
    problems: tuple[str, ...]
    """Human-readable findings."""
    manifest: Manifest | None
    """Full manifest when complete."""

    @property
    def usable(self) -> bool:
        """Counts for recovery: complete, verified, data clean."""
        return self.state == "complete" and self.verified and self.data_ok

    def region_ok(self, region_id: int) -> bool:
        return (
            self.state == "complete"
            and self.verified
            and self.manifest is not None
            and any(r.region_id == region_id for r in self.manifest.regions)
            and region_id not in self.bad_regions
        )


@dataclass(frozen=True, slots=True)
class RankInventory:
    """What one rank's store holds after a restart."""

    rank: int
    """Rank of the store."""
    node: int
    """Node of the store."""
    committed: int | None
    """Version in the rank's commit record (newest globally committed it was told)."""
    versions: tuple[VersionInfo, ...]
    """Versions present, newest first."""
    problems: tuple[str, ...] = ()
    """Store-level findings (unreadable manifests, leftovers)."""

    def get(self, version: int) -> VersionInfo | None:
        for v in self.versions:
            if v.version == version:
                return v
        return None
