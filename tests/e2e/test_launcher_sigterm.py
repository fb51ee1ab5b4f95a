"""``baft train`` stopped with SIGTERM (a wrapper's ``kill``, a scheduler's preemption):
it passes the signal on and returns only when its workers have flushed and exited, so
whatever waits for the command can read the checkpoint at once."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baft.store.disk import COMPLETE_MARKER, LATEST_FILE, version_dir
from baft.train.launch import _alive, _descendants

pytestmark = pytest.mark.timeout(300)


def test_baft_train_returns_after_its_workers_flushed(tmp_path: Path) -> None:
    out, store = tmp_path / "run", Path("/dev/shm") / f"baft-term-{tmp_path.name}"
    cmd = [
        sys.executable, "-m", "baft.cli", "train",
        "--dp", "1", "--pp", "2", "--microbatches", "2", "--ranks-per-node", "1",
        "--layers", "4", "--d-model", "64", "--heads", "4", "--seq-len", "32",
        "--iterations", "12", "--batch", "8", "--profile-iters", "2", "--max-restarts", "0",
        "--checkpoint", "every=1,redundancy=replicate:1,persist=0,full_every=1",
        # iterations slowed from 4 on so that the signal lands mid-run on a loaded machine
        "--inject", "slow:rank=0,iter=4,s=0.3,iters=8",
        "--store-root", str(store), "--out", str(out),
    ]  # fmt: skip
    try:
        # a file, not a pipe: waiting for a pipe's end would wait for the workers too
        log = (tmp_path / "stderr.txt").open("w")
        launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        metrics = out / "metrics.jsonl"
        workers: set[int] = set()
        deadline = time.time() + 200
        while time.time() < deadline and launcher.poll() is None:
            workers |= _descendants(launcher.pid)
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(0.05)
        workers |= _descendants(launcher.pid)
        assert len(workers) >= 3, workers  # torchrun and its two workers
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=150)
        # the moment it returned: no process of it runs, the checkpoint is complete
        running = sorted(p for p in workers if _alive(p))
        ckpt = out / "checkpoints"
        latest = (ckpt / LATEST_FILE).read_text().strip() if (ckpt / LATEST_FILE).exists() else ""
        complete = bool(latest) and (version_dir(ckpt, int(latest)) / COMPLETE_MARKER).is_file()
        done = len(metrics.read_text().splitlines())
        err = (tmp_path / "stderr.txt").read_text()
        assert running == [], (running, err[-2000:])
        assert complete, (latest, sorted(p.name for p in ckpt.iterdir()) if ckpt.exists() else None)
        assert 5 <= done < 12, done  # stopped mid-run
        assert int(latest) == done  # the state after the last finished step
        assert launcher.returncode == 0, err[-2000:]
        assert "waiting up to" in err
    finally:
        shutil.rmtree(store, ignore_errors=True)
