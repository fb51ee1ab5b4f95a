"""What the peers' recovery jobs (torchft, NVRx) share: their record files, the kills sent
from outside, and the end of a job's processes.

Each worker appends JSON lines to files of the job's directory (``attempts.jsonl``: one
step attempt per line, see :data:`baft_bench.peer_downtime.ATTEMPT`; ``ready.jsonl``: one
line per process start or function entry). The bench reads them while the job runs to
choose its moments, and after it to build the rows.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ATTEMPTS = "attempts.jsonl"
READY = "ready.jsonl"
FINAL = "final-r{replica}.json"
STOP = "stop-at"
"""The step the job ends at, written by the bench once the last kill has been recovered
from (the failure-free job of the same length is then given that many steps)."""
FINAL_MODEL = "final-model-r0.pt"
"""Replica 0's final model parameters (``torch.save``), to measure how far a final
state that is not bit-identical is from the failure-free one."""


def emit(path: Path, rec: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_at(out: Path, steps: int) -> int:
    """The step to end at: ``steps``, or earlier when the bench has written :data:`STOP`."""
    try:
        return min(steps, int((out / STOP).read_text()))
    except (FileNotFoundError, ValueError):
        return steps


def _full_strength(out: Path, since: float, replicas: int) -> list[dict[str, Any]]:
    return [
        a
        for a in read(out / ATTEMPTS)
        if a["t0"] >= since and a["committed"] and a["participants"] >= replicas
    ]


def kill_from_outside(
    out: Path,
    kills: int,
    gap: int,
    seed: int,
    deadline: float,
    target: Callable[[int], int],
    replicas: int = 2,
) -> tuple[list[dict[str, Any]], int | None]:
    """SIGKILL the process of replica ``target(i)`` for kill ``i``, each once the job has
    committed ``gap`` steps with every replica since the previous kill (or the start),
    after a random fraction of that replica's median step time (seeded). After the last
    kill (when ``kills`` > 0), once the job has again trained ``gap`` steps at full
    strength, write :data:`STOP`: ``gap`` steps past the newest committed one.

    Returns one record per kill (replica, pid, the step it was on, the time just before
    the signal) and the step the job ends at (None without kills)."""
    rng = random.Random(seed)
    done: list[dict[str, Any]] = []
    while len(done) < kills and time.time() < deadline:
        time.sleep(0.05)
        full = _full_strength(out, done[-1]["t"] if done else 0.0, replicas)
        who = target(len(done))
        mine = [a for a in full if a["replica"] == who]
        if len({a["step"] for a in full}) < gap or not mine:
            continue
        time.sleep(rng.uniform(0.0, statistics.median(a["t1"] - a["t0"] for a in mine)))
        last = max((a for a in read(out / ATTEMPTS) if a["replica"] == who), key=lambda a: a["t1"])
        t = time.time()
        os.kill(last["pid"], signal.SIGKILL)
        done.append({"replica": who, "pid": last["pid"], "step": last["step"] + 1, "t": t})
    if not done or len(done) < kills:
        return done, None
    while time.time() < deadline:
        time.sleep(0.05)
        full = _full_strength(out, done[-1]["t"], replicas)
        if len({a["step"] for a in full}) >= gap:
            end = max(a["step"] for a in full) + 1 + gap
            (out / STOP).write_text(f"{end}\n")
            return done, end
    return done, None


def end_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL what is left of each process group started here (its own session)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def records(out: Path, replicas: int = 2) -> dict[str, Any]:
    return {
        "attempts": read(out / ATTEMPTS),
        "ready": read(out / READY),
        "finals": [
            json.loads((out / FINAL.format(replica=r)).read_text()) for r in range(replicas)
        ],
    }
