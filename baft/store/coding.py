"""Pure erasure coding of snapshot shards across failure domains (nodes).

A *coding group* is a set of ranks with the same local index on ``group_size``
consecutive nodes, so its members never share a node. ``GroupLayout`` says, for one
group, what each member stores in its redundancy area (replicas of the other members'
shards, or XOR / Reed-Solomon parity blocks), which bytes every member sends to whom at
each checkpoint, how parity is computed and how a lost member's shard is rebuilt.

Stripe layout (xor / rs, k data + m parity, G = k + m members): every shard is
zero-padded to a common length ``L = k * segment_nbytes`` (``segment_nbytes`` a multiple
of 8) and cut into k segments. Stripe ``s`` (0 <= s < G) has parity holders members
``s, s+1, .., s+m-1`` (mod G) and data contributors ``s+m, .., s+G-1`` (mod G); each
contributor gives its next unused segment, so each segment lands in exactly one stripe.

The policies and the grouping of ranks are :mod:`baft.store.policy`, the byte kernels
(XOR, zfec) :mod:`baft.store.codec`. Only numpy and zfec; no processes, threads or I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from baft.store import codec
from baft.store.codec import BytesLike
from baft.store.policy import Redundancy, coding_groups  # callers import these here too
from baft.topology import Topology

_ALIGN = 8


class UnrecoverableError(Exception):
    """More pieces are missing than the redundancy tolerates; ``missing`` names them."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class Segment:
    """A byte range ``[offset, offset + nbytes)`` of one rank's shard."""

    rank: int
    """Rank whose shard holds the bytes."""
    offset: int
    """Start inside that shard."""
    nbytes: int
    """Length; may be shorter than the padded segment (the rest is zeros)."""


@dataclass(frozen=True, slots=True)
class Region:
    """One piece of a member's redundancy area."""

    region_id: int
    """Unique within the group."""
    holder: int
    """Rank that stores the region."""
    offset: int
    """Start inside the holder's redundancy area."""
    nbytes: int
    """Length in bytes."""
    kind: str
    """``replica`` (copy of another shard) or ``parity``."""
    stripe: int
    """Stripe index for parity, -1 for replicas."""
    block: int
    """Parity block index 0..m-1 (0 for replicas)."""
    sources: tuple[Segment, ...]
    """Inputs in order: the replicated shard, or the k data segments of the stripe."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """Bytes a member sends to a holder at every checkpoint."""

    src_rank: int
    """Sender; the bytes are ``shard[src_offset : src_offset + nbytes]``."""
    dst_rank: int
    """Holder of the destination region."""
    src_offset: int
    """Start inside the sender's shard."""
    nbytes: int
    """Length (never 0)."""
    dst_region_id: int
    """Region these bytes feed."""
    input_index: int = 0
    """Position in ``encode(dst_region_id, inputs)`` (0 for replicas)."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """What rebuilding one member's shard needs (from ``GroupLayout.recipe``)."""

    target: int
    """Rank whose shard is rebuilt."""
    kind: str
    """``replica`` or ``parity``."""
    segments: tuple[Segment, ...]
    """Byte ranges of surviving shards that must be present."""
    region_ids: tuple[int, ...]
    """Regions that must be present."""


@dataclass(frozen=True, slots=True)
class _Stripe:
    holders: tuple[int, ...]  # member indices, parity block p at holders[p]
    data: tuple[tuple[int, int], ...]  # (member index, segment index) per data position


