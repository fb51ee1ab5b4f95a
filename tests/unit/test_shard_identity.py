"""Shard identity: the layout digest covers placements and offsets, replica layouts are
compared tensor by tensor, and a restore meeting another layout's shard raises before it
writes (stores in a temporary directory, ranks as threads)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from baft.engine.local_transport import LocalTransport
from baft.pipeline.layout import FSDP_HELP, check_replica_layouts, placement_of
from baft.pipeline.state import TensorInfo, TrainingState, _layout_digest
from baft.recover.identity import ShardIdentityError, check_identity, shard_records
from baft.recover.inventory import agree
from baft.store.coding import Redundancy, group_layouts
from baft.store.manifest import Manifest, chunk_records, region_records
from baft.store.shm import SnapshotStore
from baft.topology import Topology

W = TensorInfo("model.w", "float32", (4, 8), 128, (8, 8), "tp:Shard(dim=0)", (0, 0))


def test_digest_covers_placements_and_offsets() -> None:
    other_offset = dataclasses.replace(W, offset=(4, 0))
    other_placement = dataclasses.replace(W, placements="tp:Shard(dim=1)")
    digests = {_layout_digest([x]) for x in (W, other_offset, other_placement)}
    assert len(digests) == 3
    assert _layout_digest([W]) == _layout_digest([dataclasses.replace(W)])


def test_true_replicas_have_equal_layouts_and_digests() -> None:
    def state() -> TrainingState:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 2))
        return TrainingState([m], torch.optim.AdamW(m.parameters()))

    a, b = state(), state()
    assert a.layout() == b.layout() and a.layout_digest == b.layout_digest
    assert a.layout()[0] == TensorInfo("model.0.weight", "float32", (2, 3), 24, (2, 3), "", (0, 0))
    assert placement_of(torch.zeros(2, 3)) == ((2, 3), "", (0, 0))
    check_replica_layouts([((0, 0, 0), a.layout()), ((0, 1, 0), b.layout())])


def test_replicas_that_differ_in_offsets_are_refused_naming_the_tensor() -> None:
    v = TensorInfo("model.v", "float32", (2,), 8, (2,), "", (0,))
    shifted = dataclasses.replace(W, offset=(4, 0))
    gathered = [
        ((1, 0, 1), [v, W]),
        ((0, 0, 0), [v, W]),  # another stage: compared with its own replicas only
        ((1, 1, 1), [v, shifted]),
        ((0, 1, 0), [v, W]),
    ]
    with pytest.raises(ValueError) as err:
        check_replica_layouts(gathered)
    assert str(err.value) == (
        "DP ranks dp0 and dp1 of pp1.tp1 are not replicas: model.w: offset (0, 0) vs "
        f"(4, 0). {FSDP_HELP}"
    )
    with pytest.raises(ValueError, match=r"tensor #1 is model.w on one rank, model.x on"):
        check_replica_layouts(
            [((0, 0, 0), [v, W]), ((0, 1, 0), [v, dataclasses.replace(W, name="model.x")])]
        )


def test_check_identity() -> None:
    check_identity([("a", {"pp0.tp0": "d0"}), ("old", None), ("older", {})], "pp0.tp0", "d0")
    with pytest.raises(ShardIdentityError) as err:
        check_identity([("a", {"pp0.tp0": "d0"}), ("b", {"pp0.tp0": "e" * 64})], "pp0.tp0", "d0")
    assert str(err.value).startswith(
        "b was saved from other tensors than pp0.tp0's live state (layout digest "
        "eeeeeeeeeeee, now d0): names, dtypes"
    )
    with pytest.raises(ShardIdentityError, match=r"^a records no layout for pp1.tp0 \(saved by"):
        check_identity([("a", {"pp0.tp0": "d0"})], "pp1.tp0", "d0")


SIZES = {0: 100, 1: 100}


def _write(root: Path, layouts_of: dict[int, dict[str, str]]) -> tuple[Topology, Redundancy]:
    """Version 1 of a 2-rank DP job (replicate:1) whose rank r recorded ``layouts_of[r]``."""
    topo = Topology(num_dp=2, ranks_per_node=1)
    red = Redundancy.parse("replicate:1")
    groups = group_layouts(topo, red, SIZES)
    for r in (0, 1):
        s = SnapshotStore(root, "job", r, r, 1 << 20)
        s.allocate(SIZES[r], groups[r].redundancy_nbytes(r))
        slot = s.begin(1)
        s.data_view(slot)[: SIZES[r]] = np.full(SIZES[r], r + 1, np.uint8)
        regions = groups[r].regions(r)
        for region in regions:  # replicate: the partner's shard
            part = np.full(region.nbytes, 2 - r, np.uint8)
            s.red_view(slot)[region.offset : region.offset + region.nbytes] = part
        manifest = Manifest.for_layout(
            topology=topo, layout=groups[r], rank=r, version=1, iteration=1,
            owned_start=0, owned_stop=SIZES[r],
            chunks=chunk_records(s.data_view(slot)[: SIZES[r]], 64),
            regions=region_records(s.red_view(slot), regions),
            meta={"layouts": layouts_of[r]},
        )  # fmt: skip
        s.complete(slot, manifest)
        s.commit(1)
        s.close()
    return topo, red


def _records(root: Path, topo: Topology, red: Redundancy) -> list:
    import threading

    transports = LocalTransport.group(2, timeout_s=5.0)
    out: list = [None, None]

    def run(r: int) -> None:
        store = SnapshotStore(root, "job", r, r, 1 << 20)
        plan, _, located = agree(store, transports[r], topo, red, ())
        out[r] = (plan.version, shard_records(located.stores, [plan.version]))
        store.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_a_restore_meeting_another_layouts_shard_raises(tmp_path: Path) -> None:
    """Rank 1's shard was written by a job whose pp0.tp0 layout differs: every rank's
    check refuses the version (the stores' bytes were never loaded)."""
    topo, red = _write(tmp_path, {0: {"pp0.tp0": "a" * 64}, 1: {"pp0.tp0": "b" * 64}})
    for version, records in _records(tmp_path, topo, red):
        assert version == 1
        assert [w for w, _ in records] == [
            "the v1 shard of rank 0 (store rank0:node0/rank0)",
            "the v1 shard of rank 1 (store rank1:node1/rank1)",
        ]
        with pytest.raises(ShardIdentityError) as err:
            check_identity(records, "pp0.tp0", "a" * 64)
        assert str(err.value).startswith(
            "the v1 shard of rank 1 (store rank1:node1/rank1) was saved from other tensors "
            "than pp0.tp0's live state (layout digest bbbbbbbbbbbb, now aaaaaaaaaaaa)"
        )
        check_identity(records[:1], "pp0.tp0", "a" * 64)
