"""End to end on real stores: checkpoint, lose nodes / corrupt a shard, coordinate, rebuild."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from baft.recover.coordinator import RecoveryPlan, coordinate
from baft.store.coding import Redundancy
from baft.store.shm import SnapshotStore
from baft.topology import Topology
from tests.unit.test_store_support import (
    open_stores,
    random_shards,
    shard_sizes,
    shm_dir,
    write_version,
)

T4 = Topology(num_dp=4, ranks_per_node=1)


def execute(plan: RecoveryPlan, stores: Mapping[int, SnapshotStore]) -> dict[int, bytes]:
    """What a restore runtime does, with direct reads instead of gloo sends."""
    shards: dict[int, dict[int, np.ndarray]] = {}  # receiver -> sender -> full-size scratch
    regions: dict[int, dict[int, np.ndarray]] = {}  # receiver -> region id -> bytes
    for t in plan.transfers:
        src = stores[t.src_rank]
        if t.kind == "shard":
            scratch = shards.setdefault(t.dst_rank, {}).setdefault(
                t.src_rank, np.zeros(plan.shard_nbytes[t.src_rank], np.uint8)
            )
            piece = src.data_view(t.src_slot)[t.offset : t.offset + t.nbytes]
            scratch[t.offset : t.offset + t.nbytes] = piece
        else:
            piece = src.red_view(t.src_slot)[t.offset : t.offset + t.nbytes]
            regions.setdefault(t.dst_rank, {})[t.region_id] = piece.copy()
    out = {}
    for rank, source in plan.shards.items():
        if source.kind == "local":
            assert source.slot is not None
            out[rank] = stores[rank].data_view(source.slot)[: plan.shard_nbytes[rank]].tobytes()
        elif source.kind == "replica":
            out[rank] = regions[rank][source.region_ids[0]].tobytes()
    for d in plan.decodes:
        got = d.layout.rebuild(
            d.rank, shards.get(d.rank, {}), regions.get(d.rank, {}), recipe=d.recipe
        )
        out[d.rank] = got.tobytes()
    return out


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
def test_lose_nodes_then_rebuild_committed_version_bit_exact(policy: str, lost_nodes):
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
        assert execute(plan, survivors) == v2


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
        # receive segment by segment into full-size scratch buffers
        (decode,) = plan.decodes
        shards = {r: np.zeros(sizes[r], np.uint8) for r in per_src}
        regions = {}
        for t in plan.transfers:
            if t.kind == "shard":
                src = stores[t.src_rank].data_view(t.src_slot)
                shards[t.src_rank][t.offset : t.offset + t.nbytes] = src[
                    t.offset : t.offset + t.nbytes
                ]
            else:
                regions[t.region_id] = stores[t.src_rank].red_view(t.src_slot)[
                    t.offset : t.offset + t.nbytes
                ]
        got = decode.layout.rebuild(2, shards, regions, recipe=decode.recipe)
        assert got.tobytes() == v1[2]
        # the replacement node repopulates its empty store with the rebuilt shard
        fresh = SnapshotStore(root, "job", 2, 2, 1 << 24)
        fresh.allocate(sizes[2], layouts[2].redundancy_nbytes(2))
        slot = fresh.begin(1)
        fresh.data_view(slot)[:] = got
        assert fresh.data_view(slot).tobytes() == v1[2]


def test_flipped_byte_on_live_rank_is_rebuilt_from_replica():
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
        assert execute(plan, stores) == v5
