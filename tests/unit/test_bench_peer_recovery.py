"""The peers' downtime rows of ``baft bench recovery`` (torchft, NVRx): parsing the jobs'
records into rows, the kills sent from outside, the job's end, and the in-process replay
that explains a final state."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from baft_bench.dp_job import DPJob, replay, state_digest, state_tensors
from baft_bench.peer_downtime import contributions, failure, failures, final_state, row
from baft_bench.peer_jobs import ATTEMPTS, STOP, emit, kill_from_outside, read, stop_at


def _a(pid: int, replica: int, step: int, t0: float, t1: float, committed: bool = True,
       participants: int = 2, participating: bool = True) -> dict[str, object]:  # fmt: skip
    return {"pid": pid, "replica": replica, "step": step, "t0": t0, "t1": t1,
            "committed": committed, "participants": participants, "participating": participating}  # fmt: skip


def _torchft_like() -> tuple[list[dict], list[dict], list[dict]]:
    """Replica 1 (pid 11) killed at t=10 during step 3; survivor 10 fails step 3 at 10.2,
    commits it alone at 15.5 (t0 10.3), steps 4-5 alone; pid 12 starts at 12, ready at
    14, heals to step 6 (not participating), then both train step 7."""
    att = [_a(10, 0, s, s, s + 1) for s in range(3)] + [_a(11, 1, s, s, s + 1) for s in range(3)]
    att += [
        _a(10, 0, 3, 9.5, 10.2, committed=False),
        _a(10, 0, 3, 10.3, 15.5, participants=1),
        _a(10, 0, 4, 15.5, 16.0, participants=1),
        _a(10, 0, 5, 16.0, 16.5, participants=1),
        _a(10, 0, 6, 16.5, 17.0, participants=1),
        _a(12, 1, 6, 14.0, 17.0, participants=1, participating=False),
        _a(10, 0, 7, 17.0, 17.5),
        _a(12, 1, 7, 17.0, 17.6),
    ]
    ready = [
        {"pid": 10, "replica": 0, "t_start": 0.0, "t_ready": 0.5, "restore_s": None},
        {"pid": 12, "replica": 1, "t_start": 12.0, "t_ready": 14.0, "restore_s": 1.25},
    ]
    kills = [{"replica": 1, "pid": 11, "step": 3, "t": 10.0}]
    return kills, att, ready


def test_failure_measures_a_survivor_that_goes_on_and_a_replica_that_heals() -> None:
    kills, att, ready = _torchft_like()
    f = failure(kills, 0, att, ready, replicas=2)
    assert f["downtime_s"] == pytest.approx(5.5)  # 10 -> 15.5: step 3 retried alone
    assert f["full_strength_s"] == pytest.approx(7.5)  # 10 -> 17.5: step 7, both
    assert f["lost_iterations"] == 1  # the failed attempt of step 3; nothing went back
    assert f["dropped_batches"] == 4  # steps 3, 4, 5, 6 without replica 1's rows
    assert f["survivors_replaced"] == 0
    assert f["seconds"] == pytest.approx(
        {"detect": 0.2, "restart": 2.0, "ready": 2.0, "restore": 1.25, "rejoin": 3.0}
    )


def test_a_job_that_starts_over_loses_everything_and_replaces_its_survivor() -> None:
    """The survivor (pid 10) dies too; new processes of both replicas start at step 0."""
    att = [_a(10, 0, s, s, s + 1) for s in range(5)] + [_a(11, 1, s, s, s + 1) for s in range(5)]
    att += [_a(20, 0, 0, 20.0, 21.0, participants=1), _a(21, 1, 1, 21.0, 22.0), _a(20, 0, 1, 21.0, 22.0)]  # fmt: skip
    ready = [
        {"pid": 20, "replica": 0, "t_start": 15.0, "t_ready": 19.0, "restore_s": None},
        {"pid": 21, "replica": 1, "t_start": 16.0, "t_ready": 20.5, "restore_s": 0.5},
    ]
    f = failure([{"replica": 1, "pid": 11, "step": 5, "t": 5.2}], 0, att, ready, replicas=2)
    assert f["lost_iterations"] == 5  # steps 0-4 done again
    assert f["survivors_replaced"] == 1
    assert f["downtime_s"] == pytest.approx(21.0 - 5.2)
    assert f["dropped_batches"] == 1


def test_failures_are_cut_at_the_next_kill_and_rows_take_medians() -> None:
    kills, att, ready = _torchft_like()
    later = [_a(10, 0, 8, 20.5, 25.0, participants=1)]
    two = [*kills, {"replica": 1, "pid": 12, "step": 8, "t": 20.0}]
    fs = failures(two, att + later, ready, replicas=2)
    assert [f["downtime_s"] for f in fs] == pytest.approx([5.5, 5.0])
    assert fs[1]["full_strength_s"] is None  # never both again before the end
    r = row("rank crash (SIGKILL)", "torchft", fs, final={"bit_identical": False})
    assert r["downtime_median_s"] == pytest.approx(5.25)
    assert r["full_strength_s"] == pytest.approx([7.5])
    assert r["lost_iterations"] == [1, 0] and r["final"] == {"bit_identical": False}


def test_no_commit_after_a_kill_is_an_error() -> None:
    kills, att, ready = _torchft_like()
    with pytest.raises(ValueError, match="no committed step"):
        failure([{**kills[0], "t": 100.0}], 0, att, ready, replicas=2)


def test_final_state_compares_digests() -> None:
    ref = [{"replica": 0, "step": 9, "digest": "a"}, {"replica": 1, "step": 9, "digest": "a"}]
    same = final_state(ref, ref, None)
    assert same["bit_identical"] and same["replicas_agree"]
    split = final_state([{**ref[0], "digest": "b"}, ref[1]], ref, {"max_abs": 1.0, "rel_l2": 0.1})
    assert not split["bit_identical"] and not split["replicas_agree"]
    assert split["model_diff"] == {"max_abs": 1.0, "rel_l2": 0.1}


def test_contributions_follow_torchfts_participation() -> None:
    _, att, _ = _torchft_like()
    assert contributions(att, replicas=2) == [
        (0, [0, 1], 2), (1, [0, 1], 2), (2, [0, 1], 2),
        (3, [0], 1), (4, [0], 1), (5, [0], 1), (6, [0], 1), (7, [0, 1], 2),
    ]  # fmt: skip
    # torchft's init_sync heal at step 0: replica 1 zeroed, the sum still divided by 2
    heal0 = [_a(1, 0, 0, 0, 1), _a(2, 1, 0, 0, 1, participating=False)]
    assert contributions(heal0, replicas=2) == [(0, [0], 2)]
    with pytest.raises(ValueError, match="went back"):
        contributions([_a(1, 0, 0, 0, 1), _a(1, 0, 1, 1, 2), _a(3, 0, 0, 5, 6)], replicas=2)


def test_replay_is_deterministic_and_sees_a_dropped_replica() -> None:
    job = DPJob(layers=1, d_model=32, num_heads=2, seq_len=8)
    both = [(0, [0, 1], 2), (1, [0, 1], 2)]
    one = [(0, [0, 1], 2), (1, [0], 1)]
    d_both = state_digest(*replay(job, both))
    assert d_both == state_digest(*replay(job, both))
    assert d_both != state_digest(*replay(job, one))
    m, o = replay(job, both)
    names = [n for n, _ in state_tensors(m, o)]
    params = [n for n in names if n.startswith("model.")]
    for suffix in (".step", ".exp_avg", ".exp_avg_sq"):
        assert sum(n.endswith(suffix) for n in names) == len(params)
    assert all(v.dtype == torch.float32 for _, v in state_tensors(m, o))


def test_stop_at_reads_the_benchs_file(tmp_path: Path) -> None:
    assert stop_at(tmp_path, 50) == 50
    (tmp_path / STOP).write_text("17\n")
    assert stop_at(tmp_path, 50) == 17
    assert stop_at(tmp_path, 10) == 10


@pytest.mark.timeout(60)
def test_kill_from_outside_sigkills_the_target_and_ends_the_job(tmp_path: Path) -> None:
    """A real process is killed once the job has ``gap`` full-strength steps; the end is
    written once it has ``gap`` more after the kill."""
    victim = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])  # replica 0: never the target
    try:
        for s in range(3):
            emit(tmp_path / ATTEMPTS, _a(other.pid, 0, s, 100 + s, 100.1 + s))
            emit(tmp_path / ATTEMPTS, _a(victim.pid, 1, s, 100 + s, 100.01 + s))

        def after_kill() -> None:
            victim.wait()
            t = time.time()
            for s in range(3, 6):
                emit(tmp_path / ATTEMPTS, _a(other.pid, 0, s, t, t + 0.01))
                emit(tmp_path / ATTEMPTS, _a(2, 1, s, t, t + 0.01))

        th = threading.Thread(target=after_kill)
        th.start()
        done, end = kill_from_outside(tmp_path, 1, 3, seed=1, deadline=time.time() + 30, target=lambda i: 1)  # fmt: skip
        th.join()
        assert other.poll() is None
    finally:
        victim.kill()
        other.kill()
    assert victim.wait() == -signal.SIGKILL
    assert [(k["replica"], k["pid"], k["step"]) for k in done] == [(1, victim.pid, 3)]
    assert end == 5 + 1 + 3 and (tmp_path / STOP).read_text() == "9\n"
    assert len(read(tmp_path / ATTEMPTS)) == 12
    assert json.loads((tmp_path / ATTEMPTS).read_text().splitlines()[0])["pid"] == other.pid
