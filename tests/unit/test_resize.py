"""Restores into another DP degree (elastic replicas): which stores, who plays whom (pure)."""

from __future__ import annotations

import pytest

from baft.recover.coordinator import (
    LocatedInventory,
    StoreRef,
    TopologyMismatchError,
    coordinate_located,
)
from baft.recover.resize import plan_resize
from baft.store.coding import Redundancy
from baft.topology import Topology
from tests.unit.test_store_support import fake_inventories

XOR = Redundancy.parse("xor:2")
OLD4 = Topology(num_pp=2, num_dp=2, ranks_per_node=2)  # host a: ranks 0,1; host b: 2,3
NEW2 = Topology(num_pp=2, num_dp=1, ranks_per_node=2)  # host a only


def _located(
    topo: Topology, versions: tuple[int, ...], hosts: str, lost: tuple[int, ...] = ()
) -> list[LocatedInventory]:
    red = XOR if topo.num_nodes > 1 else Redundancy.parse("none")  # shrunk to one host
    invs = fake_inventories(topo, red, versions, committed=max(versions), lost_nodes=lost)
    return [
        LocatedInventory(StoreRef(hosts[topo.node_of(r)], topo.node_of(r), r), inv)
        for r, inv in invs.items()
        if inv is not None
    ]


def test_a_lost_host_is_rebuilt_by_the_survivors_playing_its_ranks() -> None:
    stores = _located(OLD4, (40, 41), "ab", lost=(1,))
    resize, kept, note = plan_resize(NEW2, 2, stores, {0: "a", 1: "a"})
    assert resize is not None and note == "" and len(kept) == 2
    # (pp, dp) -> current rank (pp, dp // 2): replicas 0 and 1 of a stage on one rank
    assert dict(resize.to_physical) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert resize.played_by(1) == [2, 3] and resize.stage_shards(NEW2, 1) == [2, 3]
    plan, reason = coordinate_located(resize.old, resize.redundancy, kept, dict(resize.hosts))
    assert (plan.source, plan.version) == ("memory", 41), reason
    assert {r: s.kind for r, s in plan.shards.items()} == {
        0: "local",
        1: "local",
        2: "parity",
        3: "parity",
    }
    # every byte stays on host a: a logical rank's sender is played there
    assert all(resize.hosts[t.src_rank] == "a" for t in plan.transfers)
    assert "rebuilt for dp=1" in resize.describe(NEW2)


def test_a_grow_gives_the_new_ranks_nothing_to_play() -> None:
    old = Topology(num_pp=2, num_dp=1, ranks_per_node=2)
    stores = _located(old, (50,), "a")
    resize, kept, _ = plan_resize(OLD4, 2, stores, {0: "a", 1: "a", 2: "b", 3: "b"})
    assert resize is not None
    assert dict(resize.to_physical) == {0: 0, 1: 2}  # (pp1, dp0) is rank 2 now, on host b
    assert resize.played_by(1) == [] and resize.played_by(3) == []
    assert resize.stage_shards(OLD4, 3) == [1]  # rank 3 (pp1, dp1) takes rank 2's shard
    plan, reason = coordinate_located(resize.old, resize.redundancy, kept, dict(resize.hosts))
    assert (plan.source, plan.version) == ("memory", 50), reason
    assert plan.shards[1].kind == "remote"  # moved from host a's memory to host b


def test_the_degree_holding_the_newest_version_wins() -> None:
    stale = _located(OLD4, (41,), "ab")  # host b came back with the 4-rank job's stores
    newer = _located(Topology(num_pp=2, num_dp=1, ranks_per_node=2), (60,), "a")
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    resize, kept, note = plan_resize(OLD4, 2, stale + newer, hosts)
    assert resize is not None and resize.old.num_dp == 1
    assert kept == newer and "dp=2 set aside" in note and "v60" in note
    same, kept, note = plan_resize(OLD4, 2, stale, hosts)
    assert same is None and kept == stale and note == ""


def test_other_pipeline_sizes_are_left_to_the_coordinator_to_refuse() -> None:
    other = _located(Topology(num_pp=4, num_dp=1, ranks_per_node=2), (7,), "ab")
    resize, kept, _ = plan_resize(NEW2, 2, other, {0: "a", 1: "a"})
    assert resize is None and kept == other
    with pytest.raises(TopologyMismatchError):
        coordinate_located(NEW2, XOR, kept, {0: "a", 1: "a"})


def test_degrees_that_do_not_divide_the_replicas_are_refused() -> None:
    stores = _located(OLD4, (41,), "ab")
    with pytest.raises(TopologyMismatchError, match="must divide the elastic replicas"):
        plan_resize(NEW2, 3, stores, {0: "a", 1: "a"})
