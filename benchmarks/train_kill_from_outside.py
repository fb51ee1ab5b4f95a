"""`baft train` with its defaults, a worker SIGKILLed from outside several times: downtime.

Usage: ``python benchmarks/train_kill_from_outside.py OUT [--kills 3] [--rank 1]
[--iterations 400] [--modes in-process,group]``. For each mode, one ``baft train`` job
(defaults: 4 ranks, dp=2 x pp=2, 1F1B, xor:2; ``group`` adds ``--no-inprocess``); after
20 finished iterations (and 8 more after each recovery) the training process of
``--rank`` is SIGKILLed from this process, as from another shell. Measured per kill:
kill -> the first metrics line written after it (the next finished iteration), less the
iteration time before the kill (the issue's measure), and whether the other ranks kept
their processes. Prints one JSON object per kill, then a JSON summary (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from baft.train.launch import _alive, _descendants


def trainers(root: int) -> dict[int, int]:
    """Rank -> pid of the training processes under ``root``: ``baft-rankR`` (in-process)
    or ``python -m baft.train.worker`` (group restart)."""
    out: dict[int, int] = {}
    for pid in _descendants(root):
        if not _alive(pid):  # a zombie still has its name
            continue
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if comm.startswith("baft-rank"):
            out[int(comm[9:])] = pid
        elif b"baft.train.worker" in cmd and b"baft.inprocess" not in cmd:
            ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
            if ranks:
                out[ranks[0]] = pid
    return out


def lines(out: Path) -> list[str]:
    try:
        return [x for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except OSError:
        return []


def run_mode(base: Path, mode: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    out = base / mode
    cmd = ["baft", "train", "--out", str(out), "--iterations", str(a.iterations),
           "--max-restarts", str(a.kills + 1)] + (["--no-inprocess"] if mode == "group" else [])  # fmt: skip
    err = open(base / f"{mode}.stderr", "w")  # noqa: SIM115
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    results: list[dict[str, Any]] = []
    try:
        need = 20
        for k in range(a.kills):
            while True:
                if job.poll() is not None:
                    raise SystemExit(f"{mode}: job ended early rc={job.returncode}")
                w = trainers(job.pid)
                ls = lines(out)
                if len(w) == 4 and len(ls) >= need:
                    break
                time.sleep(0.05)
            before = lines(out)
            iter_s = json.loads(before[-1])["iter_s"]
            t0 = time.time()
            os.kill(w[a.rank], signal.SIGKILL)
            while True:
                ls = lines(out)
                if (
                    len(ls) > len(before)
                    or ls != before[: len(ls)]
                    and len(ls) > 0
                    and ls[-1] not in before
                ):
                    t1 = time.time()
                    break
                if time.time() - t0 > 120:
                    raise SystemExit(f"{mode}: no iteration 120 s after kill {k}")
                time.sleep(0.005)
            after = trainers(job.pid)
            kept = sorted(r for r in w if r != a.rank and after.get(r) == w[r])
            res = {
                "mode": mode, "kill": k, "iter_s": iter_s,
                "kill_to_next_iter_s": round(t1 - t0, 3),
                "minus_one_iter_s": round(t1 - t0 - iter_s, 3),
                "survivors_kept_pid": kept,
            }  # fmt: skip
            print(json.dumps(res), flush=True)
            results.append(res)
            need = len(lines(out)) + 8
    finally:
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            job.kill()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--iterations", type=int, default=400)
    p.add_argument("--modes", default="in-process,group")
    a = p.parse_args()
    base = Path(a.out)
    base.mkdir(parents=True, exist_ok=True)
    summary = {}
    for mode in a.modes.split(","):
        res = run_mode(base, mode, a)
        summary[mode] = {
            "minus_one_iter_s": [r["minus_one_iter_s"] for r in res],
            "median_s": statistics.median(r["minus_one_iter_s"] for r in res),
            "max_s": max(r["minus_one_iter_s"] for r in res),
            "survivors_kept_pid": [r["survivors_kept_pid"] for r in res],
        }
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
