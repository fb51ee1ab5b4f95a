"""Real stores, pure coordinator: checkpoint, lose nodes / corrupt a shard, plan the restore.

Executing the plans (peer transfers, replica copies, decoding) is the restore runtime's
job and is tested through the runtime itself over real gloo, for the same cases, in
``tests/dist/test_restore_codes.py``.
"""

from __future__ import annotations

import pytest

from baft.recover.coordinator import coordinate
from baft.store.coding import Redundancy
from baft.topology import Topology
from tests.unit.test_store_support import (
    open_stores,
    random_shards,
    shard_sizes,
    shm_dir,
    write_version,
)

T4 = Topology(num_dp=4, ranks_per_node=1)


@pytest.mark.parametrize(
    "policy,lost_nodes",
    [
        ("replicate:1", (1,)),
        ("replicate:3", (0, 2, 3)),
        ("xor:2", (0, 3)),
        ("xor:4", (2,)),
        ("rs:2+2", (1, 3)),
        ("rs:3+1", (0,)),
    ],
)
def test_lose_nodes_then_plan_the_committed_version(policy: str, lost_nodes):
    red = Redundancy.parse(policy)
    sizes = shard_sizes(T4)
    with shm_dir() as root:
        stores, layouts = open_stores(root, T4, red, sizes)
        write_version(stores, layouts, T4, 1, random_shards(sizes, 1))
        v2 = random_shards(sizes, 2)
        write_version(stores, layouts, T4, 2, v2)
        # v3 in flight: data partly written everywhere, never completed
        for s in stores.values():
            s.data_view(s.begin(3))[:10] = 0xAB
        for node in lost_nodes:
            stores[node].destroy()  # one rank per node in T4
        survivors = {r: s for r, s in stores.items() if r not in lost_nodes}
        invs = {r: (s.inventory() if r in survivors else None) for r, s in stores.items()}
        plan, reason = coordinate(T4, red, invs)
        assert (plan.version, plan.source) == (2, "memory"), reason
        assert "v=3 (newer than committed v=2) was incomplete on rank" in reason
        rebuilt = "replica" if red.kind == "replicate" else "parity"
        assert {r: s.kind for r, s in plan.shards.items()} == {
            r: rebuilt if r in lost_nodes else "local" for r in range(4)
        }
        assert {d.rank for d in plan.decodes} == (set(lost_nodes) if rebuilt == "parity" else set())
        # every transfer reads a surviving store's committed slot of v2
        for t in plan.transfers:
            assert t.src_rank in survivors and t.dst_rank in lost_nodes
            m = survivors[t.src_rank].read_manifest(t.src_slot)
            assert m is not None and m.version == 2


def test_segments_of_one_shard_are_placed_at_their_offsets():
    red = Redundancy.parse("xor:4")
    sizes = shard_sizes(T4)
    with shm_dir() as root:
        stores, layouts = open_stores(root, T4, red, sizes)
        v1 = random_shards(sizes, 7)
        write_version(stores, layouts, T4, 1, v1)
        stores[2].destroy()
        invs = {r: (s.inventory() if r != 2 else None) for r, s in stores.items()}
        plan, _ = coordinate(T4, red, invs)
        per_src: dict[int, list[int]] = {}
        for t in plan.transfers:
            if t.kind == "shard":
                per_src.setdefault(t.src_rank, []).append(t.offset)
        assert all(len(v) == 2 for v in per_src.values())
        assert sorted(per_src) == [0, 1, 3]
        (decode,) = plan.decodes
        assert decode.rank == 2 and plan.shards[2].kind == "parity"


def test_flipped_byte_on_live_rank_is_planned_from_replica():
    red = Redundancy.parse("replicate:1")
    sizes = shard_sizes(T4)
    with shm_dir() as root:
        stores, layouts = open_stores(root, T4, red, sizes)
        v5 = random_shards(sizes, 5)
        slots = write_version(stores, layouts, T4, 5, v5)
        stores[3].data_view(slots[3])[17] ^= 0x80
        invs = {r: s.inventory() for r, s in stores.items()}
        assert invs[3] is not None and not invs[3].versions[0].data_ok
        plan, reason = coordinate(T4, red, invs)
        assert plan.shards[3].kind == "replica" and plan.shards[3].holders == (2,)
        assert (
            "rank 3 (shard failed its checksum) copied from the replicate:1 replica on rank 2"
            in reason
        )
        assert {r: s.kind for r, s in plan.shards.items()} == {
            0: "local",
            1: "local",
            2: "local",
            3: "replica",
        }
