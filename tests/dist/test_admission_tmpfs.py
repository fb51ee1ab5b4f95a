"""Admission: a job whose snapshot stores cannot fit a small tmpfs (Docker's default 64 MB
/dev/shm) is refused on every rank before its first step, with the numbers and the knobs,
and leaves nothing allocated there. Needs to mount a tmpfs (root); skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("admission_script.py")


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
            check=True, capture_output=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_job_that_cannot_fit_its_stores_is_refused_before_step_one(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(SCRIPT), f"--out={out}", f"--store-root={small_tmpfs}"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = [json.loads((out / f"outcome.rank{r}.json").read_text()) for r in range(2)]
    # 3 x Linear(1024, 1024) per stage: 12,595,200 B of parameters and as much SGD
    # momentum (its holder is in the layout from the start); xor:2 over the two ranks
    # doubles it; 2 slots
    shard = 2 * 3 * (1024 * 1024 + 1024) * 4
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    for o in outcomes:
        assert o["trained"] == 0  # not one step ran
        err = o["error"]
        assert err.startswith(
            "MemoryBudgetError: the snapshot stores cannot fit this host's memory"
        )
        needed = int(err.split("needs at least ")[1].split(" B")[0].replace(",", ""))
        assert 2 * 2 * shard <= needed < 2 * 2 * shard + (2 << 20)  # + small state, manifests
        budget = int(err.split("the store budget is ")[1].split(" B")[0].replace(",", ""))
        assert budget == free // 2  # the tmpfs's free space, split over the 2 ranks on it
        assert "--shm-size" in err
    assert outcomes[0]["error"] == outcomes[1]["error"]  # every rank, the same refusal
    leftovers = [p for p in small_tmpfs.rglob("*") if p.is_file() and p.stat().st_size > 4096]
    assert leftovers == []  # nothing was allocated in the tmpfs
