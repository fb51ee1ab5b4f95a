"""Recovery coordinator: exhaustive node-loss combinations per policy, crashes, corruption."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from baft.recover.coordinator import (
    LocatedInventory,
    StoreRef,
    TopologyMismatchError,
    coordinate,
    coordinate_located,
)
from baft.store.coding import Redundancy, coding_groups
from baft.store.manifest import RankInventory
from baft.topology import Topology
from tests.unit.test_store_support import fake_inventories

T4 = Topology(num_dp=4, ranks_per_node=1)  # 4 nodes x 1 rank
T22 = Topology(num_pp=2, num_dp=2, ranks_per_node=2)  # 2 nodes x 2 ranks
CASES = [
    (T4, p) for p in ("none", "replicate:1", "replicate:3", "xor:2", "xor:4", "rs:2+2", "rs:3+1")
] + [(T22, p) for p in ("none", "replicate:1", "xor:2", "rs:1+1")]


def _expected_sources(topo: Topology, red: Redundancy, lost_nodes: tuple[int, ...]):
    """Independent rule: recoverable iff no group loses more members than it tolerates."""
    lost = {r for r in range(topo.world_size) if topo.node_of(r) in lost_nodes}
    expect: dict[int, tuple[str, tuple[int, ...] | None]] = {}
    for group in coding_groups(topo, red):
        gone = [r for r in group if r in lost]
        if len(gone) > red.tolerance:
            return None
        for i, r in enumerate(group):
            if r not in lost:
                expect[r] = ("local", (r,))
            elif red.kind == "replicate":
                after = [group[(i + s) % len(group)] for s in range(1, len(group))]
                expect[r] = ("replica", (next(h for h in after if h not in lost),))
            else:
                expect[r] = ("parity", None)
    return expect


@pytest.mark.parametrize("topo,policy", CASES, ids=[f"{t.num_nodes}n-{p}" for t, p in CASES])
def test_every_combination_of_lost_nodes(topo: Topology, policy: str):
    red = Redundancy.parse(policy)
    for num_lost in range(topo.num_nodes + 1):
        for lost_nodes in itertools.combinations(range(topo.num_nodes), num_lost):
            invs = fake_inventories(topo, red, (40, 41), committed=41, lost_nodes=lost_nodes)
            lost = {r for r, inv in invs.items() if inv is None}
            expect = _expected_sources(topo, red, lost_nodes)
            for persisted in ((), (30,)):
                plan, reason = coordinate(topo, red, invs, persisted)
                case = (policy, lost_nodes, persisted, reason)
                if expect is None:
                    assert plan.source == ("disk" if persisted else "fresh"), case
                    assert plan.version == (30 if persisted else None), case
                    assert plan.shards == {} and plan.transfers == ()
                    assert ("from disk" if persisted else "fresh start") in reason, case
                    if len(lost) == topo.world_size:
                        assert "no snapshot in any store" in reason, case
                    elif lost:
                        assert "v=41 cannot be rebuilt" in reason, case
                    continue
                assert (plan.version, plan.source) == (41, "memory"), case
                got = {
                    r: (s.kind, s.holders if s.kind != "parity" else None)
                    for r, s in plan.shards.items()
                }
                assert got == expect, case
                assert {d.rank for d in plan.decodes} == {
                    r for r, e in expect.items() if e[0] == "parity"
                }
                assert all(t.dst_rank in lost and t.src_rank not in lost for t in plan.transfers)
                assert all(t.nbytes > 0 for t in plan.transfers)
                assert reason.startswith("v=41 from memory: ")
                for r in lost:
                    assert f"rank {r} (store lost with node {topo.node_of(r)})" in reason, case


def test_parity_plan_details_xor4_lose_node2():
    red = Redundancy.parse("xor:4")
    invs = fake_inventories(T4, red, (40, 41), committed=41, lost_nodes=(2,))
    plan, reason = coordinate(T4, red, invs)
    src = plan.shards[2]
    assert (src.kind, src.holders) == ("parity", (0, 1, 3))
    (decode,) = plan.decodes
    assert decode.rank == 2 and decode.layout.members == (0, 1, 2, 3)
    # rank 2 has 3 segments; each stripe needs the other 2 data segments + 1 parity block
    assert len(decode.recipe.segments) == 6 and len(decode.recipe.region_ids) == 3
    assert sum(t.nbytes for t in plan.transfers) == 9 * decode.layout.segment_nbytes - sum(
        decode.layout.segment_nbytes - s.nbytes for s in decode.recipe.segments
    )
    assert all(t.src_slot == 41 % 2 for t in plan.transfers)
    assert plan.shard_nbytes == {0: 1000, 1: 1037, 2: 1074, 3: 1111}
    assert reason == (
        "v=41 from memory: ranks 0,1,3 local; rank 2 (store lost with node 2) "
        "rebuilt from xor:4 parity using ranks 0,1,3"
    )


def test_process_crash_only_takes_newest_complete_everywhere():
    red = Redundancy.parse("xor:2")
    invs = fake_inventories(T4, red, (41, 42), committed=41)
    plan, reason = coordinate(T4, red, invs)
    assert (plan.version, plan.source, plan.transfers, plan.decodes) == (42, "memory", (), ())
    assert all(s.kind == "local" and s.slot == 0 for s in plan.shards.values())
    assert reason == "v=42 from memory: ranks 0,1,2,3 local"


@pytest.mark.parametrize(
    "override,why",
    [
        (
            {"state": "writing"},
            "v=42 (newer than committed v=41) was incomplete on rank 3 (writing)",
        ),
        ({"absent": True}, "v=42 (newer than committed v=41) was absent on rank 3"),
        ({"data_ok": False}, "v=42 (newer than committed v=41) was corrupt on rank 3"),
        ({"bad_regions": (0,)}, "v=42 (newer than committed v=41) was corrupt on rank 3"),
    ],
)
def test_in_flight_version_incomplete_on_one_rank(override: dict, why: str):
    red = Redundancy.parse("rs:2+2")
    invs = fake_inventories(T4, red, (41, 42), committed=41, overrides={(3, 42): override})
    plan, reason = coordinate(T4, red, invs)
    assert (plan.version, plan.source) == (41, "memory")
    assert all(s.kind == "local" and s.slot == 1 for s in plan.shards.values())
    assert reason == f"v=41 from memory: ranks 0,1,2,3 local; {why}"


def test_uncommitted_version_with_a_lost_node_counts_when_rebuildable():
    red = Redundancy.parse("xor:4")
    invs = fake_inventories(T4, red, (41, 42), committed=41, lost_nodes=(1,))
    plan, _ = coordinate(T4, red, invs)
    assert plan.version == 42 and plan.shards[1].kind == "parity"


def test_corrupted_shard_rebuilt_from_parity_on_a_live_node():
    red = Redundancy.parse("xor:4")
    invs = fake_inventories(
        T4, red, (40, 41), committed=41, overrides={(1, 41): {"data_ok": False}}
    )
    plan, reason = coordinate(T4, red, invs)
    assert plan.version == 41
    assert (plan.shards[1].kind, plan.shards[1].holders) == ("parity", (0, 2, 3))
    assert "rank 1 (shard failed its checksum) rebuilt from xor:4 parity" in reason


def test_corrupted_shard_without_redundancy_falls_back_to_older_committed_version():
    red = Redundancy.parse("none")
    invs = fake_inventories(
        T4, red, (40, 41), committed=41, overrides={(1, 41): {"data_ok": False}}
    )
    plan, reason = coordinate(T4, red, invs)
    assert (plan.version, plan.source) == (40, "memory")
    assert reason == (
        "v=40 from memory: ranks 0,1,2,3 local; v=41 cannot be rebuilt: rank 1: "
        "redundancy none keeps no copy outside its own store"
    )


def test_corrupt_parity_plus_lost_node_beyond_tolerance_uses_older_version():
    red = Redundancy.parse("xor:4")
    invs = fake_inventories(
        T4, red, (40, 41), committed=41, lost_nodes=(2,), overrides={(0, 41): {"bad_regions": (0,)}}
    )
    plan, reason = coordinate(T4, red, invs)
    assert plan.version == 40 and plan.shards[2].kind == "parity"
    assert "v=41 cannot be rebuilt: rank 2 (xor:4): stripe 0 has 2 of the 3 blocks" in reason
    assert "parity block 0 at rank 0" in reason


def test_replica_holder_order_and_mixed_commit_records():
    red = Redundancy.parse("replicate:3")
    invs = fake_inventories(T4, red, (41, 42), committed=41, lost_nodes=(0, 1))
    inv2 = invs[2]
    assert inv2 is not None
    invs[2] = type(inv2)(inv2.rank, inv2.node, 42, inv2.versions)  # crash mid-commit
    plan, reason = coordinate(T4, red, invs)
    assert plan.version == 42
    assert [(plan.shards[r].kind, plan.shards[r].holders) for r in (0, 1)] == [
        ("replica", (2,)),
        ("replica", (2,)),
    ]
    assert [(t.src_rank, t.dst_rank, t.kind) for t in plan.transfers] == [
        (2, 0, "region"),
        (2, 1, "region"),
    ]
    assert "rank 0 (store lost with node 0) copied from the replicate:3 replica on rank 2" in reason


def test_newer_persisted_version_beats_older_memory_version():
    red = Redundancy.parse("none")
    invs = fake_inventories(
        T4, red, (40, 41), committed=41, overrides={(1, 41): {"data_ok": False}}
    )
    plan, reason = coordinate(T4, red, invs, persisted_versions=(20, 41))
    assert (plan.version, plan.source) == (41, "disk")
    assert "v=40 from memory is older than persisted v=41" in reason


def test_nothing_anywhere_is_a_fresh_start_and_other_topology_is_an_error():
    red = Redundancy.parse("xor:2")
    plan, reason = coordinate(T4, red, {r: None for r in range(4)})
    assert (plan.version, plan.source) == (None, "fresh")
    assert (
        reason
        == "fresh start: nothing recoverable from memory (no snapshot in any store) and nothing persisted"
    )
    other = Topology(num_pp=4, ranks_per_node=1)
    invs = fake_inventories(other, red, (5,), committed=5)
    with pytest.raises(
        TopologyMismatchError,
        match="written under pp=4 dp=1 tp=1, but this job runs pp=1 dp=4 tp=1",
    ):
        coordinate(T4, red, invs)


def test_policy_change_is_reported():
    invs = fake_inventories(T4, Redundancy.parse("xor:2"), (5,), committed=5)
    plan, reason = coordinate(T4, Redundancy.parse("rs:2+2"), invs)
    assert plan.version == 5 and reason.endswith("written with xor:2 (current policy rs:2+2)")


# ------------------------------------------------------- shards wherever they physically are
def _located(
    invs: dict[int, RankInventory | None], where: dict[int, tuple[str, int]]
) -> list[LocatedInventory]:
    """Place logical shard r's store on host ``where[r][0]`` in directory node ``where[r][1]``."""
    return [
        LocatedInventory(StoreRef(where[r][0], where[r][1], r), inv)
        for r, inv in invs.items()
        if inv is not None and r in where
    ]


