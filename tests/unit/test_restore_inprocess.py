"""The restore path in process: ranks are threads on a :class:`LocalTransport` group, each
with a real :class:`SnapshotStore` in a temporary directory.

A committed version (plus an older one and one left in flight) is written through the
store API with the redundancy every code defines; then stores are lost or damaged, and
the runtime's agreement, rebuild (local read, replica copy, xor / Reed-Solomon decode)
and DP shard exchange run as at start-up. Every rank must end with the full flat state,
bit-exact, and a peer that dies mid-transfer must give a clear error, not a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from baft.engine.local_transport import LocalTransport
from baft.engine.peers import find_same_host_peers
from baft.recover.coordinator import (
    Located,
    LocatedInventory,
    RecoveryPlan,
    StoreRef,
    TopologyMismatchError,
)
from baft.recover.differential import RestoreError
from baft.recover.inventory import HostStores, agree, reclaim_stores
from baft.recover.report import PROGRESS_DIR
from baft.recover.startover import never_silently_fresh
from baft.recover.transfer import exchange_replicas, rebuild_shard
from baft.store import reclaim
from baft.store.coding import GroupLayout, Redundancy, group_layouts
from baft.store.manifest import Manifest, chunk_records, region_records
from baft.store.records import DiffMeta
from baft.store.shm import SnapshotStore
from baft.topology import Topology

WORLD = 4
JOB = "job"
SIZES = {r: 3000 + 37 * r for r in range(WORLD)}  # uneven shards: offsets must line up


def _state(version: int) -> bytes:
    """The full flat state of ``version``; rank r owns the r-th range (dp order)."""
    rng = np.random.default_rng(version)
    return rng.integers(0, 256, sum(SIZES.values()), dtype=np.uint8).tobytes()


def _shard(version: int, rank: int) -> np.ndarray:
    start = sum(SIZES[r] for r in range(rank))
    return np.frombuffer(_state(version), np.uint8)[start : start + SIZES[rank]]


def _open(root: Path, rank: int) -> SnapshotStore:
    return SnapshotStore(root, JOB, rank, rank, 1 << 22)  # one rank per simulated node


def _write_version(
    stores: list[SnapshotStore],
    layouts: dict[int, GroupLayout],
    topo: Topology,
    version: int,
    *,
    finish: bool = True,
) -> None:
    """What the engine leaves in every store for one version: shard, redundancy regions
    (encoded here straight from the peers' shards), manifest, commit record."""
    slots = {r: s.begin(version) for r, s in enumerate(stores)}
    for r, s in enumerate(stores):
        s.data_view(slots[r])[: SIZES[r]] = _shard(version, r)
    for r, s in enumerate(stores):
        red = s.red_view(slots[r])
        for region in layouts[r].regions(r):
            inputs = [
                _shard(version, seg.rank)[seg.offset : seg.offset + seg.nbytes]
                for seg in region.sources
            ]
            layouts[r].encode(
                region.region_id, inputs, red[region.offset : region.offset + region.nbytes]
            )
    if not finish:
        return
    for r, s in enumerate(stores):
        manifest = Manifest.for_layout(
            topology=topo,
            layout=layouts[r],
            rank=r,
            version=version,
            iteration=version,
            owned_start=0,
            owned_stop=SIZES[r],
            chunks=chunk_records(s.data_view(slots[r])[: SIZES[r]], 512),
            regions=region_records(s.red_view(slots[r]), layouts[r].regions(r)),
        )
        s.complete(slots[r], manifest)
    for s in stores:
        s.commit(version)


def _setup(root: Path, code: str) -> tuple[Topology, Redundancy]:
    topo = Topology(num_dp=WORLD, ranks_per_node=1)
    red = Redundancy.parse(code)
    layouts = group_layouts(topo, red, SIZES)
    stores = [_open(root, r) for r in range(WORLD)]
    for r, s in enumerate(stores):
        s.allocate(SIZES[r], layouts[r].redundancy_nbytes(r))
    _write_version(stores, layouts, topo, 1)
    _write_version(stores, layouts, topo, 2)
    _write_version(stores, layouts, topo, 3, finish=False)  # in flight when the job died
    for s in stores:
        s.close()
    return topo, red


def _run_ranks(fn: Callable[[int, LocalTransport], Any], timeout_s: float = 5.0) -> list[Any]:
    """``fn(rank, transport)`` on one thread per rank; results or raised exceptions."""
    transports = LocalTransport.group(WORLD, timeout_s=timeout_s)
    out: list[Any] = [None] * WORLD

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, transports[rank])
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
        assert not t.is_alive(), "a rank hung"
    return out


