"""SnapshotStore: allocation, budget, version protocol, checksums, restart, SIGKILL safety."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from baft.store import reclaim
from baft.store.manifest import Manifest, chunk_records
from baft.store.paths import find_stores
from baft.store.shm import (
    MANIFEST_RESERVE_BYTES,
    PAGE,
    MemoryBudgetError,
    SnapshotStore,
)
from baft.topology import Topology
from tests.unit.test_store_support import shm_dir

TOPO = Topology(num_dp=2, ranks_per_node=1)


def _manifest(store: SnapshotStore, slot: int, version: int, meta: dict | None = None) -> Manifest:
    data = store.data_view(slot)
    return Manifest(
        version=version,
        iteration=version,
        rank=store.rank,
        node=store.node,
        owned_start=100,
        owned_stop=100 + data.size,
        data_nbytes=data.size,
        red_nbytes=0,
        chunks=chunk_records(data, 1000),
        regions=(),
        num_pp=1,
        num_dp=2,
        num_tp=1,
        ranks_per_node=1,
        redundancy="none",
        group=(store.rank,),
        group_shard_nbytes=(data.size,),
        layout_digest="-",
        meta=meta or {},
    )


def _write(store: SnapshotStore, version: int, fill: int, commit: bool = True) -> int:
    slot = store.begin(version)
    store.data_view(slot)[:] = fill
    store.complete(slot, _manifest(store, slot, version))
    if commit:
        store.commit(version)
    return slot


def test_constructor_does_no_io_and_paths(tmp_path: Path):
    store = SnapshotStore(tmp_path / "root", "job-1", 3, 7, 1 << 20)
    assert store.path == tmp_path / "root" / "job-1" / "node3" / "rank7"
    assert not (tmp_path / "root").exists()
    with pytest.raises(ValueError, match="plain name"):
        SnapshotStore(tmp_path, "../evil", 0, 0, 1)


def test_allocate_permissions_sizes_and_host_bytes():
    with shm_dir() as root:
        store = SnapshotStore(root, "job", 0, 1, 1 << 20)
        store.allocate(10_000, 3_000)
        assert stat.S_IMODE(store.path.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
        files = sorted(p.name for p in store.path.iterdir())
        assert files == ["progress", "slot0.data", "slot0.red", "slot1.data", "slot1.red"]
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in store.path.iterdir())
        assert store.data_view(0).size == 10_000 and store.red_view(1).size == 3_000
        pages = 2 * (-(-10_000 // PAGE) + -(-3_000 // PAGE)) * PAGE
        assert store.host_bytes() == pages + PAGE  # + the progress record's page
        assert pages + MANIFEST_RESERVE_BYTES == SnapshotStore.required_bytes(10_000, 3_000)
        _write(store, 1, 5)
        assert store.host_bytes() <= SnapshotStore.required_bytes(10_000, 3_000)
        store.destroy()
        assert not store.path.exists() and store.host_bytes() == 0


def test_budget_error_says_needed_budget_and_fix(tmp_path: Path):
    store = SnapshotStore(tmp_path, "job", 0, 0, 100_000)
    with pytest.raises(MemoryBudgetError, match=r"needs .* budget_bytes is 100,000 B; raise"):
        store.allocate(1 << 20, 0)
    assert not (tmp_path / "job").exists()


def test_begin_never_returns_committed_slot(tmp_path: Path):
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    store.allocate(4096, 0)
    s1 = _write(store, 1, 1)
    s2 = _write(store, 2, 2)
    assert s1 != s2
    # v3 complete but not committed: v4 must overwrite v3, never committed v2
    s3 = _write(store, 3, 3, commit=False)
    assert s3 == s1
    s4 = store.begin(4)
    assert s4 == s3 and s4 != s2
    inv = store.inventory()
    assert inv.committed == 2
    assert [(v.version, v.state, v.data_ok) for v in inv.versions] == [
        (4, "writing", False),
        (2, "complete", True),
    ]
    assert store.data_view(s2)[0] == 2


def test_protocol_misuse_raises(tmp_path: Path):
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    store.allocate(100, 0)
    with pytest.raises(ValueError, match="call begin"):
        store.complete(0, _manifest(store, 0, 1))
    with pytest.raises(ValueError, match="no complete v9"):
        store.commit(9)
    slot = store.begin(1)
    bad = _manifest(store, slot, 1)
    with pytest.raises(ValueError, match="chunks cover"):
        store.complete(slot, Manifest(**{**_as_kwargs(bad), "chunks": bad.chunks[:0]}))
    with pytest.raises(RuntimeError, match="allocate"):
        SnapshotStore(tmp_path, "job", 0, 1, 1 << 20).data_view(0)


def _as_kwargs(m: Manifest) -> dict:
    return {f: getattr(m, f) for f in m.__dataclass_fields__}


def test_restart_reuses_files_and_contents(tmp_path: Path):
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    store.allocate(5000, 0)
    slot = store.begin(7)
    store.data_view(slot)[:] = np.arange(5000, dtype=np.uint32).astype(np.uint8)
    store.complete(slot, _manifest(store, slot, 7, meta={"rng": [1, 2]}))
    store.commit(7)
    store.close()
    again = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    inv = again.inventory()  # before allocate: reads the files read-only
    assert inv.committed == 7 and inv.versions[0].usable
    again.allocate(5000, 0)
    assert again.verify(slot) == []
    assert (
        again.data_view(slot).tobytes()
        == np.arange(5000, dtype=np.uint32).astype(np.uint8).tobytes()
    )
    manifest = again.read_manifest(slot)
    assert manifest is not None and manifest.meta == {"rng": [1, 2]}
    # a different size invalidates the slot instead of trusting stale bytes
    again.allocate(6000, 0)
    assert again.inventory().versions == ()


@pytest.mark.parametrize("new_nbytes", [6000, 4000], ids=["grows", "shrinks"])
def test_a_new_layout_keeps_the_committed_version(tmp_path: Path, new_nbytes: int):
    """A re-plan that moves shard boundaries allocates other sizes; ``keep_version`` keeps
    the committed version's bytes and manifest (slots at least as large as its files), the
    other versions go, and the next version is written beside it."""
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    store.allocate(5000, 0)
    _write(store, 3, 0x33)
    kept_slot = _write(store, 4, 0x44)
    assert store.allocate(new_nbytes, 0, keep_version=4) == 4
    assert store.data_view(0).size == store.data_view(1).size == max(5000, new_nbytes)
    store.clear_versions(keep=4)
    assert store.verify(kept_slot) == []
    assert (store.data_view(kept_slot)[:5000] == 0x44).all()
    inv = store.inventory()
    assert inv.committed == 4 and [v.version for v in inv.versions] == [4]
    slot = store.begin(5)
    assert slot != kept_slot
    assert store.allocate(5000, 0, keep_version=9) is None  # nothing to keep: as before


def test_read_version_is_one_read_of_a_slot(tmp_path: Path):
    """A restore's read of a slot: the manifest, and the bytes only when it holds the
    version asked for (and only the kinds asked for)."""
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    store.allocate(3000, 0)
    slot = _write(store, 5, fill=7)
    m, data, red = store.read_version(slot, 5, data=True, red=False)
    assert m is not None and m.version == 5 and red is None
    assert data is not None and data.size == m.data_nbytes and set(data.tolist()) == {7}
    m, data, red = store.read_version(slot, 4, data=True, red=True)  # another version
    assert m is not None and m.version == 5 and data is None and red is None
    store.close()


def test_verify_detects_flipped_bytes_in_data_and_redundancy(tmp_path: Path):
    from baft.store.coding import GroupLayout, Redundancy
    from baft.store.manifest import region_records

    layout = GroupLayout(Redundancy.parse("replicate:1"), (0, 1), (3000, 2000))
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    store.allocate(3000, layout.redundancy_nbytes(0))
    slot = store.begin(1)
    store.data_view(slot)[:] = 9
    store.red_view(slot)[:] = 4
    m = Manifest.for_layout(
        topology=TOPO,
        layout=layout,
        rank=0,
        version=1,
        iteration=1,
        owned_start=0,
        owned_stop=3000,
        chunks=chunk_records(store.data_view(slot), 1024),
        regions=region_records(store.red_view(slot), layout.regions(0)),
    )
    store.complete(slot, m)
    assert store.verify(slot) == []
    store.data_view(slot)[2047] ^= 0x10
    problems = store.verify(slot)
    assert len(problems) == 1 and "data chunk 1 [1024, +1024)" in problems[0]
    store.red_view(slot)[5] ^= 1
    info = store.inventory().versions[0]
    assert (info.data_ok, info.bad_regions, info.usable) == (False, (0,), False)
    unverified = store.inventory(verify=False).versions[0]
    assert (unverified.verified, unverified.usable) == (False, False)


def _age(root: Path, seconds: float) -> None:
    """Every file and directory under ``root`` last changed ``seconds`` ago."""
    then = time.time() - seconds
    for f in root.rglob("*"):
        os.utime(f, (then, then))


def test_reclaim_stale_jobs_and_find_stores(tmp_path: Path):
    """Stores of jobs that no live process holds and nobody wrote to lately are freed; the
    caller's own job, a job with one store in use (its lock held), a job written to
    moments ago and a directory that is no job store stay."""
    stores = [
        SnapshotStore(tmp_path, job, node, rank, 1 << 20)
        for job in ("old", "keep", "live")
        for node, rank in ((0, 0), (1, 1))
    ]
    for store in stores:
        store.allocate(10, 0)
    in_use = stores[-1]  # job "live", rank 1: its process runs on
    for store in stores[:-1]:
        store.close()  # their processes ended: the locks went with them
    (tmp_path / "not-a-store").mkdir()
    (tmp_path / "not-a-store" / "x.txt").write_text("mine")
    assert [a.rank for a in find_stores(tmp_path / "keep")] == [0, 1]
    assert len(find_stores(tmp_path)) == 6
    _age(tmp_path, 7200)
    removed = reclaim.reclaim_stale_jobs(tmp_path, idle_s=3600, keep_job_id="keep")
    assert removed == [tmp_path / "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "live", "not-a-store"]
    # without a job to keep, every idle unheld one goes; the store in use stays
    assert reclaim.reclaim_stale_jobs(tmp_path, idle_s=3600) == [tmp_path / "keep"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "not-a-store"]
    assert len(find_stores(tmp_path / "live")) == 2
    in_use.close()  # unheld now, but written to moments ago (a restart between launches)
    SnapshotStore(tmp_path, "live", 0, 0, 0).begin(1)  # its records change
    assert reclaim.reclaim_stale_jobs(tmp_path, idle_s=3600) == []
    _age(tmp_path, 7200)
    assert reclaim.reclaim_stale_jobs(tmp_path, idle_s=3600) == [tmp_path / "live"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-store"]
    assert find_stores(tmp_path / "nothing") == []


_CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from pathlib import Path
    from baft.store.manifest import Manifest, chunk_records
    from baft.store.shm import SnapshotStore
    store = SnapshotStore(Path(sys.argv[1]), "job", 0, 0, 1 << 26)
    n = 1 << 22
    store.allocate(n, 0)
    first = v = (store.committed_version() or 0) + 1
    while True:
        slot = store.begin(v)
        data = store.data_view(slot)
        for start in range(0, n, 1 << 16):
            data[start:start + (1 << 16)] = v % 251
        chunks = chunk_records(data, 1 << 18)
        store.complete(slot, Manifest(version=v, iteration=v, rank=0, node=0, owned_start=0,
            owned_stop=n, data_nbytes=n, red_nbytes=0, chunks=chunks, regions=(), num_pp=1,
            num_dp=1, num_tp=1, ranks_per_node=1, redundancy="none", group=(0,),
            group_shard_nbytes=(n,), layout_digest="-"))
        store.commit(v)
        if v == first + 2:
            print("ready", flush=True)
        v += 1
    """
)


