"""In-process recovery where real scripts go (issue 42), from outside, under plain torchrun
with ``-m baft.inprocess`` and the user script (``tests/e2e/user_script.py``) with what
real scripts have: batches from a ``DataLoader`` with worker processes, a TCP connection
opened at module level and used every iteration, and work after ``ft.close()``.

- a worker SIGKILLed from outside: survivors keep their pids and their module-level
  connection, one in-process recovery, the last stage's work after ``close()`` finishes,
  exit 0, bit-identical (``test_kill_with_loader_workers_module_socket_and_work_after_close``);
- a preemption (SIGTERM to torchrun) with DataLoader workers: flushed to DCP, and a
  relaunch on a wiped host resumes from it losing no iteration, bit-identical;
- a refusal (nothing restorable while the run records progress) ends the job once: no
  in-process re-entry, no torchrun restart;
- a rank frozen (SIGSTOP) in the job's last iteration: recovered in-process, exit 0.

Each is compared bit for bit with the same script without baft (every rank's
parameters, buffers, optimizer, scheduler, sampler and RNG). The kill and the refusal
run in the default suite, the preemption and the last-iteration freeze in the slow tier.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baft.train.launch import launch_env
from tests.e2e.jobs import USER_SCRIPT, iterations_done, kill_tree, training_pids

pytestmark = pytest.mark.timeout(420)

WORLD, TIMEOUT_S = 4, 5.0


def _training(root: int) -> dict[int, int]:
    return training_pids(root)


def _done(run: Path) -> int:
    return iterations_done(run, WORLD)


def _command(
    out: Path, store: Path, iterations: int, extra: list[str], protected: bool
) -> list[str]:
    args = [
        f"--out={out}", f"--iterations={iterations}", "--ranks-per-node=2",
        f"--timeout={TIMEOUT_S}", f"--store-root={store}", *extra,
    ]  # fmt: skip
    entry = ["-m", "baft.inprocess", str(USER_SCRIPT)] if protected else [str(USER_SCRIPT)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORLD}", "--max-restarts=2", "--monitor-interval=0.1",
        f"--log-dir={out / 'logs'}", "--redirects=3",
        *entry, *args, *([] if protected else ["--unprotected"]),
    ]  # fmt: skip


def _reference(tmp: Path, store: Path, iterations: int, extra: list[str]) -> Path:
    ref = tmp / "ref"
    r = subprocess.run(
        _command(ref, store, iterations, extra, False), env=launch_env(), timeout=300,
        capture_output=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return ref


def _same_state(run: Path, ref: Path) -> None:
    for r in range(WORLD):
        name = f"state.rank{r}.json"
        assert json.loads((run / name).read_text()) == json.loads((ref / name).read_text()), r


def _recoveries(run: Path) -> list[dict]:
    path = run / "recoveries.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _logs(run: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run.glob("logs/**/*.log")))


def _wait(cond: object, what: str, agent: subprocess.Popen[bytes], limit_s: float = 200) -> None:
    deadline = time.time() + limit_s
    while not cond():  # type: ignore[operator]
        assert agent.poll() is None, f"job ended while waiting for {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = Path("/dev/shm") / f"baft-inproc-user-{tmp_path.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(
    "after_close", [8, pytest.param(35, marks=pytest.mark.slow)], ids=["8s", "35s"]
)
def test_kill_with_loader_workers_module_socket_and_work_after_close(
    tmp_path: Path, store: Path, after_close: int
) -> None:
    """The last stage works on after ``close()`` (35 s in the slow tier: longer than the
    control store used to outlive rank 0's training process, 30 s; 8 s by default, which
    fails the job the same way if work after the close is recovered or cut); a
    module-level connection is used every iteration and must survive the peer's recovery
    (it used to be shut down with the generation's sockets: BrokenPipeError, one
    recovery after another)."""
    extra = ["--loader-workers=2", "--module-socket", "--sleep=0.1", "--dp=2"]
    ref = _reference(tmp_path, store, 30, extra)
    run = tmp_path / "run"
    cmd = _command(run, store, 30, [*extra, f"--after-close={after_close}"], True)
    agent = subprocess.Popen(cmd, env=launch_env(), stdout=subprocess.DEVNULL)
    try:
        _wait(lambda: len(_training(agent.pid)) == WORLD and _done(run) >= 8, "progress", agent)
        before = _training(agent.pid)
        os.kill(before[1], signal.SIGKILL)
        _wait(lambda: _done(run) >= 12, "iterations after the recovery", agent)
        after = _training(agent.pid)
        assert after[1] != before[1]
        assert {r: after[r] for r in (0, 2, 3)} == {r: before[r] for r in (0, 2, 3)}
        assert agent.wait(timeout=240) == 0, _logs(run)[-4000:]
    finally:
        if agent.poll() is None:
            kill_tree(agent)
    recs = _recoveries(run)
    assert [r["inprocess"]["generation"] for r in recs] == [1], recs  # one recovery, no more
    assert all(r["source"] == "memory" and r["attempt"] == 0 for r in recs), recs
    assert (run / "after_close.rank3").read_text() == f"{after_close:.1f}"  # the last stage
    assert (run / "after_close.rank2").read_text() == f"{after_close:.1f}"
    _same_state(run, ref)


@pytest.mark.slow
def test_preemption_with_loader_workers_flushes_and_resumes(tmp_path: Path, store: Path) -> None:
    """SIGTERM to torchrun mid-run, no periodic DCP: the flush writes the live version
    (DataLoader workers used to die of torchrun's killpg and make the training thread
    raise before the flush: nothing persisted); the host is wiped and the relaunch
    resumes from DCP with no iteration lost. DP replicas with BatchNorm on stage 0: the
    buffers are persisted from the first replica (the loop syncs them from it after the
    step; the second replica's own statistics used to be flushed, and the run diverged)."""
    extra = ["--loader-workers=2", "--sleep=0.1", "--persist-every=0", "--dp=2"]
    ref = _reference(tmp_path, store, 24, extra)
    run = tmp_path / "run"
    cmd = _command(run, store, 24, extra, True)
    agent = subprocess.Popen(cmd, env=launch_env(), stdout=subprocess.DEVNULL)
    try:
        _wait(lambda: _done(run) >= 9, "progress", agent)
        agent.send_signal(signal.SIGTERM)
        at = _done(run)
        agent.wait(timeout=120)
    finally:
        if agent.poll() is None:
            kill_tree(agent)
    persisted = sorted(p.name for p in (run / "checkpoints").glob("v*"))
    assert len(persisted) == 1 and int(persisted[0][1:]) >= at, (persisted, at)
    shutil.rmtree(store, ignore_errors=True)  # the host's memory is gone with it
    r = subprocess.run(cmd, env=launch_env(), timeout=300, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    (rec,) = _recoveries(run)
    assert rec["source"] == "disk" and rec["lost_iterations"] == 0, rec
    assert rec["restored_version"] == int(persisted[0][1:]), rec
    _same_state(run, ref)


def test_a_refusal_ends_the_job_once(tmp_path: Path, store: Path) -> None:
    """A run that recorded progress, with nothing in memory or on disk: every rank
    refuses to start over; the job ends at once, without a torchrun restart (it used to
    re-enter ``main()`` and then restart the group, refusing each time). A peer whose
    collective the refusing rank broke may re-enter once before the refusal reaches it."""
    run = tmp_path / "run"
    (run / "progress").mkdir(parents=True)
    for r in range(WORLD):
        (run / "progress" / f"rank{r}").write_text("6")
    t0 = time.monotonic()
    r = subprocess.run(
        _command(run, store, 12, ["--persist-every=0", "--dp=2"], True), env=launch_env(),
        timeout=300,
        capture_output=True,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert r.returncode != 0
    logs = _logs(run)
    assert "the job ends without a restart" in logs, logs[-3000:]
    refused = logs.count("baft: the training function refused: RestoreError: refusing to start")
    assert 1 <= refused <= WORLD, logs[-3000:]  # peers may be stopped before they refuse too
    attempts = {p.name for p in run.glob("logs/*/attempt_*")}
    assert attempts == {"attempt_0"}, (attempts, took)


@pytest.mark.slow
def test_a_rank_frozen_in_the_last_iteration_is_recovered_in_process(
    tmp_path: Path, store: Path
) -> None:
    """SIGSTOP of the last stage's rank once the others finished the job's last but
    one iteration: the watchdog names it, it is replaced, the others re-enter, and the
    job ends with status 0, bit-identical (it used to become a group restart)."""
    iterations, extra = 14, ["--sleep=0.4", "--dp=2"]
    ref = _reference(tmp_path, store, iterations, extra)
    run = tmp_path / "run"
    agent = subprocess.Popen(
        _command(run, store, iterations, extra, True), env=launch_env(), stdout=subprocess.DEVNULL
    )
    try:
        _wait(lambda: _done(run) >= iterations - 1, "the last iteration", agent)
        before = _training(agent.pid)
        os.kill(before[3], signal.SIGSTOP)
        assert agent.wait(timeout=200) == 0, _logs(run)[-4000:]
    finally:
        if agent.poll() is None:
            kill_tree(agent)
    recs = _recoveries(run)
    assert recs and all(r["attempt"] == 0 and "inprocess" in r for r in recs), recs
    _same_state(run, ref)