T22H = Topology(num_dp=4, ranks_per_node=2)  # nodes {0,1} and {2,3}


def test_renumbered_ranks_move_shards_from_the_host_that_holds_them():
    red = Redundancy.parse("xor:2")
    invs = fake_inventories(T22H, red, (40, 41), committed=41)
    located = _located(invs, {0: ("a", 0), 1: ("a", 0), 2: ("b", 1), 3: ("b", 1)})
    hosts = {0: "b", 1: "a", 2: "a", 3: "b"}  # the new numbering interleaves the hosts
    plan, reason = coordinate_located(T22H, red, located, hosts)
    assert (plan.version, plan.source) == (41, "memory")
    got = {r: (s.kind, s.holders, str(s.store)) for r, s in plan.shards.items()}
    assert got == {
        0: ("remote", (1,), "a:node0/rank0"),  # on a, read there by its lowest rank (1)
        1: ("local", (1,), "a:node0/rank1"),
        2: ("remote", (0,), "b:node1/rank2"),
        3: ("local", (3,), "b:node1/rank3"),
    }
    assert [(t.src_rank, t.dst_rank, t.kind, t.offset, t.nbytes) for t in plan.transfers] == [
        (1, 0, "shard", 0, 1000),
        (0, 2, "shard", 0, 1074),
    ]
    assert plan.decodes == ()
    assert "rank 0 (on host b) moved from store a:node0/rank0 by rank 1" in reason


