"""DP replicas keep their own small state through a kill -9, a lost node and a power loss.

``tests/e2e/replica_state_script.py`` gives every data-parallel replica its own loader
position, counter and RNG stream (the model and optimizer stay replicas). Under torchrun
(group restart) a worker is SIGKILLed from outside mid-run, or replica 1's whole node
(its processes and its store: its own records among them, wherever the split put them);
after baft restores it from memory (the lost node's shards from the redundancy on the
other), every rank ends bit-identical to the same loop without baft: its own loader,
counter and RNG, not another replica's. The plain ``dp=2`` job (2 ranks, full
snapshots, killed) and an FSDP2 HSDP job (``dp_replicate=2 x dp_shard=2``, 4 ranks,
differential versions with ``full_every=2``; killed, and its node 1 lost) from memory; the plain job once more after a power loss
(every process killed, the stores wiped, the same command launched again), from its DCP
checkpoint. The fault lands at a random moment after 6 iterations (``BAFT_RS_SEED``
replays one).

Slow (each case runs the reference and the protected job under torchrun, ~1 min each on
two cores); the default tier's cover is tests/dist/test_replica_state.py (the same
per-replica state through restores from memory and DCP, in one gloo job).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baft.train.launch import launch_env
from tests.e2e.jobs import (
    REPO,
    iterations_done,
    kill_agent,
    rank_pids,
    read_jsonl,
    signal_all,
    torchrun,
    worker_pids,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SCRIPT = REPO / "tests" / "e2e" / "replica_state_script.py"
ITERATIONS = 14
SEED = int(os.environ.get("BAFT_RS_SEED", random.randrange(1 << 30)))
RNG = random.Random(SEED)


def _command(out: Path, world: int, args: list[str], store: Path | None) -> list[str]:
    cmd = [*torchrun(world, out / "logs", None, max_restarts=2 if store else 0)]
    cmd += [str(SCRIPT), f"--out={out}", f"--iterations={ITERATIONS}", *args]
    if store is None:
        return [*cmd, "--unprotected", "--sleep=0"]
    return [*cmd, f"--store-root={store}", "--job-id=rs", f"--ranks-per-node={max(1, world // 2)}"]


def _states(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"state.rank{r}.json").read_text()) for r in range(world)]


def _wait(agent: subprocess.Popen, run: Path, world: int, done: int, log: Path) -> None:
    deadline = time.monotonic() + 400
    while iterations_done(run, world) < done:
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.01)


def _case(tmp: Path, world: int, args: list[str], fault: str) -> tuple[list[dict], list[dict]]:
    ref, run, store = tmp / "ref", tmp / "run", Path("/dev/shm") / f"baft-rs-{tmp.name}"
    subprocess.run(
        _command(ref, world, args, None), env=launch_env(), cwd=REPO, check=True,
        capture_output=True,
    )  # fmt: skip
    expected = _states(ref, world)
    # the replicas really differ: a restore from one copy per stage cannot pass
    assert len({json.dumps(s["loader"]) + json.dumps(s["counter"]) for s in expected}) == world
    assert len({s["rng"] for s in expected}) == world
    log = tmp / "agent.log"
    cmd = _command(run, world, args, store)
    try:
        with open(log, "w") as f:
            agent = subprocess.Popen(
                cmd, env=launch_env(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            _wait(agent, run, world, 6, log)
            time.sleep(RNG.uniform(0.0, 0.3))  # a random moment of the iteration
            if fault == "kill":
                signal_all([worker_pids(agent)[world - 1]], signal.SIGKILL)
            elif fault == "node":  # node 1 (replica 1): its processes and its memory
                ranks = range(world // 2, world)
                pids = [p for r, ps in rank_pids(agent).items() if r in ranks for p in ps]
                signal_all(pids, signal.SIGSTOP)
                shutil.rmtree(store / "rs" / "node1")
                signal_all(pids, signal.SIGKILL)
            else:  # power loss: every process and the host memory
                kill_agent(agent)
                shutil.rmtree(store)
                with open(log, "a") as f:
                    agent = subprocess.Popen(
                        cmd, env=launch_env(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
            assert agent.wait(400) == 0, log.read_text()[-3000:]
        finally:
            if agent.poll() is None:
                kill_agent(agent)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    recs = read_jsonl(run / "recoveries.jsonl")
    return expected, [*_states(run, world), *recs]


HSDP = ["--dp-replicate=2", "--dp-shard=2", "--full-every=2"]


@pytest.mark.parametrize(
    ("world", "args", "fault"),
    [(2, ["--dp-replicate=2"], "kill"), (4, HSDP, "kill"), (4, HSDP, "node")],
    ids=["dp2-kill", "hsdp2x2-kill", "hsdp2x2-node"],
)
def test_replicas_keep_their_state_through_a_kill_or_a_lost_node(
    tmp_path: Path, world: int, args: list[str], fault: str
) -> None:
    expected, got = _case(tmp_path, world, args, fault)
    states, recs = got[:world], got[world:]
    assert [r["source"] for r in recs] == ["memory"], (f"BAFT_RS_SEED={SEED}", recs)
    for r in range(world):  # each rank its own loader, counter, RNG, and the same model
        assert states[r] == expected[r], (f"BAFT_RS_SEED={SEED}", r, states[r], expected[r])


def test_replicas_keep_their_state_through_a_power_loss(tmp_path: Path) -> None:
    args = ["--dp-replicate=2", "--persist-every=1"]
    expected, got = _case(tmp_path, 2, args, "power")
    states, recs = got[:2], got[2:]
    assert [r["source"] for r in recs] == ["disk"], (f"BAFT_RS_SEED={SEED}", recs)
    for r in range(2):
        assert states[r] == expected[r], (f"BAFT_RS_SEED={SEED}", r, states[r], expected[r])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "slow", "-v"]))
