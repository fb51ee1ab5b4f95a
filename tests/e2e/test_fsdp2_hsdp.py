"""HSDP x PP (pp=2 x dp_replicate=2 x dp_shard=2, 8 ranks): a worker SIGKILLed from outside.

``examples/fsdp2_pipeline.py --dp-replicate 2`` shards every block over
``mesh["dp_replicate", "dp_shard"]``: FSDP2 averages the replicas' gradients itself (baft
must not), the two replicas of each shard split its snapshot, and a restore rebuilds the
killed rank from its replica's and its own shares. With differential versions
(``full_every=3``) the job ends bit-identical on all 8 ranks to the same script without
baft (local shards, optimizer state, gathered parameters, scheduler, sampler, RNG).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from baft.train.launch import launch_env
from tests.e2e.jobs import (
    FSDP2_SCRIPT,
    REPO,
    iterations_done,
    kill_agent,
    read_jsonl,
    signal_all,
    torchrun,
    worker_pids,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WORLD, ITERATIONS = 8, 24


def _command(out: Path, protected: bool) -> list[str]:
    cmd = [*torchrun(WORLD, out / "logs", None, max_restarts=3 if protected else 0)]
    cmd += [str(FSDP2_SCRIPT), f"--out={out}", f"--iterations={ITERATIONS}"]
    cmd += ["--pp=2", "--dp-replicate=2", "--dp-shard=2"]
    if not protected:
        return [*cmd, "--unprotected"]
    store = Path("/dev/shm") / f"baft-hsdp-{out.parent.name}"
    return [*cmd, "--full-every=3", f"--store-root={store}", "--timeout=20"]


def _states(out: Path) -> list[str]:
    return [(out / f"state.rank{r}.json").read_text() for r in range(WORLD)]


def test_hsdp_worker_killed_from_outside_is_restored_bit_for_bit(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run(
        _command(ref, False), env=launch_env(), cwd=REPO, check=True, capture_output=True
    )
    with open(tmp_path / "agent.log", "w") as log:
        agent = subprocess.Popen(
            _command(run, True), env=launch_env(), cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while iterations_done(run, WORLD) < 12:  # a whole window of K=3 versions committed
            assert agent.poll() is None and time.monotonic() < deadline, (
                tmp_path / "agent.log"
            ).read_text()[-3000:]
            time.sleep(0.01)
        signal_all([worker_pids(agent)[5]], signal.SIGKILL)
        assert agent.wait(400) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        if agent.poll() is None:
            kill_agent(agent)
    recs = read_jsonl(run / "recoveries.jsonl")
    assert [r["source"] for r in recs] == ["memory"], recs
    assert recs[0]["lost_iterations"] <= 1, recs
    assert "differential" in recs[0]["reason"], recs
    assert _states(run) == _states(ref)
    assert json.loads((run / "final.json").read_text())["start"] > 0