def test_shard_in_another_rank_directory_of_the_same_host_is_read_locally():
    red = Redundancy.parse("xor:2")
    invs = fake_inventories(T22H, red, (41,), committed=41)
    # rank 1's store sits under node 5 (an older node numbering) on the host rank 1 runs on
    located = _located(invs, {0: ("a", 0), 1: ("a", 5), 2: ("b", 1), 3: ("b", 1)})
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    plan, reason = coordinate_located(T22H, red, located, hosts)
    assert all(s.kind == "local" for s in plan.shards.values()) and plan.transfers == ()
    assert plan.shards[1].store == StoreRef("a", 5, 1)
    assert "rank 1 read from store a:node5/rank1 on its host" in reason


def test_lost_host_with_renumbered_survivor_rebuilds_from_its_parity():
    red = Redundancy.parse("xor:2")  # groups {0,2} and {1,3} across the two nodes
    invs = fake_inventories(T22H, red, (40, 41), committed=41)
    located = _located(invs, {2: ("b", 1), 3: ("b", 1)})  # host a is gone
    hosts = {0: "b", 1: "b", 2: "c", 3: "c"}  # replacement c sorted first... got 2,3
    plan, reason = coordinate_located(T22H, red, located, hosts)
    assert {r: s.kind for r, s in plan.shards.items()} == {
        0: "parity",
        1: "parity",
        2: "remote",
        3: "remote",
    }
    # ranks 0 and 1 run on b, where every decode input sits: they read it themselves
    assert {(t.src_rank, t.dst_rank) for t in plan.transfers if t.dst_rank < 2} == {
        (0, 0),
        (1, 1),
    }
    assert {(t.src_rank, t.dst_rank) for t in plan.transfers if t.dst_rank >= 2} == {
        (0, 2),
        (0, 3),
    }
    assert "rank 0 (store lost with node 0) rebuilt from xor:2 parity" in reason


