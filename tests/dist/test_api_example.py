"""The library face: examples/own_training.py (an ordinary pipelining loop with BatchNorm,
dropout, SGD momentum, a warmup LR scheduler, gradient clipping and a stateful sampler,
plus ``baft.protect``) loses a rank to SIGKILL while it protects version 5 (after that
iteration's optimizer step: the live state is already past it) under torchrun, restores
from memory and ends exactly where the same loop ends without baft: every rank's
parameters, buffers, optimizer state, scheduler state, sampler, RNG, the losses and the
sequence of batches."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from baft.train.launch import launch_env

pytestmark = pytest.mark.timeout(300)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_training.py"
ITERATIONS = 8


def _run(out: Path, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        str(EXAMPLE),
        "--out",
        str(out),
        "--iterations",
        str(ITERATIONS),
        *args,
    ]
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads((out / "final.json").read_text())
    final["states"] = [json.loads((out / f"state.rank{r}.json").read_text()) for r in range(2)]
    return final


def _batches(out: Path, rank: int) -> dict[int, list[int]]:
    """Iteration -> the batch read (a restarted attempt redoes iterations: its read wins)."""
    lines = (out / f"batches.rank{rank}.jsonl").read_text().splitlines()
    return {(d := json.loads(line))["iteration"]: d["batch"] for line in lines}


@pytest.mark.slow  # default tier: e2e test_inprocess_user and the smoke user-script cells
def test_example_recovers_bit_exactly(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain", "--unprotected")
    try:
        # at=transfer fires on every plan (at=snapshot needs a snapshot task in a bubble,
        # which the measured bubbles decide)
        crashed = _run(tmp_path / "crashed", "--inject", "kill:rank=1,iter=5,at=transfer")
        assert plain["start"] == 0
        assert crashed["start"] in (4, 5)  # the restored version
        assert "1.running_mean" in plain["states"][0]["module"]  # BatchNorm on stage 0
        _assert_same_states(crashed, plain)
        for rank in range(2):
            want = plain["states"][rank]
            # the parts hold what they should: buffers, momentum, a scheduler past warmup
            params = [k for k in want["module"] if k.endswith(("weight", "bias"))]
            assert len(want["optimizer"]["state"]) == len(params), rank
            assert all("momentum_buffer" in s for s in want["optimizer"]["state"].values())
            assert want["scheduler"]["last_epoch"] == repr(ITERATIONS)
            assert want["sampler"] == {"epoch": 0, "position": 32 * ITERATIONS}
            # the same batches, iteration by iteration, across the crash
            assert _batches(tmp_path / "crashed", rank) == _batches(tmp_path / "plain", rank)
            assert len(_batches(tmp_path / "plain", rank)) == ITERATIONS
        before = json.loads((tmp_path / "plain" / "losses.attempt0.json").read_text())
        after = json.loads(
            (tmp_path / "crashed" / f"losses.attempt{crashed['start']}.json").read_text()
        )
        assert after == {k: v for k, v in before.items() if int(k) >= crashed["start"]}
        (rec,) = [
            json.loads(x)
            for x in (tmp_path / "crashed" / "recoveries.jsonl").read_text().splitlines()
        ]
        assert rec["source"] == "memory" and rec["lost_iterations"] <= 1, rec
        assert rec["restored_version"] == crashed["start"]
        # a kill loses no store: both shards come back from their own rank's memory
        assert rec["sources"] == {"0": "local", "1": "local"}, rec
    finally:
        shutil.rmtree(Path("/dev/shm/baft") / _job(tmp_path / "crashed"), ignore_errors=True)


def _assert_same_states(got: dict, want: dict) -> None:
    """Every rank ended with the same bytes in every part of its state."""
    for rank in range(2):
        for part in ("module", "optimizer", "scheduler", "sampler", "rng"):
            assert got["states"][rank][part] == want["states"][rank][part], (rank, part)


@pytest.mark.slow  # ~60 s; tests/dist/test_persist_stages.py is the fast version
def test_power_loss_resumes_from_dcp_into_the_right_stage(tmp_path: Path) -> None:
    """The example's stages are a fresh nn.Sequential each (both hold ``0.weight``):
    persisted every 2 checkpoints, then every rank killed and every store wiped; the
    restarted job resumes from DCP and ends where the loop without baft ends."""
    plain = _run(tmp_path / "plain", "--unprotected")
    out = tmp_path / "power"
    try:
        got = _run(out, "--persist-every", "2", "--inject", "power:iter=7")
    finally:
        shutil.rmtree(Path("/dev/shm/baft") / _job(out), ignore_errors=True)
    (rec,) = [json.loads(x) for x in (out / "recoveries.jsonl").read_text().splitlines()]
    assert rec["source"] == "disk" and rec["restored_version"] < 7, rec
    assert got["start"] == rec["restored_version"]
    _assert_same_states(got, plain)


def _job(out: Path) -> str:
    from baft.config import default_job_id

    return default_job_id(str(out))
