"""Memory that outlives its use is freed: copies kept from a restore, stores of an earlier
rank numbering, and other jobs' stores that no live process holds."""

from __future__ import annotations

import os
import time
from pathlib import Path

from baft.store import reclaim
from baft.store.manifest import Manifest, chunk_records
from baft.store.shm import SnapshotStore


def _store_with(root: Path, job: str, node: int, rank: int, versions: tuple[int, ...]) -> None:
    """A store holding complete ``versions`` (the last one committed), then closed."""
    store = SnapshotStore(root, job, node, rank, 1 << 20)
    store.allocate(100, 0)
    for v in versions:
        slot = store.begin(v)
        data = store.data_view(slot)
        data[:] = v
        store.complete(
            slot,
            Manifest(
                version=v,
                iteration=v,
                rank=rank,
                node=node,
                owned_start=0,
                owned_stop=100,
                data_nbytes=100,
                red_nbytes=0,
                chunks=chunk_records(data, 64),
                regions=(),
                num_pp=1,
                num_dp=4,
                num_tp=1,
                ranks_per_node=2,
                redundancy="none",
                group=(rank,),
                group_shard_nbytes=(100,),
                layout_digest="-",
            ),
        )
        store.commit(v)
    store.close()


def _dirs(root: Path, job: str = "job") -> list[str]:
    return sorted(f"{p.parent.name}/{p.name}" for p in root.glob(f"{job}/node*/rank*"))


def test_reclaim_unless_holding_drops_the_versions_after_the_restored_one(tmp_path: Path) -> None:
    _store_with(tmp_path, "job", 0, 0, (4, 5))
    _store_with(tmp_path, "job", 0, 1, (3,))
    keep = SnapshotStore(tmp_path, "job", 0, 0, 0)
    assert keep.reclaim_unless_holding(4) is False
    found = [m.version for s in (0, 1) if (m := keep.read_manifest(s)) is not None]
    assert found == [4] and keep.committed_version() == 4  # v5 of that timeline is gone
    assert keep.read(next(s for s in (0, 1) if keep.read_manifest(s)), "data", 0, 3).tolist() == [
        4,
        4,
        4,
    ]
    assert SnapshotStore(tmp_path, "job", 0, 1, 0).reclaim_unless_holding(4) is True
    assert SnapshotStore(tmp_path, "job", 0, 0, 0).reclaim_unless_holding(None) is True
    assert _dirs(tmp_path) == []


def test_reclaim_foreign_frees_copies_once_a_newer_version_is_committed(tmp_path: Path) -> None:
    _store_with(tmp_path, "job", 0, 0, (4,))  # a copy kept from the restore of v4
    _store_with(tmp_path, "job", 0, 1, (4, 6))  # an old directory holding something newer
    _store_with(tmp_path, "job", 1, 2, (5, 6))  # this host's own store now
    removed = reclaim.reclaim_foreign(tmp_path, "job", {(1, 2)}, newer_than=5)
    assert [p.name for p in removed] == ["rank0"]
    assert _dirs(tmp_path) == ["node0/rank1", "node1/rank2"]


def test_other_jobs_are_reclaimed_only_when_idle_and_unlocked(tmp_path: Path) -> None:
    _store_with(tmp_path, "old", 0, 0, (1,))
    _store_with(tmp_path, "live", 0, 0, (1,))
    _store_with(tmp_path, "job", 0, 0, (1,))
    live = SnapshotStore(tmp_path, "live", 0, 0, 1 << 20)
    live.allocate(100, 0)  # a running process holds its store's lock
    hour_ago = time.time() - 7200
    for f in tmp_path.rglob("*"):
        os.utime(f, (hour_ago, hour_ago))
    assert reclaim.reclaim_other_jobs(tmp_path, "job", idle_s=3600) == [tmp_path / "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "live"]
    live.close()  # the process ends: its lock goes with it
    for f in tmp_path.rglob("*"):
        os.utime(f, (hour_ago, hour_ago))
    assert reclaim.reclaim_other_jobs(tmp_path, "job", idle_s=3600) == [tmp_path / "live"]
    # a job written to moments ago (between torchrun restarts: no lock) stays
    _store_with(tmp_path, "restarting", 0, 0, (1,))
    assert reclaim.reclaim_other_jobs(tmp_path, "job", idle_s=3600) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "restarting"]