def _restore(root: Path, topo: Topology, red: Redundancy) -> list[Any]:
    def rank(r: int, transport: LocalTransport) -> dict[str, Any]:
        store = _open(root, r)
        plan, reason, _ = agree(store, transport, topo, red, ())
        shard = rebuild_shard(store, transport, r, plan)
        full = np.zeros(sum(SIZES.values()), np.uint8)

        def write(pos: int, piece: torch.Tensor) -> None:
            full[pos : pos + piece.numel()] = piece.numpy()

        written = exchange_replicas(transport, topo, r, plan, shard, write)
        store.close()
        return {
            "plan": plan,
            "reason": reason,
            "shard": shard.tobytes(),
            "full": full.tobytes(),
            "written": written,
        }

    return _run_ranks(rank)


CASES = {
    # name: (code, ranks whose store is lost, rank whose v2 shard gets one flipped byte)
    "all-local": ("xor:2", (), None),
    "replica": ("replicate:1", (1,), None),
    "replicas-3-lost": ("replicate:3", (0, 2, 3), None),
    "xor-lost": ("xor:2", (2,), None),
    "xor4-lost": ("xor:4", (0,), None),
    "rs-two-lost": ("rs:2+2", (1, 3), None),
    "rs-flip": ("rs:2+2", (0,), 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_restore_rebuilds_every_shard_bit_exact(tmp_path: Path, name: str) -> None:
    code, lost, flip = CASES[name]
    topo, red = _setup(tmp_path, code)
    for r in lost:  # the node is replaced: its store is gone
        _open(tmp_path, r).destroy()
    if flip is not None:
        store = _open(tmp_path, flip)
        slot = next(s for s in (0, 1) if (m := store.read_manifest(s)) and m.version == 2)
        assert store.flip_byte(slot, "data", 17)
    got = _restore(tmp_path, topo, red)
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors
    kind = "replica" if code.startswith("replicate") else "parity"
    want_kinds = {r: kind if r in lost or r == flip else "local" for r in range(WORLD)}
    for r, out in enumerate(got):
        assert (out["plan"].version, out["plan"].source) == (2, "memory"), out["reason"]
        assert {q: s.kind for q, s in out["plan"].shards.items()} == want_kinds, out["reason"]
        assert out["shard"] == _shard(2, r).tobytes()
        assert out["full"] == _state(2)
        assert out["written"] == len(_state(2))
    if flip is not None:
        assert f"rank {flip} (shard failed its checksum)" in got[0]["reason"]


def test_peer_failing_mid_transfer_is_a_clear_error(tmp_path: Path) -> None:
    """xor:2, rank 2 lost: its partner rank 3 sends it the bytes to decode from, but dies
    after the plan is agreed. Rank 2 must raise a RestoreError naming the transfer."""
    topo, red = _setup(tmp_path, "xor:2")
    _open(tmp_path, 2).destroy()
    agreed = threading.Barrier(WORLD)  # rank 3 dies once every rank holds the plan

    def rank(r: int, transport: LocalTransport) -> Any:
        store = _open(tmp_path, r)
        plan, _, _ = agree(store, transport, topo, red, ())
        assert plan.shards[2].kind == "parity" and plan.shards[2].holders == (3,)
        agreed.wait(5)
        if r == 3:
            transport.fail()
            return "died"
        return rebuild_shard(store, transport, r, plan).tobytes()

    got = _run_ranks(rank, timeout_s=30.0)  # a hang would take the full 30 s, then fail
    assert got[3] == "died"
    assert got[0] == _shard(2, 0).tobytes() and got[1] == _shard(2, 1).tobytes()
    err = got[2]
    assert isinstance(err, RestoreError), err
    assert "transfer of v2 rank 3 -> rank 2" in str(err) and "peer rank 3 failed" in str(err)


# ---------------------------------------------------------------- several hosts, renumbered
# Two emulated hosts, each with its own store root (as BAFT_HOST_ID plus a root per host
# play them in the multi-process tests). The first launch puts ranks 0,1 (node 0) on host
# "a" and ranks 2,3 (node 1) on host "b"; the relaunch hands the ranks out differently.
TOPO2 = Topology(num_dp=WORLD, ranks_per_node=2)
FIRST = {0: "a", 1: "a", 2: "b", 3: "b"}


def _write_on_hosts(tmp: Path, code: str) -> Redundancy:
    red = Redundancy.parse(code)
    layouts = group_layouts(TOPO2, red, SIZES)
    stores = [
        SnapshotStore(tmp / FIRST[r], JOB, TOPO2.node_of(r), r, 1 << 22) for r in range(WORLD)
    ]
    for r, s in enumerate(stores):
        s.allocate(SIZES[r], layouts[r].redundancy_nbytes(r))
    _write_version(stores, layouts, TOPO2, 1)
    _write_version(stores, layouts, TOPO2, 2)
    for s in stores:
        s.close()
    return red


def _restore_on_hosts(tmp: Path, red: Redundancy, hosts: dict[int, str]) -> list[Any]:
    def rank(r: int, transport: LocalTransport) -> dict[str, Any]:
        own = SnapshotStore(tmp / hosts[r], JOB, TOPO2.node_of(r), r, 1 << 22)
        stores = HostStores(own, hosts[r])
        plan, reason, located = agree(stores, transport, TOPO2, red, ())
        shard = rebuild_shard(stores, transport, r, plan)
        full = np.zeros(sum(SIZES.values()), np.uint8)

        def write(pos: int, piece: torch.Tensor) -> None:
            full[pos : pos + piece.numel()] = piece.numpy()

        exchange_replicas(transport, TOPO2, r, plan, shard, write)
        reclaimed = reclaim_stores(stores, transport, TOPO2, plan, located)
        stores.drop_read_caches()
        return {"plan": plan, "reason": reason, "full": full.tobytes(), "reclaimed": reclaimed}

    got = _run_ranks(rank)
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors
    return got


def _dirs(root: Path) -> list[str]:
    return sorted(f"{p.parent.name}/{p.name}" for p in root.glob(f"{JOB}/node*/rank*"))


def test_renumbered_ranks_take_their_shards_from_the_other_host(tmp_path: Path) -> None:
    """Both hosts survive but swap rank blocks: every shard moves from the host holding
    it, read there by the lowest rank, bit-exact; nothing needs a decode."""
    red = _write_on_hosts(tmp_path, "xor:2")
    swapped = {0: "b", 1: "b", 2: "a", 3: "a"}
    got = _restore_on_hosts(tmp_path, red, swapped)
    for out in got:
        plan = out["plan"]
        assert (plan.version, plan.source) == (2, "memory"), out["reason"]
        assert out["full"] == _state(2)
        assert {r: (s.kind, s.holders) for r, s in plan.shards.items()} == {
            0: ("remote", (2,)),  # logical shard 0 sits in host a's node0/rank0, rank 2 reads
            1: ("remote", (2,)),
            2: ("remote", (0,)),
            3: ("remote", (0,)),
        }
        assert plan.origins()[0] == {"kind": "remote", "ranks": [2], "stores": ["a:node0/rank0"]}
    assert "rank 0 (on host b) moved from store a:node0/rank0 by rank 2" in got[0]["reason"]
    # the copies used stay (v2 and older) until the new own stores commit a newer one
    assert got[0]["reclaimed"] == [] and got[2]["reclaimed"] == []
    a_rank0 = SnapshotStore(tmp_path / "a", JOB, 0, 0, 0)
    assert sorted(m.version for s in (0, 1) if (m := a_rank0.read_manifest(s))) == [1, 2]
    assert a_rank0.committed_version() == 2
    removed = reclaim.reclaim_foreign(tmp_path / "a", JOB, {(1, 2), (1, 3)}, newer_than=2)
    assert sorted(p.name for p in removed) == ["rank0", "rank1"] and _dirs(tmp_path / "a") == []


def test_replacement_host_sorting_first_rebuilds_from_parity_on_the_survivor(
    tmp_path: Path,
) -> None:
    """Host a dies with its memory; replacement host c joins and torchrun gives the
    survivor b the low ranks. Logical shards 2,3 (on b) move to ranks 2,3 now on c;
    shards 0,1 are rebuilt from the xor parity b holds, by ranks 0,1 on b itself (their
    inputs sit in b's memory: no message)."""
    red = _write_on_hosts(tmp_path, "xor:2")
    reclaim.remove_job(tmp_path / "a", JOB)
    hosts = {0: "b", 1: "b", 2: "c", 3: "c"}
    got = _restore_on_hosts(tmp_path, red, hosts)
    plan = got[0]["plan"]
    assert (plan.version, plan.source) == (2, "memory"), got[0]["reason"]
    assert {r: s.kind for r, s in plan.shards.items()} == {
        0: "parity",
        1: "parity",
        2: "remote",
        3: "remote",
    }
    assert all(out["full"] == _state(2) for out in got)
    decode_inputs = [t for t in plan.transfers if t.dst_rank in (0, 1)]
    assert decode_inputs and all(t.src_rank == t.dst_rank for t in decode_inputs)
    assert plan.origins()[0]["stores"] == ["b:node1/rank2"]
    assert _dirs(tmp_path / "b") == ["node1/rank2", "node1/rank3"]  # kept: they hold v2


def test_an_older_numbering_holding_nothing_needed_is_reclaimed(tmp_path: Path) -> None:
    """A store on host b left by a numbering before the last restore (v1 only, of logical
    shard 0) is freed once the restore of v2 is done; v2's copies stay."""
    red = _write_on_hosts(tmp_path, "replicate:1")
    stale = SnapshotStore(tmp_path / "b", JOB, 0, 0, 1 << 22)
    source = SnapshotStore(tmp_path / "a", JOB, 0, 0, 0)
    slot = next(s for s in (0, 1) if (m := source.read_manifest(s)) and m.version == 1)
    stale.allocate(SIZES[0], 0)
    stale.data_view(0)[: SIZES[0]] = _shard(1, 0)
    stale.begin(1)
    m1 = source.read_manifest(slot)
    assert m1 is not None
    stale.complete(0, dataclasses.replace(m1, red_nbytes=0, regions=()))
    stale.commit(1)
    stale.close()
    got = _restore_on_hosts(tmp_path, red, FIRST)
    assert {s.kind for s in got[0]["plan"].shards.values()} == {"local"}
    assert all(out["full"] == _state(2) for out in got)
    assert got[2]["reclaimed"] == ["b:node0/rank0"] and got[0]["reclaimed"] == []
    assert _dirs(tmp_path / "b") == ["node1/rank2", "node1/rank3"]


# Issue 28, bug 4: the same two "hosts" (a store root each) as two torchrun agents on one
# machine without BAFT_HOST_ID: every rank detects the same host "m". b's root is wiped and
# b restarts, keeping its ranks or (sorting first) taking ranks 0,1.
@pytest.mark.parametrize(
    "roots", [FIRST, {0: "b", 1: "b", 2: "a", 3: "a"}], ids=["keeps-order", "sorts-first"]
)
def test_one_machine_two_store_roots_restores_the_wiped_node_from_the_other_root(
    tmp_path: Path, roots: dict[int, str]
) -> None:
    """The declared nodes are the failure domains: a root is its own memory, so each
    store is inventoried and read by a rank with that root, and the wiped node is
    rebuilt from the parity in a's root, bit-exact. (With the detected host as the
    location, ranks read the other root's stores in their own root: 'file absent'.)"""
    red = _write_on_hosts(tmp_path, "xor:2")
    reclaim.remove_job(tmp_path / "b", JOB)

    def rank(r: int, transport: LocalTransport) -> dict[str, Any]:
        root = tmp_path / roots[r]
        own = SnapshotStore(root, JOB, TOPO2.node_of(r), r, 1 << 22)
        location, _ = find_same_host_peers(transport, own.path, root, TOPO2, host="m")
        stores = HostStores(own, location)
        plan, reason, _ = agree(stores, transport, TOPO2, red, ())
        shard = rebuild_shard(stores, transport, r, plan)
        full = np.zeros(sum(SIZES.values()), np.uint8)

        def write(pos: int, piece: torch.Tensor) -> None:
            full[pos : pos + piece.numel()] = piece.numpy()

        exchange_replicas(transport, TOPO2, r, plan, shard, write)
        stores.drop_read_caches()
        return {"plan": plan, "reason": reason, "full": full.tobytes(), "at": location}

    got = _run_ranks(rank)
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors
    assert [g["at"] for g in got] == [f"m@{tmp_path / roots[r]}" for r in range(WORLD)]
    plan = got[0]["plan"]
    assert (plan.version, plan.source) == (2, "memory"), got[0]["reason"]
    here = "local" if roots is FIRST else "remote"
    assert {r: s.kind for r, s in plan.shards.items()} == {
        0: here,
        1: here,
        2: "parity",
        3: "parity",
    }
    assert plan.origins()[0]["stores"] == [f"m@{tmp_path / 'a'}:node0/rank0"]
    assert all(out["full"] == _state(2) for out in got)


# ------------------------------------------------------------------ never start over silently
def _fresh_inputs(tmp: Path, progress: int | None, shards: bool) -> tuple[Path, Located]:
    run_dir = tmp / "run"
    (run_dir / PROGRESS_DIR).mkdir(parents=True)
    if progress is not None:
        (run_dir / PROGRESS_DIR / "rank1").write_text(str(progress))
    stores = []
    if shards:
        _setup(tmp / "shm", "xor:2")
        own = _open(tmp / "shm", 0)
        stores = [LocatedInventory(StoreRef("h", 0, 0), own.inventory(verify=False))]
    return run_dir, Located({0: "h"}, stores)


FRESH = RecoveryPlan(version=None, source="fresh")


def test_a_fresh_job_starts_quietly(tmp_path: Path, caplog) -> None:
    run_dir, located = _fresh_inputs(tmp_path, None, shards=False)
    never_silently_fresh(FRESH, "nothing", located, run_dir, False, 0)
    assert caplog.records == []


@pytest.mark.parametrize("progress,shards", [(7, False), (None, True), (7, True)])
def test_nothing_restorable_after_progress_is_an_error(
    tmp_path: Path, progress: int | None, shards: bool
) -> None:
    run_dir, located = _fresh_inputs(tmp_path, progress, shards)
    with pytest.raises(RestoreError) as err:
        never_silently_fresh(FRESH, "fresh start: why", located, run_dir, False, 0)
    text = str(err.value)
    assert text.startswith("refusing to start over silently: ")
    assert ("records progress up to iteration 7" in text) == (progress is not None)
    assert ("stores hold snapshots of the job (h:node0/rank0)" in text) == shards
    assert "(fresh start: why)" in text and "CheckpointConfig.allow_fresh_start=True" in text


def test_a_job_that_ended_before_its_first_checkpoint_starts_over_loudly(
    tmp_path: Path, caplog
) -> None:
    """Progress within profiling plus one interval and no snapshot anywhere: nothing
    could have been saved, so the job starts over (logged); one iteration more is an
    error as before."""
    caplog.set_level(logging.INFO, logger="baft")
    run_dir, located = _fresh_inputs(tmp_path, 2, shards=False)  # iterations 0..2 done
    never_silently_fresh(FRESH, "nothing", located, run_dir, False, 0, began_by=3)
    (rec,) = caplog.records
    assert rec.getMessage() == (
        "starting over from iteration 0, losing 3 iteration(s): the job ended before its "
        "first checkpoint"
    )
    with pytest.raises(RestoreError, match="refusing to start over silently"):
        never_silently_fresh(FRESH, "nothing", located, run_dir, False, 0, began_by=2)


@pytest.mark.parametrize(
    ("first", "newest", "committed", "began_by", "allowed"),
    [
        (2, 3, 3, 3, True),  # the job's first rotation (from v2, k=3): v4 would be the first
        (2, 4, 4, 3, False),  # v4 committed a whole window old: it should have been rebuildable
        (2, 4, 3, 3, True),  # v4 written but never committed (a crash in its exchange)
        (2, 4, None, 3, True),  # nothing ever committed
        (7, 8, 8, 3, False),  # a rotation that began later (after a DCP restore): refuse
    ],
)
def test_only_the_first_young_rotation_lets_a_job_start_over(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog,
    first: int,
    newest: int,
    committed: int | None,
    began_by: int,
    allowed: bool,
) -> None:
    import baft.recover.startover as startover

    caplog.set_level(logging.INFO, logger="baft")
    run_dir, located = _fresh_inputs(tmp_path, newest, shards=True)
    located = Located(
        located.hosts,
        [
            dataclasses.replace(x, inventory=dataclasses.replace(x.inventory, committed=committed))
            for x in located.stores
        ],
    )
    meta = {
        v: DiffMeta(k=3, slice=v % 3, first_version=first, has_record=True, payload_nbytes=1)
        for v in range(first, newest + 1)
    }
    monkeypatch.setattr(startover, "diff_metas", lambda _: meta)
    if not allowed:
        with pytest.raises(RestoreError, match="refusing to start over silently"):
            never_silently_fresh(FRESH, "why", located, run_dir, False, 0, began_by=began_by)
        return
    never_silently_fresh(FRESH, "why", located, run_dir, False, 0, began_by=began_by)
    (rec,) = caplog.records
    assert rec.getMessage() == (
        f"starting over from iteration 0, losing {newest + 1} iteration(s): the job's "
        f"differential checkpoints began at v{first} and no committed version up to "
        f"v{newest} is a whole window of 3 payloads old, so no version was rebuildable"
    )


def test_allowed_fresh_start_and_dcp_fallback_are_logged_loudly(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="baft")
    run_dir, located = _fresh_inputs(tmp_path, 3, shards=True)
    never_silently_fresh(FRESH, "why", located, run_dir, True, 0)
    disk = RecoveryPlan(version=2, source="disk")
    never_silently_fresh(disk, "v=2 from disk: v=5 cannot be rebuilt", located, run_dir, False, 0)
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert caplog.records[1].getMessage() == (
        "snapshots in memory cannot be restored, falling back to DCP: v=2 from disk: "
        "v=5 cannot be rebuilt"
    )
    first = caplog.records[0].getMessage()
    assert first.startswith("starting over from iteration 0 as allowed (allow_fresh_start): ")
    assert "records progress up to iteration 3" in first and first.endswith("; why")


def test_snapshots_of_other_pp_dp_tp_sizes_are_an_error_on_every_rank(tmp_path: Path) -> None:
    _, red = _setup(tmp_path, "xor:2")  # written with dp=4
    other = Topology(num_pp=2, num_dp=2, ranks_per_node=1)

    def rank(r: int, transport: LocalTransport) -> Any:
        return agree(_open(tmp_path, r), transport, other, red, ())

    got = _run_ranks(rank)
    assert all(isinstance(g, TopologyMismatchError) for g in got), got
    assert "written under pp=1 dp=4 tp=1, but this job runs pp=2 dp=2 tp=1" in str(got[0])
