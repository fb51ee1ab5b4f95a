"""FaultInjector: records, fire-once across restarts, and each action on a real store."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from baft.faults import (
    FaultInjector,
    FaultRecord,
    FaultSpec,
    append_record,
    clear_records,
    corrupt_committed,
    read_records,
    records_path,
)
from baft.store.manifest import Manifest, RegionRecord, checksum, chunk_records
from baft.store.shm import SnapshotStore
from baft.topology import Topology

TOPO = Topology(num_pp=2, num_dp=2, ranks_per_node=2)  # nodes: {0, 1}, {2, 3}
JOB = "job"
ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """Stands in for the SIGKILL and the clock."""

    def __init__(self) -> None:
        self.kills = 0
        self.now = 1000.0

    def kill(self) -> None:
        self.kills += 1

    def clock(self) -> float:
        self.now += 1.0
        return self.now


def make(tmp_path: Path, texts: list[str], rank: int, rec: Recorder | None = None) -> FaultInjector:
    rec = rec or Recorder()
    return FaultInjector(
        [FaultSpec.parse(t) for t in texts],
        run_dir=tmp_path / "run",
        rank=rank,
        topology=TOPO,
        store_root=tmp_path / "shm",
        job_id=JOB,
        clock=rec.clock,
        kill_self=rec.kill,
    )


def fake_stores(tmp_path: Path, job: str = JOB) -> None:
    for rank in range(TOPO.world_size):
        d = tmp_path / "shm" / job / f"node{TOPO.node_of(rank)}" / f"rank{rank}"
        d.mkdir(parents=True)
        (d / "slot0.data").write_bytes(b"x" * 10)


def store_dirs(tmp_path: Path) -> list[str]:
    root = tmp_path / "shm"
    return sorted(str(p.relative_to(root)) for p in root.glob("*/node*/rank*"))


def test_constructor_does_no_io_and_validates(tmp_path: Path):
    make(tmp_path, ["kill:rank=1,iter=7"], rank=1)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="rank 4 does not exist"):
        make(tmp_path, ["kill:rank=4,iter=7"], rank=1)
    with pytest.raises(ValueError, match="rank 4 outside"):
        make(tmp_path, [], rank=4)
    with pytest.raises(ValueError, match="point 'lunch' is not one of"):
        make(tmp_path, [], rank=0).fire("lunch", 1)


def test_kill_fires_on_its_rank_point_and_iteration_only(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="baft")
    recs = {r: Recorder() for r in range(4)}
    injs = {r: make(tmp_path, ["kill:rank=1,iter=7"], r, recs[r]) for r in range(4)}
    for it in range(10):
        for point in ("iteration", "snapshot", "transfer", "persist", "step"):
            for r, inj in injs.items():
                inj.fire(point, it)
                if r == 1 and recs[1].kills == 1 and it == 7:
                    assert point == "step"
    assert [recs[r].kills for r in range(4)] == [0, 1, 0, 0]
    assert read_records(tmp_path / "run") == (
        FaultRecord(spec="kill:rank=1,iter=7", rank=1, time=1001.0, iteration=7, point="step"),
    )
    assert [r.getMessage() for r in caplog.records] == [
        "injecting kill:rank=1,iter=7 at step (rank 1, iteration 7)"
    ]


def test_fire_is_idempotent_and_fires_once_across_restart(tmp_path: Path):
    texts = ["kill:rank=1,iter=7", "hang:rank=1,iter=3,at=recovery"]
    first = Recorder()
    inj = make(tmp_path, texts, 1, first)
    inj.fire("step", 7)
    inj.fire("step", 7)
    inj.fire("step", 8)
    assert first.kills == 1
    assert [s.spec_id for s in inj.pending()] == ["hang:rank=1,iter=3,at=recovery"]
    # torchrun restarts the group; the job resumes at iteration 7 and replays it
    again = Recorder()
    new = make(tmp_path, texts, 1, again)
    assert [r.spec for r in new.load()] == ["kill:rank=1,iter=7"]
    for it in range(7, 10):
        new.fire("step", it)
    assert again.kills == 0
    assert [s.spec_id for s in new.pending()] == ["hang:rank=1,iter=3,at=recovery"]
    assert len(new.fired_records()) == 1


def test_fire_loads_earlier_records_without_explicit_load(tmp_path: Path):
    make(tmp_path, ["delete:rank=0,iter=2"], 0).fire("step", 2)
    fake_stores(tmp_path)
    make(tmp_path, ["delete:rank=0,iter=2"], 0).fire("step", 2)
    assert "node0/rank0" in " ".join(store_dirs(tmp_path))


def test_recovery_point_fires_on_first_restore_at_or_after(tmp_path: Path):
    rec = Recorder()
    inj = make(tmp_path, ["kill:rank=2,iter=6,at=recovery"], 2, rec)
    inj.fire("recovery", 4)
    inj.fire("step", 8)
    assert rec.kills == 0
    inj.fire("recovery", 8)
    assert rec.kills == 1
    (only,) = inj.fired_records()
    assert (only.iteration, only.point) == (8, "recovery")


def test_node_fault_removes_whole_node_and_kills_each_of_its_ranks(tmp_path: Path):
    fake_stores(tmp_path)
    recs = {r: Recorder() for r in range(4)}
    injs = [make(tmp_path, ["node:1,iter=12"], r, recs[r]) for r in range(4)]
    for inj in injs:
        inj.fire("iteration", 0)  # the attempt starts: earlier records are read here
    for inj in injs:
        inj.fire("step", 12)
    assert [recs[r].kills for r in range(4)] == [0, 0, 1, 1]
    assert store_dirs(tmp_path) == ["job/node0/rank0", "job/node0/rank1"]
    assert not (tmp_path / "shm" / JOB / "node1").exists()
    assert sorted(r.rank for r in read_records(tmp_path / "run")) == [2, 3]


def test_power_removes_every_store_of_the_job_only(tmp_path: Path):
    fake_stores(tmp_path)
    fake_stores(tmp_path, job="other-job")
    rec = Recorder()
    make(tmp_path, ["power:iter=20,at=persist"], 3, rec).fire("persist", 20)
    assert rec.kills == 1
    assert not (tmp_path / "shm" / JOB).exists()
    assert len(store_dirs(tmp_path)) == 4  # other-job untouched


def test_delete_removes_only_that_rank_and_keeps_running(tmp_path: Path):
    fake_stores(tmp_path)
    rec = Recorder()
    for r in range(4):
        make(tmp_path, ["delete:rank=2,iter=5"], r, rec).fire("step", 5)
    assert rec.kills == 0
    assert store_dirs(tmp_path) == ["job/node0/rank0", "job/node0/rank1", "job/node1/rank3"]


def test_non_terminal_faults_act_before_terminal_ones(tmp_path: Path):
    fake_stores(tmp_path)
    rec = Recorder()
    inj = make(tmp_path, ["kill:rank=0,iter=1", "delete:rank=0,iter=1"], 0, rec)
    inj.fire("step", 1)
    assert [r.spec for r in inj.fired_records()] == ["delete:rank=0,iter=1", "kill:rank=0,iter=1"]
    assert rec.kills == 1 and "job/node0/rank0" not in store_dirs(tmp_path)


def test_hang_sleeps_forever(tmp_path: Path):
    naps: list[float] = []

    def sleep(s: float) -> None:
        naps.append(s)
        if len(naps) == 3:
            raise TimeoutError

    inj = FaultInjector(
        [FaultSpec.parse("hang:rank=1,iter=9,at=transfer")],
        run_dir=tmp_path,
        rank=1,
        topology=TOPO,
        store_root=tmp_path,
        job_id=JOB,
        sleep=sleep,
    )
    inj.fire("transfer", 8)
    assert naps == []
    with pytest.raises(TimeoutError):
        inj.fire("transfer", 9)
    assert naps == [3600.0] * 3
    assert [r.spec for r in read_records(tmp_path)] == ["hang:rank=1,iter=9,at=transfer"]


def test_slow_delays_slots_for_its_iterations_once_per_job(tmp_path: Path):
    texts = ["slow:rank=1,iter=9,s=0.5,iters=3", "slow:rank=1,iter=10,s=0.25"]
    inj = make(tmp_path, texts, 1)
    assert make(tmp_path, texts, 0).slot_delay(10) == 0.0
    got = [inj.slot_delay(i) for i in range(8, 14) for _ in range(2)]
    assert got == [0, 0, 0.5, 0.5, 0.75, 0.75, 0.5, 0.5, 0, 0, 0, 0]
    records = read_records(tmp_path / "run")
    assert [(r.spec, r.iteration, r.point) for r in records] == [
        ("slow:rank=1,iter=9,s=0.5,iters=3", 9, "slot"),
        ("slow:rank=1,iter=10,s=0.25", 10, "slot"),
    ]
    for point in ("step", "iteration"):
        inj.fire(point, 9)  # slow never fires at a point
    assert make(tmp_path, texts, 1).slot_delay(10) == 0.0  # after a restart: done


def _write(store: SnapshotStore, version: int, fill: int, commit: bool = True) -> int:
    slot = store.begin(version)
    data, red = store.data_view(slot), store.red_view(slot)
    data[:] = np.arange(data.size, dtype=np.uint8) ^ fill
    red[:] = fill
    manifest = Manifest(
        version=version,
        iteration=version,
        rank=store.rank,
        node=store.node,
        owned_start=0,
        owned_stop=data.size,
        data_nbytes=data.size,
        red_nbytes=red.size,
        chunks=chunk_records(data, 256),
        regions=(
            RegionRecord(0, 0, 100, checksum(red[:100])),
            RegionRecord(1, 100, 300, checksum(red[100:400])),
        ),
        num_pp=2,
        num_dp=2,
        num_tp=1,
        ranks_per_node=2,
        redundancy="none",
        group=(store.rank,),
        group_shard_nbytes=(data.size,),
        layout_digest="-",
    )
    store.complete(slot, manifest)
    if commit:
        store.commit(version)
    return slot


def _snapshot(store: SnapshotStore) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.path.iterdir()) if p.suffix != ".json"}


@pytest.mark.parametrize(
    ("target", "file", "offset", "problem"),
    [
        ("data", "slot1.data", 500, "data chunk 1 [256, +256) checksum"),
        ("redundancy", "slot1.red", 250, "redundancy region 1 checksum mismatch"),
    ],
)
def test_corrupt_flips_one_byte_of_newest_committed_slot(
    tmp_path: Path, target: str, file: str, offset: int, problem: str
):
    store = SnapshotStore(tmp_path / "shm", JOB, 1, 2, 1 << 20)
    store.allocate(1000, 400)
    _write(store, 1, 0x11)
    assert _write(store, 2, 0x22) == 1
    assert store.begin(3) == 0  # v3 in flight in slot 0: must stay untouched
    before = _snapshot(store)
    rec = Recorder()
    spec = f"corrupt:rank=2,iter=5,target={target}"
    make(tmp_path, [spec], 2, rec).fire("step", 5)
    after = _snapshot(store)
    assert rec.kills == 0
    diff = {
        name: np.flatnonzero(np.frombuffer(before[name], np.uint8) != np.frombuffer(b, np.uint8))
        for name, b in after.items()
    }
    assert {name: idx.tolist() for name, idx in diff.items() if idx.size} == {file: [offset]}
    assert after[file][offset] == before[file][offset] ^ 0xFF
    problems = store.verify(1)
    assert len(problems) == 1 and problem in problems[0]
    assert store.committed_version() == 2
    store.close()


def test_corrupt_without_committed_version_changes_nothing(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="baft")
    store = SnapshotStore(tmp_path / "shm", JOB, 0, 0, 1 << 20)
    store.allocate(1000, 400)
    _write(store, 1, 0x11, commit=False)
    before = _snapshot(store)
    make(tmp_path, ["corrupt:rank=0,iter=1"], 0).fire("step", 1)
    assert _snapshot(store) == before
    assert "holds no committed data bytes; nothing was changed" in caplog.text
    assert corrupt_committed(SnapshotStore(tmp_path / "none", JOB, 0, 0, 0), "data") is None
    store.close()


def test_concurrent_appends_stay_whole_lines(tmp_path: Path):
    pids = []
    for child in range(4):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                for i in range(100):
                    rec = FaultRecord(spec="x" * 300, rank=child, time=i, iteration=i, point="step")
                    append_record(tmp_path, rec)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0
    lines = records_path(tmp_path).read_text().splitlines()
    records = read_records(tmp_path)
    assert len(lines) == len(records) == 400
    assert sorted((r.rank, r.iteration) for r in records) == [
        (c, i) for c in range(4) for i in range(100)
    ]
    clear_records(tmp_path)
    assert read_records(tmp_path) == ()


@pytest.mark.timeout(60)
def test_kill_really_sigkills_the_process_and_leaves_the_record(tmp_path: Path):
    script = textwrap.dedent(
        f"""
        import logging
        import sys
        from pathlib import Path
        from baft.faults import FaultInjector, FaultSpec
        from baft.topology import Topology
        logging.basicConfig(level=logging.INFO, format="[baft] %(message)s")
        inj = FaultInjector(
            [FaultSpec.parse("kill:rank=1,iter=7")], run_dir=Path({str(tmp_path)!r}), rank=1,
            topology=Topology(num_dp=2), store_root=Path({str(tmp_path)!r}), job_id="job",
        )
        inj.load()
        for it in range(10):
            inj.fire("step", it)
            print("survived", it, flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr
    assert proc.stdout.split("\n")[-2] == "survived 6"
    assert "[baft] injecting kill:rank=1,iter=7 at step (rank 1, iteration 7)" in proc.stderr
    (rec,) = read_records(tmp_path)
    assert (rec.spec, rec.rank, rec.iteration, rec.point) == ("kill:rank=1,iter=7", 1, 7, "step")
