"""What a restore from memory reads, hashes and copies: each byte hashed once per restore,
and a stage's only replica's payload handed on without a copy.

Ranks are threads on a :class:`LocalTransport` group with real stores (the helpers of
:mod:`tests.unit.test_restore_inprocess`). The checksum function is wrapped to log every
range it hashes, so the tests assert on exact hashing logs, and on bit-exact bytes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from baft.engine.local_transport import LocalTransport
from baft.recover.differential import RestoreError
from baft.recover.inventory import HostStores, agree, verify_reads
from baft.recover.load import rebuild_payload
from baft.store import manifest as manifest_mod
from baft.store.coding import Redundancy, group_layouts
from baft.topology import Topology
from tests.unit.test_restore_inprocess import (
    SIZES,
    WORLD,
    _open,
    _run_ranks,
    _setup,
    _shard,
    _state,
    _write_version,
)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the ranges hashed (every checksum a restore computes), in order."""
    log: list[int] = []
    real = manifest_mod.checksum

    def checksum(buf: Any) -> int:
        log.append(len(buf))
        return real(buf)

    monkeypatch.setattr(manifest_mod, "checksum", checksum)
    return log


def _plan_alone(root: Path, topo: Topology, red: Any) -> Any:
    """The agreed plan (every rank local) of a 4-rank group, as rank 0 sees it."""
    got = _run_ranks(lambda r, t: agree(_open(root, r), t, topo, red, ())[0])
    assert not any(isinstance(g, BaseException) for g in got), got
    return got[0]


def test_a_read_found_clean_is_not_hashed_again_in_the_same_restore(
    tmp_path: Path, hashed: list[int]
) -> None:
    topo, red = _setup(tmp_path, "xor:2")
    plan = _plan_alone(tmp_path, topo, red)
    assert {s.kind for s in plan.shards.values()} == {"local"}
    stores = HostStores(_open(tmp_path, 0))
    hashed.clear()

    assert verify_reads(stores, 0, plan) == []
    assert sum(hashed) == SIZES[0]  # rank 0's shard, once (512-byte chunks)
    assert len(stores.verified) == 1
    hashed.clear()
    assert verify_reads(stores, 0, plan) == []  # the window's newest payload: same read
    assert hashed == []
    assert verify_reads(HostStores(_open(tmp_path, 0)), 0, plan) == []  # a new restore
    assert sum(hashed) == SIZES[0]


def test_a_read_that_failed_its_checksum_is_hashed_and_reported_every_time(
    tmp_path: Path, hashed: list[int]
) -> None:
    topo, red = _setup(tmp_path, "xor:2")
    plan = _plan_alone(tmp_path, topo, red)
    own = _open(tmp_path, 0)
    slot = next(s for s in (0, 1) if (m := own.read_manifest(s)) and m.version == plan.version)
    assert own.flip_byte(slot, "data", 700)
    stores = HostStores(_open(tmp_path, 0))
    hashed.clear()
    first = verify_reads(stores, 0, plan)
    assert first == verify_reads(stores, 0, plan)
    assert len(first) == 1 and "chunk 1: checksum mismatch" in first[0]
    assert sum(hashed) == 2 * SIZES[0]
    assert stores.verified == set()


def _setup_stages(root: Path) -> tuple[Topology, Redundancy]:
    """:func:`_setup` with every rank a stage of its own (pp=4, dp=1): each rank its
    stage's only replica."""
    topo = Topology(num_pp=WORLD, ranks_per_node=1)
    red = Redundancy.parse("xor:2")
    layouts = group_layouts(topo, red, SIZES)
    stores = [_open(root, r) for r in range(WORLD)]
    for r, s in enumerate(stores):
        s.allocate(SIZES[r], layouts[r].redundancy_nbytes(r))
    _write_version(stores, layouts, topo, 1)
    _write_version(stores, layouts, topo, 2)
    for s in stores:
        s.close()
    return topo, red


def _payloads(root: Path, topo: Topology, red: Any) -> list[Any]:
    """Every rank's ``rebuild_payload`` of the agreed version, with the read it came from."""

    def rank(r: int, transport: LocalTransport) -> Any:
        store = _open(root, r)
        plan = agree(store, transport, topo, red, ())[0]
        engine = SimpleNamespace(rank=r, topology=topo, transport=transport)
        payload = rebuild_payload(engine, HostStores(store), plan)  # type: ignore[arg-type]
        slot = plan.shards[r].slot
        mapped = torch.from_numpy(store.read(slot, "data", 0, SIZES[r]))
        return payload.clone(), payload.data_ptr() == mapped.data_ptr()

    return _run_ranks(rank)


def test_an_only_replicas_payload_is_its_shard_as_read_without_a_copy(tmp_path: Path) -> None:
    got = _payloads(tmp_path, *_setup_stages(tmp_path))
    for r, (payload, same_memory) in enumerate(got):
        assert payload.numpy().tobytes() == _shard(2, r).tobytes()
        assert same_memory, r


def test_dp_replicas_payload_is_assembled_from_every_replicas_shard(tmp_path: Path) -> None:
    topo, red = _setup(tmp_path, "xor:2")  # num_dp=4: one stage, four replicas
    got = _payloads(tmp_path, topo, red)
    for payload, same_memory in got:
        assert payload.numpy().tobytes() == _state(2)
        assert not same_memory


def test_a_shard_of_another_size_than_planned_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import baft.recover.load as load

    setup = _setup_stages(tmp_path)
    monkeypatch.setattr(load, "rebuild_shard", lambda *a, **k: np.zeros(5, np.uint8))
    got = _payloads(tmp_path, *setup)
    assert all(isinstance(g, RestoreError) and "has 5 bytes" in str(g) for g in got), got


def test_a_piece_covering_the_whole_buffer_is_used_as_it_is() -> None:
    from baft.recover.transfer import whole

    piece = np.arange(8, dtype=np.uint8)
    assert whole([(0, piece)], 8) is piece
    parts = whole([(4, piece[4:]), (0, piece[:2])], 8)
    assert parts.tolist() == [0, 1, 0, 0, 4, 5, 6, 7]
    assert not np.shares_memory(parts, piece)
    assert whole([(0, piece[:6])], 8).tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