def test_mixed_old_and_new_stores_pick_the_copy_that_holds_the_version():
    """Logical shard 1 has an old store (v40 only, host b, left by an earlier numbering)
    and its current one (v40 and v41, host a): v41 is restored from the current one; v40
    alone would prefer the copy on rank 1's own host."""
    red = Redundancy.parse("replicate:1")
    invs = fake_inventories(T22H, red, (40, 41), committed=41)
    old = fake_inventories(T22H, red, (40,), committed=40)[1]
    assert old is not None
    located = _located(invs, {0: ("a", 0), 1: ("a", 0), 2: ("b", 1), 3: ("b", 1)})
    located.append(LocatedInventory(StoreRef("b", 0, 1), old))
    hosts = {0: "a", 1: "b", 2: "b", 3: "a"}
    plan, _ = coordinate_located(T22H, red, located, hosts)
    assert plan.version == 41
    assert (plan.shards[1].kind, str(plan.shards[1].store)) == ("remote", "a:node0/rank1")
    invs40 = fake_inventories(T22H, red, (40,), committed=40)
    located40 = _located(invs40, {0: ("a", 0), 1: ("a", 0), 2: ("b", 1), 3: ("b", 1)})
    located40.append(LocatedInventory(StoreRef("b", 0, 1), old))
    plan, _ = coordinate_located(T22H, red, located40, hosts)
    assert (plan.shards[1].kind, str(plan.shards[1].store)) == ("local", "b:node0/rank1")
    copies = [loc for loc in located if loc.store != StoreRef("a", 0, 1)]  # current lost
    plan, _ = coordinate_located(T22H, red, copies, hosts)
    # v41 of shard 1 survives only as the replica on its partner; v41 still wins
    assert plan.version == 41 and plan.shards[1].kind == "replica"


def test_stores_on_a_host_without_ranks_are_not_counted_and_duplicates_merge():
    red = Redundancy.parse("xor:2")
    invs = fake_inventories(T22H, red, (41,), committed=41)
    located = _located(invs, {0: ("a", 0), 1: ("a", 0), 2: ("b", 1), 3: ("b", 1)})
    located += located  # two ranks of a host both reported its stores
    plan, _ = coordinate_located(T22H, red, located, {0: "a", 1: "a", 2: "c", 3: "c"})
    # host b runs no rank now: its shards are as good as lost, rebuilt from a's parity
    assert {r: s.kind for r, s in plan.shards.items()} == {
        0: "local",
        1: "local",
        2: "parity",
        3: "parity",
    }


def test_a_shard_whose_coordinates_disagree_with_the_topology_is_an_error():
    red = Redundancy.parse("xor:2")
    invs = fake_inventories(T22H, red, (41,), committed=41)
    inv = invs[1]
    assert inv is not None
    bad = [
        dataclasses.replace(v, manifest=dataclasses.replace(v.manifest, coords=(0, 3, 0)))
        for v in inv.versions
        if v.manifest is not None
    ]
    invs[1] = dataclasses.replace(inv, versions=tuple(bad))
    with pytest.raises(TopologyMismatchError, match=r"\(pp, dp, tp\)=\(0, 3, 0\)"):
        coordinate(T22H, red, invs)
