"""In-process recovery from outside (issue 32): a user's script under plain torchrun with
``-m baft.inprocess``, one rank SIGKILLed and later another frozen (SIGSTOP) from this
process, as from another shell.

After each fault the survivors must keep their processes (same pids before and after the
recovery: they re-entered ``main()`` in place) and only the failed rank gets a new one;
every recovery is in-process (its record names the generation) and restores from memory;
and the final state of every rank (parameters, buffers, optimizer, scheduler, sampler,
RNG) equals the same script's without baft, bit for bit.
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
from tests.e2e.jobs import USER_SCRIPT, descendants, kill_tree

pytestmark = pytest.mark.timeout(400)

WORLD, DP, ITERATIONS, SLEEP_S, TIMEOUT_S = 4, 2, 40, 0.1, 5.0


def _children(root: int) -> dict[int, int]:
    """Rank -> pid of the live training processes (named ``baft-rankR``) under ``root``."""
    out: dict[int, int] = {}
    for pid in descendants(root):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm.startswith("baft-rank") and state != "Z":
            out[int(comm[len("baft-rank") :])] = pid
    return out


def _finished(run: Path) -> int:
    """Iterations every rank finished (the run's progress record)."""
    done = []
    for r in range(WORLD):
        try:
            done.append(int((run / "progress" / f"rank{r}").read_text()))
        except (OSError, ValueError):
            done.append(-1)
    return min(done) + 1


def _command(out: Path, store: Path, protected: bool) -> list[str]:
    entry = ["-m", "baft.inprocess", str(USER_SCRIPT)] if protected else [str(USER_SCRIPT)]
    args = [
        "--out", str(out), "--iterations", str(ITERATIONS), "--dp", str(DP),
        "--ranks-per-node", "2", "--sleep", str(SLEEP_S), "--timeout", str(TIMEOUT_S),
        "--store-root", str(store),
    ]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORLD}", "--max-restarts=1", "--monitor-interval=0.1",
        f"--log-dir={out / 'logs'}", "--redirects=3",
        *entry, *args, *([] if protected else ["--unprotected"]),
    ]  # fmt: skip


def _wait(cond: object, what: str, agent: subprocess.Popen[bytes], limit_s: float = 150) -> None:
    deadline = time.time() + limit_s
    while not cond():  # type: ignore[operator]
        assert agent.poll() is None, f"job ended while waiting for {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _fault(agent: subprocess.Popen[bytes], run: Path, rank: int, sig: int) -> dict[str, int]:
    """Send ``sig`` to ``rank``'s training process once the job is past a few iterations;
    returns the training processes after the recovery finished three more iterations."""
    _wait(lambda: len(_children(agent.pid)) == WORLD and _finished(run) >= 6, "progress", agent)
    before = _children(agent.pid)
    at = _finished(run)
    os.kill(before[rank], sig)
    _wait(lambda: _finished(run) >= at + 3, "iterations after the recovery", agent)
    after = _children(agent.pid)
    assert after[rank] != before[rank], (rank, before, after, _decisions(run))
    survivors = {r: p for r, p in before.items() if r != rank}
    assert {r: after[r] for r in survivors} == survivors, (before, after, _decisions(run))
    return after


def _decisions(run: Path) -> str:
    """The supervisors' and watchdogs' lines from the agent's per-rank logs: why a
    recovery went the way it did, when it did not go in-process (a flake's only trace)."""
    lines = []
    for f in sorted((run / "logs").rglob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if "baft supervisor" in line or "baft watchdog" in line:
                lines.append(f"{f.parent.name}: {line[:300]}")
    return "\n".join(lines[-60:])


def test_survivors_keep_their_processes_and_the_trajectory(tmp_path: Path) -> None:
    store = Path("/dev/shm") / f"baft-inproc-{tmp_path.name}"
    ref, run = tmp_path / "ref", tmp_path / "run"
    env = launch_env()
    try:
        rc = subprocess.run(
            _command(ref, store, False), env=env, timeout=200, capture_output=True
        ).returncode
        assert rc == 0
        agent = subprocess.Popen(_command(run, store, True), env=env, stdout=subprocess.DEVNULL)
        try:
            _fault(agent, run, 1, signal.SIGKILL)
            _fault(agent, run, 2, signal.SIGSTOP)  # the watchdog names it after TIMEOUT_S
            assert agent.wait(timeout=200) == 0, _decisions(run)
        finally:
            if agent.poll() is None:
                kill_tree(agent)
        recs = [json.loads(x) for x in (run / "recoveries.jsonl").read_text().splitlines()]
        assert [r["inprocess"]["generation"] for r in recs] == [1, 2], (recs, _decisions(run))
        assert all(r["source"] == "memory" and r["lost_iterations"] <= 1 for r in recs), recs
        assert recs[1]["hang"]["suspect"] == 2, recs[1]
        for r in range(WORLD):
            name = f"state.rank{r}.json"
            assert json.loads((run / name).read_text()) == json.loads((ref / name).read_text()), r
    finally:
        shutil.rmtree(store, ignore_errors=True)
