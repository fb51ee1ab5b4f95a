"""Erasure coding: policies, groups, stripe layout, bit-exact round trips (hypothesis)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baft.store.coding import (
    GroupLayout,
    Redundancy,
    UnrecoverableError,
    coding_groups,
    group_layouts,
)
from baft.topology import Topology

POLICIES = ["replicate:1", "replicate:2", "xor:2", "xor:3", "xor:4", "rs:2+1", "rs:2+2", "rs:4+2"]


@pytest.mark.parametrize(
    "text,kind,k,m,size,tol",
    [
        ("none", "none", 1, 0, 1, 0),
        ("replicate:1", "replicate", 1, 1, 2, 1),
        ("replicate:3", "replicate", 1, 3, 4, 3),
        ("xor:2", "xor", 1, 1, 2, 1),
        ("xor:4", "xor", 3, 1, 4, 1),
        ("rs:4+2", "rs", 4, 2, 6, 2),
    ],
)
def test_parse_properties_and_round_trip(text: str, kind: str, k: int, m: int, size: int, tol: int):
    red = Redundancy.parse(text)
    assert (red.kind, red.k, red.m, red.group_size, red.tolerance) == (kind, k, m, size, tol)
    assert str(red) == text
    assert Redundancy.parse(str(red)) == red


@pytest.mark.parametrize(
    "text",
    [
        "",
        "raid5",
        "replicate",
        "replicate:0",
        "xor:1",
        "xor:x",
        "rs:2",
        "rs:0+1",
        "rs:2+0",
        "none:1",
    ],
)
def test_parse_errors_explain_the_format(text: str):
    with pytest.raises(ValueError, match="rs:K\\+M"):
        Redundancy.parse(text)


def test_coding_groups_members_on_distinct_nodes():
    topo = Topology(num_pp=2, num_dp=2, num_tp=2, ranks_per_node=2)  # 4 nodes
    assert coding_groups(topo, Redundancy.parse("xor:4")) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert coding_groups(topo, Redundancy.parse("replicate:1")) == (
        (0, 2),
        (1, 3),
        (4, 6),
        (5, 7),
    )
    assert coding_groups(topo, Redundancy.parse("none")) == tuple((r,) for r in range(8))


@pytest.mark.parametrize("text", ["xor:3", "rs:4+2", "replicate:4"])
def test_coding_groups_reject_bad_sizes(text: str):
    topo = Topology(num_dp=4, ranks_per_node=1)
    with pytest.raises(ValueError, match="divides 4"):
        coding_groups(topo, Redundancy.parse(text))


def test_stripe_layout_each_segment_in_exactly_one_stripe():
    red = Redundancy.parse("rs:4+2")
    layout = GroupLayout(red, (10, 11, 12, 13, 14, 15), (64, 64, 64, 64, 64, 64))
    assert layout.segment_nbytes == 16
    seen: dict[int, list[int]] = {r: [] for r in layout.members}
    for region in layout.all_regions():
        if region.block == 0:
            for seg in region.sources:
                seen[seg.rank].append(seg.offset)
        assert region.holder not in {s.rank for s in region.sources}
    assert {r: sorted(v) for r, v in seen.items()} == {r: [0, 16, 32, 48] for r in layout.members}
    # stripe 0: holders members 0,1; contributors members 2..5
    r0 = [r for r in layout.all_regions() if r.stripe == 0]
    assert [(r.holder, r.block) for r in r0] == [(10, 0), (11, 1)]
    assert [s.rank for s in r0[0].sources] == [12, 13, 14, 15]
    assert all(layout.redundancy_nbytes(r) == 2 * 16 for r in layout.members)
    # regions of a member tile its redundancy area
    for r in layout.members:
        offs = [(g.offset, g.nbytes) for g in layout.regions(r)]
        assert offs == [(0, 16), (16, 16)]


def test_replicate_layout_and_transfers():
    layout = GroupLayout(Redundancy.parse("replicate:2"), (0, 4, 8), (5, 7, 0))
    assert [layout.redundancy_nbytes(r) for r in (0, 4, 8)] == [7, 5, 12]
    assert sorted((t.src_rank, t.dst_rank, t.nbytes) for t in layout.transfers()) == [
        (0, 4, 5),
        (0, 8, 5),
        (4, 0, 7),
        (4, 8, 7),
    ]


def test_xor_transfers_and_encode_into_out_slice():
    red = Redundancy.parse("xor:3")
    layout = GroupLayout(red, (0, 1, 2), (10, 16, 3))
    assert layout.segment_nbytes == 8
    shards = {
        0: np.arange(10, dtype=np.uint8),
        1: np.arange(100, 116, dtype=np.uint8),
        2: np.array([7, 8, 9], np.uint8),
    }
    area = np.full(layout.redundancy_nbytes(1) + 3, 0xEE, np.uint8)
    (region,) = layout.regions(1)
    ins = [np.zeros(s.nbytes, np.uint8) for s in region.sources]
    for t in layout.transfers():
        assert t.src_rank != t.dst_rank and t.nbytes > 0
        if t.dst_region_id == region.region_id:
            ins[t.input_index][:] = shards[t.src_rank][t.src_offset : t.src_offset + t.nbytes]
    layout.encode(region.region_id, ins, out=area[1 : 1 + region.nbytes])
    expect = np.zeros(8, np.uint8)
    for seg in region.sources:
        expect[: seg.nbytes] ^= shards[seg.rank][seg.offset : seg.offset + seg.nbytes]
    assert area[1 : 1 + 8].tobytes() == expect.tobytes()
    assert area[0] == 0xEE and area[9] == 0xEE


def _encode_all(layout: GroupLayout, shards: dict[int, bytes]) -> dict[int, np.ndarray]:
    regions = {}
    for region in layout.all_regions():
        ins = [shards[s.rank][s.offset : s.offset + s.nbytes] for s in region.sources]
        regions[region.region_id] = layout.encode(region.region_id, ins)
    return regions


def _survivors(layout, shards, regions, lost):
    alive = {r: b for r, b in shards.items() if r not in lost}
    regs = {i: b for i, b in regions.items() if layout.region(i).holder not in lost}
    return alive, regs


@st.composite
def _case(draw, policy: str):
    red = Redundancy.parse(policy)
    sizes = draw(st.lists(st.integers(0, 300), min_size=red.group_size, max_size=red.group_size))
    seed = draw(st.integers(0, 2**32 - 1))
    num_lost = draw(st.integers(1, red.tolerance))
    lost_idx = draw(st.permutations(range(red.group_size)))[:num_lost]
    return red, sizes, seed, lost_idx


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_round_trip_up_to_tolerance(policy: str, data):
    red, sizes, seed, lost_idx = data.draw(_case(policy))
    members = tuple(range(3, 3 + red.group_size))
    layout = GroupLayout(red, members, tuple(sizes))
    rng = np.random.default_rng(seed)
    shards = {
        r: rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for r, n in zip(members, sizes[: red.group_size], strict=True)
    }
    regions = _encode_all(layout, shards)
    lost = {members[i] for i in lost_idx}
    alive, regs = _survivors(layout, shards, regions, lost)
    for target in lost:
        assert layout.rebuild(target, alive, regs).tobytes() == shards[target]


@pytest.mark.parametrize("policy", POLICIES)
def test_beyond_tolerance_raises_and_names_missing_blocks(policy: str):
    red = Redundancy.parse(policy)
    members = tuple(range(red.group_size))
    n = red.k * 8 * 3  # every segment full: no known-zero blocks help
    layout = GroupLayout(red, members, (n,) * red.group_size)
    rng = np.random.default_rng(1)
    shards = {r: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for r in members}
    regions = _encode_all(layout, shards)
    for lost in itertools.combinations(members, red.tolerance + 1):
        alive, regs = _survivors(layout, shards, regions, set(lost))
        for target in lost:
            with pytest.raises(UnrecoverableError) as err:
                layout.rebuild(target, alive, regs)
            assert err.value.missing


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=15, deadline=None)
@given(
    sizes_seed=st.tuples(st.lists(st.integers(0, 100), min_size=6, max_size=6), st.integers(0, 99))
)
def test_beyond_tolerance_never_returns_wrong_bytes(policy: str, sizes_seed):
    sizes, seed = sizes_seed
    red = Redundancy.parse(policy)
    members = tuple(range(red.group_size))
    layout = GroupLayout(red, members, tuple(sizes[: red.group_size]))
    rng = np.random.default_rng(seed)
    shards = {
        r: rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for r, n in zip(members, sizes[: red.group_size], strict=True)
    }
    regions = _encode_all(layout, shards)
    lost = set(members[: red.tolerance + 1])
    alive, regs = _survivors(layout, shards, regions, lost)
    for target in lost:
        try:
            got = layout.rebuild(target, alive, regs).tobytes()
        except UnrecoverableError:
            continue
        assert got == shards[target]


def test_corrupt_region_alone_is_routed_around_with_rs():
    red = Redundancy.parse("rs:2+2")
    members = (0, 1, 2, 3)
    layout = GroupLayout(red, members, (40, 33, 48, 1))
    rng = np.random.default_rng(5)
    shards = {
        r: rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for r, n in zip(members, layout.shard_nbytes, strict=True)
    }
    regions = _encode_all(layout, shards)
    alive, regs = _survivors(layout, shards, regions, {0})
    # drop one more parity region (as if its checksum failed) and lose a second shard
    first = layout.regions(2)[0].region_id
    del regs[first]
    del alive[1]
    assert layout.rebuild(0, alive, regs).tobytes() == shards[0]


def test_none_is_never_rebuildable():
    layout = GroupLayout(Redundancy.parse("none"), (7,), (10,))
    assert layout.redundancy_nbytes(7) == 0 and layout.transfers() == []
    with pytest.raises(UnrecoverableError, match="none"):
        layout.rebuild(7, {}, {})


def test_group_layouts_and_digest():
    topo = Topology(num_dp=4, ranks_per_node=1)
    red = Redundancy.parse("xor:2")
    layouts = group_layouts(topo, red, {0: 10, 1: 20, 2: 30, 3: 40})
    assert layouts[0] is layouts[1] and layouts[2].members == (2, 3)
    assert layouts[0].digest() != layouts[2].digest()
    assert layouts[0].digest() == GroupLayout(red, (0, 1), (10, 20)).digest()
    with pytest.raises(ValueError, match="needs 2 members"):
        GroupLayout(red, (0, 1, 2), (1, 1, 1))