@pytest.mark.timeout(60)
def test_sigkill_mid_write_leaves_committed_version_clean(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    delays = [0.0, 0.013, 0.031, 0.057]
    seen = set()
    for delay in delays:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 26)
        inv = store.inventory()
        committed = inv.committed
        assert committed is not None and committed >= 3
        info = inv.get(committed)
        assert info is not None and info.usable, inv
        store.allocate(1 << 22, 0)
        view = store.data_view(info.slot)
        assert np.all(view == committed % 251)
        assert store.verify(info.slot) == []
        seen.add(committed)
        store.close()
    assert len(seen) == len(delays)  # each run moved on from the previous one


_PHASED = textwrap.dedent(
    """
    import os, signal, sys, numpy as np
    from pathlib import Path
    from baft.store.manifest import Manifest, chunk_records
    from baft.store.shm import SnapshotStore
    store = SnapshotStore(Path(sys.argv[1]), "job", 0, 0, 1 << 24)
    phase, n = sys.argv[2], 1 << 16
    store.allocate(n, 0)
    die = lambda p: os.kill(os.getpid(), signal.SIGKILL) if p == phase else None
    for v in (1, 2, 3, 4):
        slot = store.begin(v)
        if v == 4: die("after-begin")
        data = store.data_view(slot)
        data[: n // 2] = v
        if v == 4: die("mid-data")
        data[n // 2 :] = v
        m = Manifest(version=v, iteration=v, rank=0, node=0, owned_start=0, owned_stop=n,
            data_nbytes=n, red_nbytes=0, chunks=chunk_records(data, 4096), regions=(),
            num_pp=1, num_dp=1, num_tp=1, ranks_per_node=1, redundancy="none", group=(0,),
            group_shard_nbytes=(n,), layout_digest="-")
        if v == 4: die("before-complete")
        store.complete(slot, m)
        if v == 4: die("before-commit")
        store.commit(v)
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "phase,committed,v4_state",
    [
        ("after-begin", 3, "writing"),
        ("mid-data", 3, "writing"),
        ("before-complete", 3, "writing"),
        ("before-commit", 3, "complete"),
        ("never", 4, "complete"),
    ],
)
def test_sigkill_at_each_phase(tmp_path: Path, phase: str, committed: int, v4_state: str):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-c", _PHASED, str(tmp_path), phase], env=env, timeout=30
    )
    assert proc.returncode == (0 if phase == "never" else -signal.SIGKILL)
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 24)
    inv = store.inventory()
    assert inv.committed == committed
    assert [(v.version, v.state, v.usable) for v in inv.versions] == [
        (4, v4_state, v4_state == "complete"),
        (3, "complete", True),
    ]
    store.allocate(1 << 16, 0)
    info = inv.get(3)
    assert info is not None and np.all(store.data_view(info.slot) == 3)
    assert store.verify(info.slot) == []


def test_manifest_json_and_inventory_pickle_round_trip(tmp_path: Path):
    import json
    import pickle

    from baft.store.manifest import dumps

    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 20)
    store.allocate(3000, 0)
    _write(store, 4, 1)
    inv = store.inventory()
    manifest = inv.versions[0].manifest
    assert manifest is not None
    assert Manifest.from_dict(json.loads(dumps(manifest))) == manifest
    assert pickle.loads(pickle.dumps(inv)) == inv
    assert manifest.topology() == TOPO and manifest.shard_nbytes == 3000
