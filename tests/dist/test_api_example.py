"""The library face: examples/own_training.py (a user's own pipelining loop + baft.protect)
crashes under torchrun, restores from memory and ends exactly where the same loop ends
without baft: losses and every rank's parameters, buffers and optimizer state."""

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
        "12",
        *args,
    ]
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads((out / "final.json").read_text())
    final["states"] = [json.loads((out / f"state.rank{r}.json").read_text()) for r in range(2)]
    return final


def test_example_recovers_bit_exactly(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain", "--unprotected")
    try:
        crashed = _run(tmp_path / "crashed", "--inject", "kill:rank=0,iter=7")
        assert plain["start"] == 0
        assert crashed["start"] in (6, 7)  # the restored version
        # every rank's full state, tensor by tensor (weights, biases, exp_avg, exp_avg_sq,
        # step, hyperparameters), equals the unprotected loop's
        for rank in range(2):
            assert crashed["states"][rank] == plain["states"][rank], rank
            assert sum(k.startswith("optim.") for k in plain["states"][rank]) > 0
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


def _job(out: Path) -> str:
    from baft.config import default_job_id

    return default_job_id(str(out))
