"""Moving restored bytes: rebuild this rank's shard, then share it with the DP replicas.

- :func:`rebuild_shard`: this rank's shard of the plan's version: read from a store on
  this host, or made of peer pieces (whole shards, replicas, parity inputs) that move on
  the checkpoint group in plan order (tags = position in the plan) and are decoded here.
  Every byte is read through the store (``SnapshotStore.read``).
- :func:`exchange_replicas`: DP replicas exchange their shards point to point, and each
  piece is handed to a writer at its place in the full flat state.

A peer that dies mid-transfer makes a wait raise; it is re-raised as a
:class:`~baft.recover.differential.RestoreError` naming the transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from baft.engine.transport import Handle, Transport
from baft.recover.coordinator import RecoveryPlan
from baft.recover.differential import RestoreError
from baft.recover.inventory import HostStores, as_host_stores
from baft.recover.resize import Resize
from baft.store.shm import SnapshotStore, StoreReadError
from baft.topology import Topology


def _read(store: SnapshotStore, slot: int, kind: str, offset: int, nbytes: int) -> np.ndarray:
    try:
        return store.read(slot, kind, offset, nbytes)
    except StoreReadError as err:
        raise RestoreError(str(err)) from err


def rebuild_shard(
    stores: SnapshotStore | HostStores, transport: Transport, rank: int, plan: RecoveryPlan
) -> np.ndarray:
    """This rank's shard of ``plan.version``: local read, or peer pieces (+ decode).

    Collective over ``transport`` (tags = position in ``plan.transfers``). A peer that dies
    mid-transfer makes the wait raise (the transport's timeout or its failure signal),
    re-raised as a :class:`RestoreError` naming the transfer."""
    return rebuild_shards(stores, transport, [rank], plan)[rank]


def rebuild_shards(
    stores: SnapshotStore | HostStores,
    transport: Transport,
    ranks: Sequence[int],
    plan: RecoveryPlan,
    to_physical: Mapping[int, int] | None = None,
) -> dict[int, np.ndarray]:
    """The shards of ``plan.version`` of the plan's ``ranks`` this process acts for (its
    own rank; after a resize, the logical ranks it plays, ``to_physical`` mapping every
    plan rank to the current rank playing it): every transfer between two of them stays
    in this process, the others move on ``transport``. Collective, as
    :func:`rebuild_shard`."""
    host_stores = as_host_stores(stores)
    mine = set(ranks)
    where = (lambda r: r) if to_physical is None else to_physical.__getitem__
    handles = []
    received: dict[int, np.ndarray] = {}
    for tag, t in enumerate(plan.transfers):
        if t.src_rank in mine:
            kind = "data" if t.kind == "shard" else "red"
            src = _read(host_stores.get(t.src_store), t.src_slot, kind, t.offset, t.nbytes)
            if t.dst_rank in mine:  # a store on this process's host: no message
                received[tag] = src
                continue
            buf = torch.from_numpy(src)
            handles.append((transport.isend(buf, where(t.dst_rank), tag), t))
        elif t.dst_rank in mine:
            rbuf = torch.empty(t.nbytes, dtype=torch.uint8)
            handles.append((transport.irecv(rbuf, where(t.src_rank), tag), t))
            received[tag] = rbuf.numpy()
    for h, t in handles:
        try:
            h.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with the transfer named
            raise RestoreError(
                f"rank {sorted(mine)}: {t.kind} transfer of v{plan.version} rank {t.src_rank} "
                f"-> rank {t.dst_rank} ({t.nbytes} B) failed: {e}"
            ) from e
    return {r: _assemble(host_stores, r, plan, received) for r in ranks}


def _assemble(
    stores: HostStores, rank: int, plan: RecoveryPlan, received: dict[int, np.ndarray]
) -> np.ndarray:
    """This rank's shard from its source: a local read, the moved shard, a replica
    region, or a decode of the ``received`` pieces (tag -> bytes)."""
    source = plan.shards[rank]
    n = plan.shard_nbytes[rank]
    if source.kind == "local":
        assert source.slot is not None
        return _read(stores.get(source.store), source.slot, "data", 0, n)
    if source.kind == "remote":  # the whole shard, moved from another host's memory
        if n == 0:
            return np.zeros(0, np.uint8)
        (tag,) = [i for i, t in enumerate(plan.transfers) if t.dst_rank == rank]
        return received[tag]
    if source.kind == "replica":  # a peer's replica region holds the whole shard
        (rid,) = source.region_ids[:1]
        tag = next(
            tag
            for tag, t in enumerate(plan.transfers)
            if t.dst_rank == rank and t.kind == "region" and t.region_id == rid
        )
        if received[tag].size < n:
            raise RestoreError(
                f"rank {rank}: replica region {rid} of v{plan.version} holds "
                f"{received[tag].size} bytes, shard has {n}"
            )
        return received[tag][:n]
    return _decode(rank, plan, received)


def _decode(rank: int, plan: RecoveryPlan, received: dict[int, np.ndarray]) -> np.ndarray:
    """This rank's shard decoded from the peer shards and parity regions it received."""
    decode = next((d for d in plan.decodes if d.rank == rank), None)
    if decode is None:
        raise RestoreError(f"rank {rank}: no local shard of v{plan.version} and no decode planned")
    shard_pieces: dict[int, list[tuple[int, np.ndarray]]] = {}
    region_pieces: dict[int, list[tuple[int, np.ndarray]]] = {}
    for tag, t in enumerate(plan.transfers):
        if t.dst_rank != rank:
            continue
        if t.kind == "shard":
            owner = t.src_store.rank if t.src_store is not None else t.src_rank
            shard_pieces.setdefault(owner, []).append((t.offset, received[tag]))
        else:
            start = t.offset - decode.layout.region(t.region_id).offset
            region_pieces.setdefault(t.region_id, []).append((start, received[tag]))
    shards = {o: whole(p, plan.shard_nbytes[o]) for o, p in shard_pieces.items()}
    regions = {i: whole(p, decode.layout.region(i).nbytes) for i, p in region_pieces.items()}
    try:
        return decode.layout.rebuild(rank, shards, regions, recipe=decode.recipe)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise RestoreError(f"rank {rank}: cannot rebuild shard of v{plan.version}: {e}") from e