@dataclass(frozen=True)
class GroupLayout:
    """Where each member's redundancy lives for one coding group.

    ``members`` and ``shard_nbytes`` are parallel; shards may differ in size.
    """

    redundancy: Redundancy
    """Policy of the group."""
    members: tuple[int, ...]
    """Ranks of the group, in group order (one per node)."""
    shard_nbytes: tuple[int, ...]
    """Shard size of each member."""
    segment_nbytes: int = field(init=False)
    """Padded segment length (xor/rs); 0 for replicate and none."""
    _stripes: tuple[_Stripe, ...] = field(init=False, repr=False)
    _regions: tuple[Region, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        red = self.redundancy
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "shard_nbytes", tuple(self.shard_nbytes))
        if len(self.members) != red.group_size or len(self.shard_nbytes) != len(self.members):
            raise ValueError(
                f"{red} needs {red.group_size} members with one shard size each, got "
                f"members={self.members} shard_nbytes={self.shard_nbytes}"
            )
        if len(set(self.members)) != len(self.members) or min(self.shard_nbytes) < 0:
            raise ValueError(f"members must be distinct and sizes >= 0: {self}")
        seg = 0
        if red.kind in ("xor", "rs"):
            per = red.k * _ALIGN
            seg = -(-max(self.shard_nbytes) // per) * _ALIGN
        object.__setattr__(self, "segment_nbytes", seg)
        stripes = self._make_stripes() if red.kind in ("xor", "rs") else ()
        object.__setattr__(self, "_stripes", stripes)
        object.__setattr__(self, "_regions", self._make_regions())

    def _make_stripes(self) -> tuple[_Stripe, ...]:
        k, m = self.redundancy.k, self.redundancy.m
        size = k + m
        used = [0] * size
        stripes = []
        for s in range(size):
            holders = tuple((s + p) % size for p in range(m))
            data = []
            for d in range(k):
                member = (s + m + d) % size
                data.append((member, used[member]))
                used[member] += 1
            stripes.append(_Stripe(holders=holders, data=tuple(data)))
        return tuple(stripes)

    def _segment(self, member: int, index: int) -> Segment:
        start = index * self.segment_nbytes
        n = self.shard_nbytes[member]
        return Segment(
            self.members[member], min(start, n), max(0, min(n - start, self.segment_nbytes))
        )

    def _make_regions(self) -> tuple[Region, ...]:
        red, size = self.redundancy, len(self.members)
        specs: list[tuple[int, str, int, int, tuple[Segment, ...], int]] = []
        if red.kind == "replicate":
            for i in range(size):
                for j in range(size):
                    if i != j:
                        src = (Segment(self.members[j], 0, self.shard_nbytes[j]),)
                        specs.append((i, "replica", -1, 0, src, self.shard_nbytes[j]))
        elif red.kind in ("xor", "rs"):
            for s, stripe in enumerate(self._stripes):
                srcs = tuple(self._segment(mem, idx) for mem, idx in stripe.data)
                for p, holder in enumerate(stripe.holders):
                    specs.append((holder, "parity", s, p, srcs, self.segment_nbytes))
        offsets = [0] * size
        regions = []
        for region_id, (holder, kind, stripe_no, block, srcs, nbytes) in enumerate(specs):
            regions.append(
                Region(
                    region_id=region_id,
                    holder=self.members[holder],
                    offset=offsets[holder],
                    nbytes=nbytes,
                    kind=kind,
                    stripe=stripe_no,
                    block=block,
                    sources=srcs,
                )
            )
            offsets[holder] += nbytes
        return tuple(sorted(regions, key=lambda r: (self.members.index(r.holder), r.offset)))

    # ----------------------------------------------------------------- queries
    def _index(self, rank: int) -> int:
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not in coding group {self.members}")
        return self.members.index(rank)

    def digest(self) -> str:
        """Stable hex digest of the layout (policy, members, sizes)."""
        text = f"{self.redundancy}|{self.members}|{self.shard_nbytes}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def redundancy_nbytes(self, member_rank: int) -> int:
        """Bytes of ``member_rank``'s redundancy area."""
        return sum(r.nbytes for r in self.regions(member_rank))

    def regions(self, member_rank: int) -> tuple[Region, ...]:
        """Regions held by ``member_rank``, by offset."""
        self._index(member_rank)
        return tuple(r for r in self._regions if r.holder == member_rank)

    def all_regions(self) -> tuple[Region, ...]:
        """Every region of the group."""
        return self._regions

    def region(self, region_id: int) -> Region:
        """The region with this id."""
        for r in self._regions:
            if r.region_id == region_id:
                return r
        raise ValueError(f"region {region_id} not in group {self.members}")

    def transfers(self) -> list[Transfer]:
        """What each member sends to whom per checkpoint (empty ranges left out)."""
        out = []
        for r in self._regions:
            for index, seg in enumerate(r.sources):
                if seg.nbytes:
                    out.append(
                        Transfer(seg.rank, r.holder, seg.offset, seg.nbytes, r.region_id, index)
                    )
        return out

    # ----------------------------------------------------------------- encode
    def encode(
        self, region_id: int, inputs: Sequence[BytesLike], out: np.ndarray | None = None
    ) -> np.ndarray:
        """Content of region ``region_id`` from its inputs (in ``Region.sources`` order).

        Inputs shorter than the segment are zero-padded. Writes into ``out`` (a writable
        uint8 array of ``region.nbytes``) when given, e.g. a slice of the redundancy view.
        """
        region = self.region(region_id)
        if len(inputs) != len(region.sources):
            raise ValueError(
                f"region {region_id} takes {len(region.sources)} inputs, got {len(inputs)}"
            )
        arrays = [codec.u8(x) for x in inputs]
        for a, seg in zip(arrays, region.sources, strict=True):
            if a.size != seg.nbytes:
                raise ValueError(
                    f"input from rank {seg.rank} has {a.size} bytes, expected {seg.nbytes}"
                )
        if out is None:
            out = np.zeros(region.nbytes, np.uint8)
        elif out.size != region.nbytes:
            raise ValueError(f"out has {out.size} bytes, region {region_id} has {region.nbytes}")
        if region.kind == "replica":
            out[:] = arrays[0]
        elif self.redundancy.kind == "xor":
            codec.xor_into(out, arrays)
        else:
            blocks = codec.padded(arrays, self.segment_nbytes)
            k = self.redundancy.k
            parity = codec.encoder(k, k + self.redundancy.m).encode(blocks, (k + region.block,))[0]
            out[:] = np.frombuffer(parity, np.uint8)
        return out

    # ----------------------------------------------------------------- rebuild
    def recipe(self, member_rank: int, shards: Collection[int], regions: Collection[int]) -> Recipe:
        """What rebuilding ``member_rank`` needs, given which other members' shards and
        which region ids are intact. Raises ``UnrecoverableError`` naming missing blocks."""
        target = self._index(member_rank)
        red = self.redundancy
        have = set(shards) - {member_rank}
        if red.kind == "none":
            raise UnrecoverableError(
                f"rank {member_rank}: redundancy none keeps no copy outside its own store",
                (f"shard of rank {member_rank}",),
            )
        if red.kind == "replicate":
            return self._replica_recipe(target, set(regions))
        used_segments: list[Segment] = []
        used_regions: list[int] = []
        for stripe_index, stripe in enumerate(self._stripes):
            mine = [i for mem, i in stripe.data if mem == target]
            if not mine or self._segment(target, mine[0]).nbytes == 0:
                continue
            segs, regs = self._stripe_blocks(stripe_index, stripe, target, have, set(regions))
            used_segments += segs
            used_regions += regs
        return Recipe(member_rank, "parity", tuple(used_segments), tuple(used_regions))

    def _replica_recipe(self, target: int, regions: set[int]) -> Recipe:
        size = len(self.members)
        by_holder = {
            r.holder: r for r in self._regions if r.sources[0].rank == self.members[target]
        }
        for step in range(1, size):
            holder = self.members[(target + step) % size]
            region = by_holder[holder]
            if region.region_id in regions:
                return Recipe(self.members[target], "replica", (), (region.region_id,))
        missing = tuple(f"replica at rank {h} (region {r.region_id})" for h, r in by_holder.items())
        raise UnrecoverableError(
            f"rank {self.members[target]} ({self.redundancy}): every replica is missing: "
            + ", ".join(missing),
            missing,
        )

    def _stripe_blocks(
        self, index: int, stripe: _Stripe, target: int, have: set[int], regions: set[int]
    ) -> tuple[list[Segment], list[int]]:
        k = self.redundancy.k
        segs: list[Segment] = []
        regs: list[int] = []
        missing: list[str] = []
        for mem, seg_index in stripe.data:
            if mem == target:
                continue
            seg = self._segment(mem, seg_index)
            if seg.rank in have or seg.nbytes == 0:
                segs.append(seg)
            else:
                missing.append(f"stripe {index} data segment {seg_index} of rank {seg.rank}")
        for p, holder in enumerate(stripe.holders):
            rid = self._parity_id(index, p)
            if len(segs) + len(regs) >= k:
                break
            if rid in regions:
                regs.append(rid)
            else:
                missing.append(f"stripe {index} parity block {p} at rank {self.members[holder]}")
        if len(segs) + len(regs) < k:
            raise UnrecoverableError(
                f"rank {self.members[target]} ({self.redundancy}): stripe {index} has "
                f"{len(segs) + len(regs)} of the {k} blocks it needs; missing: "
                + ", ".join(missing),
                tuple(missing),
            )
        return segs, regs

    def _parity_id(self, stripe: int, block: int) -> int:
        for r in self._regions:
            if r.stripe == stripe and r.block == block:
                return r.region_id
        raise AssertionError(f"no parity region for stripe {stripe} block {block}")

    def rebuild(
        self,
        member_rank: int,
        shards: Mapping[int, BytesLike],
        regions: Mapping[int, BytesLike],
        out: np.ndarray | None = None,
        recipe: Recipe | None = None,
    ) -> np.ndarray:
        """Rebuild ``member_rank``'s shard (uint8 array of its size) bit-exactly.

        ``shards`` maps surviving ranks to full-size shard buffers (only the byte ranges
        in the recipe are read); ``regions`` maps region ids to region contents.
        Raises ``UnrecoverableError`` when too much is missing; never returns wrong bytes
        for intact inputs. ``recipe`` (e.g. from a ``RecoveryPlan``) fixes which pieces
        are read; by default it is ``self.recipe(member_rank, shards, regions)``.
        """
        if recipe is None:
            recipe = self.recipe(member_rank, shards.keys(), regions.keys())
        elif recipe.target != member_rank:
            raise ValueError(f"recipe is for rank {recipe.target}, not {member_rank}")
        n = self.shard_nbytes[self._index(member_rank)]
        if out is None:
            out = np.empty(n, np.uint8)
        elif out.size != n:
            raise ValueError(f"out has {out.size} bytes, shard of rank {member_rank} has {n}")
        if recipe.kind == "replica":
            out[:] = codec.u8(regions[recipe.region_ids[0]])[:n]
            return out
        target = self._index(member_rank)
        for index, stripe in enumerate(self._stripes):
            for d, (mem, seg_index) in enumerate(stripe.data):
                if mem == target and self._segment(mem, seg_index).nbytes:
                    block = self._decode_block(index, stripe, d, recipe, shards, regions)
                    seg = self._segment(mem, seg_index)
                    out[seg.offset : seg.offset + seg.nbytes] = block[: seg.nbytes]
        return out

    def _decode_block(
        self,
        index: int,
        stripe: _Stripe,
        position: int,
        recipe: Recipe,
        shards: Mapping[int, BytesLike],
        regions: Mapping[int, BytesLike],
    ) -> np.ndarray:
        segs = set(recipe.segments)
        blocks: list[np.ndarray] = []
        nums: list[int] = []
        for d, (mem, seg_index) in enumerate(stripe.data):
            seg = self._segment(mem, seg_index)
            if d != position and seg in segs:
                data = codec.u8(shards[seg.rank]) if seg.nbytes else np.empty(0, np.uint8)
                blocks.append(data[seg.offset : seg.offset + seg.nbytes])
                nums.append(d)
        k = self.redundancy.k
        for p in range(len(stripe.holders)):
            rid = self._parity_id(index, p)
            if rid in recipe.region_ids and len(blocks) < k:
                blocks.append(codec.u8(regions[rid]))
                nums.append(k + p)
        assert len(blocks) == k, (index, nums)
        if self.redundancy.kind == "xor":
            out = np.zeros(self.segment_nbytes, np.uint8)
            codec.xor_into(out, blocks)
            return out
        padded = codec.padded(blocks, self.segment_nbytes)
        decoded = codec.decoder(k, k + self.redundancy.m).decode(padded, nums)
        return np.frombuffer(decoded[position], np.uint8)


def group_layouts(
    topology: Topology, red: Redundancy, shard_nbytes: Mapping[int, int]
) -> dict[int, GroupLayout]:
    """The ``GroupLayout`` of every rank's group, keyed by rank."""
    out: dict[int, GroupLayout] = {}
    for group in coding_groups(topology, red):
        layout = GroupLayout(red, group, tuple(shard_nbytes[r] for r in group))
        for r in group:
            out[r] = layout
    return out
