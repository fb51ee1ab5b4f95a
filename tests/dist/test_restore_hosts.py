"""Restore when torchrun hands the ranks out differently: real gloo processes, emulated hosts.

Launch 1 (4 ranks, two emulated hosts ``a`` = ranks 0,1 and ``b`` = ranks 2,3, each
host with its own store root, ``BAFT_HOST_ID`` naming it) writes two versions through
the engine's :class:`~baft.engine.redundancy.RedundancyExchange` (xor:2 across the two
nodes). Launch 2 starts the same job with another host assignment: the ranks swapped
between the hosts, or host ``a`` lost and a replacement ``c`` taking the low or the high
ranks. The runtime's restore (inventory of every store on the host, agreement, transfers,
decode, DP exchange, reclamation) must end with the full state of v2 on every rank,
bit-exact, reading shards from other ranks' directories and other hosts' memory.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240)

RPN = 2
FIRST = {0: "a", 1: "a", 2: "b", 3: "b"}
PIECE_BYTES = 512


def _shards(version: int) -> dict[int, bytes]:
    rng = np.random.default_rng(100 + version)
    return {r: rng.integers(0, 256, 2000 + 53 * r, dtype=np.uint8).tobytes() for r in range(4)}


def _write(rank: int, world: int, base: str) -> int:
    """Launch 1: what the engine leaves in the stores for v1 and v2 (v2 committed)."""
    import torch
    import torch.distributed as dist

    from baft.engine.redundancy import RedundancyExchange
    from baft.engine.transport import GlooTransport
    from baft.store.coding import Redundancy, group_layouts
    from baft.store.manifest import Manifest, chunk_records, region_records
    from baft.store.shm import SnapshotStore
    from baft.topology import Topology

    topo = Topology(num_dp=world, ranks_per_node=RPN)
    sizes = {r: len(s) for r, s in _shards(1).items()}
    layout = group_layouts(topo, Redundancy.parse("xor:2"), sizes)[rank]
    (Path(base) / FIRST[rank]).mkdir(parents=True, exist_ok=True)  # the host's store root
    store = SnapshotStore(Path(base) / FIRST[rank], "job", topo.node_of(rank), rank, 1 << 22)
    store.allocate(sizes[rank], layout.redundancy_nbytes(rank))
    transport = GlooTransport(60.0)
    for version in (1, 2):
        shard = _shards(version)[rank]
        slot = store.begin(version)
        data = torch.from_numpy(store.data_view(slot))
        red = torch.from_numpy(store.red_view(slot))
        ex = RedundancyExchange(layout, rank, transport, PIECE_BYTES)
        ex.begin(data, red)
        data[:] = torch.frombuffer(bytearray(shard), dtype=torch.uint8)
        for p in ex.take_sends(len(shard)):
            ex.send_now(p)
        ex.finish()
        manifest = Manifest.for_layout(
            topology=topo,
            layout=layout,
            rank=rank,
            version=version,
            iteration=version,
            owned_start=0,
            owned_stop=len(shard),
            chunks=chunk_records(data.numpy(), 256),
            regions=region_records(red.numpy(), layout.regions(rank)),
        )
        store.complete(slot, manifest)
        dist.barrier()
        store.commit(version)
    store.close()
    return rank


def _restore(rank: int, world: int, base: str, hosts: dict[int, str]) -> dict[str, Any]:
    """Launch 2: this rank now runs on ``hosts[rank]``; restore as at start-up."""
    import os

    import torch

    os.environ["BAFT_HOST_ID"] = hosts[rank]

    from baft.engine.transport import GlooTransport
    from baft.recover.inventory import HostStores, agree, reclaim_stores
    from baft.recover.transfer import exchange_replicas, rebuild_shard
    from baft.store.coding import Redundancy
    from baft.store.paths import host_id
    from baft.store.shm import SnapshotStore
    from baft.topology import Topology

    topo = Topology(num_dp=world, ranks_per_node=RPN)
    root = Path(base) / host_id()
    own = SnapshotStore(root, "job", topo.node_of(rank), rank, 1 << 22)
    stores = HostStores(own, host_id())
    transport = GlooTransport(60.0)
    plan, reason, located = agree(stores, transport, topo, Redundancy.parse("xor:2"), ())
    shard = rebuild_shard(stores, transport, rank, plan)
    full = bytearray(sum(plan.shard_nbytes.values()))

    def write(pos: int, piece: torch.Tensor) -> None:
        full[pos : pos + piece.numel()] = piece.numpy().tobytes()

    exchange_replicas(transport, topo, rank, plan, shard, write)
    reclaimed = reclaim_stores(stores, transport, topo, plan, located)
    stores.drop_read_caches()
    return {
        "version": plan.version,
        "kinds": {r: s.kind for r, s in plan.shards.items()},
        "origins": {r: o["stores"] for r, o in plan.origins().items()},
        "reason": reason,
        "full": hashlib.sha256(bytes(full)).hexdigest(),
        "reclaimed": reclaimed,
    }


CASES = {
    # name: (host of each rank in launch 2, host whose memory is lost, expected kinds)
    "swapped": (
        {0: "b", 1: "b", 2: "a", 3: "a"},
        None,
        {0: "remote", 1: "remote", 2: "remote", 3: "remote"},
    ),
    "replacement-sorts-first": (
        {0: "c", 1: "c", 2: "b", 3: "b"},
        "a",
        {0: "parity", 1: "parity", 2: "local", 3: "local"},
    ),
    "replacement-sorts-last": (
        {0: "b", 1: "b", 2: "c", 3: "c"},
        "a",
        {0: "parity", 1: "parity", 2: "remote", 3: "remote"},
    ),
}


@pytest.mark.slow  # default tier: unit test_restore_inprocess (renumbered ranks, replacement hosts)
def test_restore_follows_the_shards_to_whatever_host_holds_them(gloo, tmp_path: Path) -> None:
    base = Path("/dev/shm") / f"baft-hosts-{tmp_path.name}"
    try:
        assert gloo.run(_write, 4, args=(str(base / "written"),), timeout_s=120) == [0, 1, 2, 3]
        want = hashlib.sha256(b"".join(_shards(2)[r] for r in range(4))).hexdigest()
        for name, (hosts, lost, kinds) in CASES.items():
            case = base / name
            shutil.copytree(base / "written", case)
            if lost is not None:
                shutil.rmtree(case / lost)
            got = gloo.run(_restore, 4, args=(str(case), hosts), timeout_s=120)
            for rank, out in enumerate(got):
                assert out["version"] == 2, (name, out["reason"])
                assert out["kinds"] == kinds, (name, out["reason"])
                assert out["full"] == want, (name, rank)
            origins = got[0]["origins"]
            if name == "swapped":
                assert origins[0] == ["a:node0/rank0"] and origins[2] == ["b:node1/rank2"]
            else:  # logical shards 0 and 1 rebuilt from what host b holds
                assert origins[0] == ["b:node1/rank2"] and origins[1] == ["b:node1/rank3"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
