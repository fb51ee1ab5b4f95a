"""The real redundancy and restore code over real gloo, for every redundancy kind.

One 4-rank job (each rank its own simulated node) runs, per case: two versions written
through :class:`~baft.engine.redundancy.RedundancyExchange` (the engine's sends,
receives and parity encoding) into real snapshot stores, a third left in flight; then
some nodes lose their stores (a replacement starts empty) or a byte of a shard flips;
then :func:`baft.recover.inventory.agree` (inventories, checksums, the coordinator) and
:func:`baft.recover.transfer.rebuild_shard` (peer transfers, replica copy, decode) run as
they do at start-up, then the DP replicas exchange their shards point to point
(:func:`baft.recover.transfer.exchange_replicas`). Every rank's rebuilt shard must equal
what it wrote, every rank must end with all four shards, and each shard's source must be
the expected one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240)

CASES: dict[str, tuple[str, tuple[int, ...], int | None]] = {
    # name: (policy, nodes that lose their store, rank whose shard gets one flipped byte)
    "replicate1-lose1": ("replicate:1", (1,), None),
    "replicate3-lose3": ("replicate:3", (0, 2, 3), None),
    "replicate1-flip3": ("replicate:1", (), 3),
    "xor2-lose2": ("xor:2", (0, 3), None),
    "xor4-lose1": ("xor:4", (2,), None),
    "rs22-lose2": ("rs:2+2", (1, 3), None),
    "rs22-lose1-flip": ("rs:2+2", (0,), 2),
    "rs31-lose1": ("rs:3+1", (0,), None),
}
PIECE_BYTES = 256  # several pieces per transfer: tags and offsets must line up


def _shards(version: int) -> dict[int, bytes]:
    rng = np.random.default_rng(version)
    return {r: rng.integers(0, 256, 3000 + 37 * r, dtype=np.uint8).tobytes() for r in range(4)}


def _write_version(ctx: Any, version: int, shard: bytes, *, finish: bool = True) -> None:
    """What the engine does for one version: snapshot, redundancy exchange, manifest, commit."""
    import torch
    import torch.distributed as dist

    from baft.engine.redundancy import RedundancyExchange
    from baft.store.manifest import Manifest, chunk_records, region_records

    store, layout, rank = ctx.store, ctx.layout, ctx.rank
    slot = store.begin(version)
    data = torch.from_numpy(store.data_view(slot))
    red = torch.from_numpy(store.red_view(slot))
    ex = RedundancyExchange(layout, rank, ctx.transport, PIECE_BYTES)
    ex.begin(data, red)
    half = len(shard) // 2  # sends go out as the snapshot covers their bytes
    data[:half] = torch.frombuffer(bytearray(shard[:half]), dtype=torch.uint8)
    for p in ex.take_sends(half):
        ex.send_now(p)
    data[half:] = torch.frombuffer(bytearray(shard[half:]), dtype=torch.uint8)
    ex.finish()
    dist.barrier()
    if not finish:
        return
    manifest = Manifest.for_layout(
        topology=ctx.topology,
        layout=layout,
        rank=rank,
        version=version,
        iteration=version,
        owned_start=0,
        owned_stop=len(shard),
        chunks=chunk_records(data.numpy(), 512),
        regions=region_records(red.numpy(), layout.regions(rank)),
    )
    store.complete(slot, manifest)
    dist.barrier()
    store.commit(version)


def _case(rank: int, root: str, name: str, transport: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from baft.recover.inventory import agree
    from baft.recover.transfer import exchange_replicas, rebuild_shard
    from baft.store.coding import Redundancy, group_layouts
    from baft.store.shm import SnapshotStore
    from baft.topology import Topology

    policy, lost, flip = CASES[name]
    topo = Topology(num_dp=4, ranks_per_node=1)
    red = Redundancy.parse(policy)
    sizes = {r: len(s) for r, s in _shards(1).items()}
    layout = group_layouts(topo, red, sizes)[rank]
    store = SnapshotStore(Path(root), name, rank, rank, 1 << 24)
    store.allocate(sizes[rank], layout.redundancy_nbytes(rank))
    ctx = SimpleNamespace(rank=rank, store=store, layout=layout, transport=transport, topology=topo)
    _write_version(ctx, 1, _shards(1)[rank])
    _write_version(ctx, 2, _shards(2)[rank])
    _write_version(ctx, 3, _shards(3)[rank], finish=False)  # in flight, never completed
    if rank in lost:  # the node is replaced: its store is gone, a fresh one opens later
        store.destroy()
        store = SnapshotStore(Path(root), name, rank, rank, 1 << 24)
    if rank == flip:
        slot = next(s for s in (0, 1) if (m := store.read_manifest(s)) and m.version == 2)
        store.data_view(slot)[17] ^= 0x80
    dist.barrier()
    plan, reason, _ = agree(store, transport, topo, red, ())
    shard = rebuild_shard(store, transport, rank, plan)
    sha = hashlib.sha256(shard.tobytes()).hexdigest()
    full = bytearray(sum(plan.shard_nbytes.values()))  # the 4 dp replicas' shards in order

    def write(pos: int, piece: torch.Tensor) -> None:
        full[pos : pos + piece.numel()] = piece.numpy().tobytes()

    exchange_replicas(transport, topo, rank, plan, shard, write)
    store.drop_read_cache()  # what recover_and_start does once a restore is done
    dist.barrier()
    return {
        "version": plan.version,
        "source": plan.source,
        "kinds": {r: s.kind for r, s in plan.shards.items()},
        "reason": reason,
        "sha": sha,
        "full_sha": hashlib.sha256(bytes(full)).hexdigest(),
        "nbytes": int(shard.size),
    }


def _all_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    from baft.engine.transport import GlooTransport

    transport = GlooTransport(60.0)
    return {name: _case(rank, root, name, transport) for name in CASES}


def test_every_code_restores_through_the_runtime(gloo, tmp_path: Path) -> None:
    root = Path("/dev/shm") / f"baft-codes-{tmp_path.name}"
    try:
        got = gloo.run(_all_cases, 4, args=(str(root),), timeout_s=180)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    want = _shards(2)
    for name, (policy, lost, flip) in CASES.items():
        parity = "replica" if policy.startswith("replicate") else "parity"
        expected = {r: (parity if r in lost or r == flip else "local") for r in range(4)}
        for rank in range(4):
            out = got[rank][name]
            assert (out["version"], out["source"]) == (2, "memory"), (name, out["reason"])
            assert out["kinds"] == expected, (name, out["reason"])
            assert out["nbytes"] == len(want[rank]), name
            assert out["sha"] == hashlib.sha256(want[rank]).hexdigest(), (name, rank)
            full = b"".join(want[r] for r in range(4))  # after the DP exchange (gloo p2p)
            assert out["full_sha"] == hashlib.sha256(full).hexdigest(), (name, rank)
        if flip is not None:
            assert f"rank {flip} (shard failed its checksum)" in got[0][name]["reason"]