def whole(pieces: list[tuple[int, np.ndarray]], nbytes: int) -> np.ndarray:
    """A buffer of ``nbytes`` holding ``pieces`` ((offset, bytes)) at their offsets, zeros
    elsewhere (a decode reads only the ranges its recipe names). One piece that covers
    it all is that buffer, not copied (a whole shard or region moved in one transfer)."""
    if len(pieces) == 1 and pieces[0][0] == 0 and pieces[0][1].size == nbytes:
        return pieces[0][1]
    out = np.zeros(nbytes, np.uint8)
    for offset, piece in pieces:
        out[offset : offset + piece.size] = piece
    return out


def exchange_replicas(
    transport: Transport,
    topology: Topology,
    rank: int,
    plan: RecoveryPlan,
    shard: np.ndarray,
    write: Callable[[int, torch.Tensor], None],
) -> int:
    """Hand every DP replica's shard to the others, point to point on ``transport``, and
    ``write(position, bytes)`` each (own one included) at its place in the full flat state;
    returns the bytes written. Owned ranges are contiguous in dp order. Tags follow the
    plan's transfers, so they never meet a piece of the rebuild."""
    replicas = topology.replicas(rank)
    base = len(plan.transfers)
    mine = torch.from_numpy(shard)
    sends = [
        (transport.isend(mine, peer, base + replicas.index(rank)), peer)
        for peer in replicas
        if peer != rank
    ]
    pos = 0
    for i, r in enumerate(replicas):
        n = plan.shard_nbytes[r]
        if r == rank:
            piece = mine
        else:
            piece = torch.empty(n, dtype=torch.uint8)
            _wait(transport.irecv(piece, r, base + i), rank, f"shard of rank {r}", plan)
        write(pos, piece)
        pos += n
    for h, peer in sends:
        _wait(h, rank, f"shard to rank {peer}", plan)
    return pos


def _wait(handle: Handle, rank: int, what: str, plan: RecoveryPlan) -> None:
    try:
        handle.wait()
    except Exception as e:  # noqa: BLE001 - re-raised with the message named
        raise RestoreError(
            f"rank {rank}: DP exchange ({what}) of v{plan.version} failed: {e}"
        ) from e


def assemble_resized(
    transport: Transport,
    topology: Topology,
    resize: Resize,
    rank: int,
    plan: RecoveryPlan,
    shards: Mapping[int, np.ndarray],
    write: Callable[[int, torch.Tensor], None],
) -> int:
    """After a resize: this rank's full flat state from the logical shards of its
    ``(pp, tp)`` in the old job's dp order, ``write(position, bytes)`` each; ``shards``:
    those this rank played. Every rank sends the shards it played to the other current
    ranks of its stage, point to point (tags after the plan's transfers, one per logical
    rank). Returns the bytes written."""
    base = len(plan.transfers)
    peers = [q for q in topology.replicas(rank) if q != rank]
    sends = [
        (transport.isend(torch.from_numpy(shard), q, base + lg), q)
        for lg, shard in sorted(shards.items())
        for q in peers
    ]
    pos = 0
    for lg in resize.stage_shards(topology, rank):
        holder = resize.to_physical[lg]
        if holder == rank:
            piece = torch.from_numpy(shards[lg])
        else:
            piece = torch.empty(plan.shard_nbytes[lg], dtype=torch.uint8)
            _wait(transport.irecv(piece, holder, base + lg), rank, f"shard of rank {lg}", plan)
        write(pos, piece)
        pos += piece.numel()
    for h, q in sends:
        _wait(h, rank, f"shards to rank {q}", plan)
    return pos
