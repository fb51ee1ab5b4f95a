"""The library face: examples/own_training.py (a user's own pipelining loop + baft.protect)
crashes under torchrun, restores from memory and ends exactly where a clean run ends."""

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


def _run(out: Path, inject: list[str]) -> dict:
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
    ]
    for spec in inject:
        cmd += ["--inject", spec]
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "final.json").read_text())


def test_example_recovers_bit_exactly(tmp_path: Path) -> None:
    clean = _run(tmp_path / "clean", [])
    crashed = _run(tmp_path / "crashed", ["kill:rank=0,iter=7"])
    try:
        assert clean["start"] == 0
        assert crashed["start"] in (6, 7)  # the restored version
        assert crashed["param_sum"] == clean["param_sum"]
        before = json.loads((tmp_path / "clean" / "losses.attempt0.json").read_text())
        after = json.loads(
            (tmp_path / "crashed" / f"losses.attempt{crashed['start']}.json").read_text()
        )
        assert after == {k: v for k, v in before.items() if int(k) >= crashed["start"]}
        (rec,) = [
            json.loads(x)
            for x in (tmp_path / "crashed" / "recoveries.jsonl").read_text().splitlines()
        ]
        assert rec["source"] == "memory" and rec["lost_iterations"] <= 1
    finally:
        for run in ("clean", "crashed"):
            cfg_job = Path("/dev/shm/baft")
            shutil.rmtree(cfg_job / _job(tmp_path / run), ignore_errors=True)


def _job(out: Path) -> str:
    from baft.train.launch import default_job_id

    return default_job_id(str(out))
