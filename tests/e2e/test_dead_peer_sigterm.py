"""A SIGKILLed worker: torchrun SIGTERMs the survivors, and none of them waits out the
SIGTERM grace for a flush the dead rank can never join (issue 32).

``baft train`` (pp=2) runs from another process, as a user's shell would; rank 0 is
slowed so that it is asleep in a pipeline slot, not blocked on rank 1, when rank 1 is
SIGKILLed from outside. torchrun then SIGTERMs rank 0: its watch sees rank 1's process
gone (the pid its heartbeat named) and rank 0 dies of the SIGTERM at once, saying why,
instead of after the grace (at least 5 s, three iterations here). The bound is the
grace itself: no rank's log may say the grace ran out. The restarted group then finishes
the job from memory. A preemption SIGTERM to every rank still flushes
(tests/e2e/test_launcher_sigterm.py).
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

from tests.e2e.jobs import descendants

pytestmark = pytest.mark.timeout(300)

ITERATIONS = 10
KILL_AFTER = 5
"""Metrics lines (finished iterations) before the kill; rank 0 sleeps from iteration 5."""


def _rank_pids(root: int) -> dict[int, int]:
    """Rank -> pid of the live (not zombie) workers under ``root``."""
    out: dict[int, int] = {}
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
        if ranks and state != "Z":
            out[ranks[0]] = pid
    return out


@pytest.mark.slow  # default tier: unit test_termination (a peer that cannot vote)
def test_survivors_of_a_killed_rank_leave_without_the_grace(tmp_path: Path) -> None:
    out, store = tmp_path / "run", Path("/dev/shm") / f"baft-deadpeer-{tmp_path.name}"
    cmd = [
        sys.executable, "-m", "baft.cli", "train",
        "--dp", "1", "--pp", "2", "--microbatches", "2", "--ranks-per-node", "1",
        "--layers", "4", "--d-model", "64", "--heads", "4", "--seq-len", "32",
        "--iterations", str(ITERATIONS), "--batch", "8", "--profile-iters", "2",
        "--max-restarts", "1", "--no-inprocess",  # the group restart's SIGTERM is the subject
        "--checkpoint", "every=1,redundancy=replicate:1,persist=0,full_every=1",
        # rank 0 sleeps 2 s in each slot of iteration 5: asleep there when rank 1 dies
        "--inject", f"slow:rank=0,iter={KILL_AFTER},s=2.0,iters=1",
        "--store-root", str(store), "--out", str(out),
    ]  # fmt: skip
    try:
        log = (tmp_path / "stderr.txt").open("w")
        launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 200
        workers: dict[int, int] = {}
        while time.time() < deadline and launcher.poll() is None:
            workers = _rank_pids(launcher.pid)
            done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if done >= KILL_AFTER and len(workers) == 2:
                break
            time.sleep(0.05)
        assert len(workers) == 2 and launcher.poll() is None, (tmp_path / "stderr.txt").read_text()
        time.sleep(0.5)  # rank 0 is in its first slow slot of iteration 5
        victim, survivor = workers[1], workers[0]
        os.kill(victim, signal.SIGKILL)  # from outside the job, as from another shell
        rc = launcher.wait(timeout=250)
        err = (tmp_path / "stderr.txt").read_text()
        assert rc == 0, err[-3000:]
        logs = {
            p: p.read_text(errors="replace") for p in (out / "logs").glob("*/attempt_*/*/*.log")
        }
        first = [t for p, t in logs.items() if p.parts[-3] == "attempt_0" and p.parts[-2] == "0"]
        said = (
            f"SIGTERM: rank 1 has exited (pid {victim} on this host), so no flush can be "
            "agreed: exiting without the grace"
        )
        assert any(said in t for t in first), (survivor, "\n".join(first)[-3000:])
        assert not [p for p, t in logs.items() if "no agreed flush within" in t]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["iterations"] == ITERATIONS
        (recovery,) = summary["recoveries"]
        assert recovery["source"] == "memory", recovery
    finally:
        shutil.rmtree(store, ignore_errors=True)
