"""A rank's supervisor killed from outside under ``-m baft.inprocess``.

The supervisor is the process torchrun watches; its training process is a child of the
forkserver, not of the supervisor. kill -9 of the supervisor (an OOM kill, a stray
``kill``) must not leave that training process running beside the restarted job:
torchrun sees its worker fail and restarts the group, the orphaned training process
goes with its process groups, and the job restores from memory, bit-identical to the
same script without baft. With two agents, rank 0's supervisor sees the dead
supervisor's lease end and gives up at once (:mod:`baft.inprocess.lease`).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import jobs
from tests.e2e.matrix import Case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _supervisors(job: jobs.Job) -> dict[int, int]:
    """Rank -> pid of torchrun's own workers (the supervisors)."""
    out: dict[int, int] = {}
    for agent in job.agents.values():
        kids = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(agent.pid)], capture_output=True, text=True
        ).stdout.split()
        for pid in map(int, kids):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e[5:] for e in env if e.startswith(b"RANK=")]
            if rank:
                out[int(rank[0])] = pid
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("hosts", ["one", "hostid"])
def test_a_killed_supervisor_restarts_the_group_from_memory(tmp_path: Path, hosts: str) -> None:
    case = Case(
        app="user-unique", layout="dp2pp2", schedule="1f1b", full_every="1", redundancy="xor",
        persist="off", hosts=hosts, launch="inprocess", fault="kill",
    )  # fmt: skip
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    ref: dict[str, Any] = jobs.reference(case, tmp_path / "ref")
    root = Path("/dev/shm") / f"baft-supkill-{tmp_path.name}"
    job = jobs.start_job(case, tmp_path / "run", root)
    try:
        jobs.wait_for(job, rng.randint(7, 11))
        victim = rng.randrange(case.world)
        before = job.workers()
        os.kill(_supervisors(job)[victim], signal.SIGKILL)
        rcs = job.wait(300)
        where = f"seed {seed}, victim rank {victim}\n{job.tail()}"
        assert rcs == {h: 0 for h in job.agents}, (rcs, where)
        assert jobs.check_training(case, job, ref, jobs.ITERATIONS) == [], where
        recs = jobs.read_jsonl(job.out / "recoveries.jsonl")
        # a group restart (a supervisor is not replaced in-process), from memory
        assert [(r["source"], jobs.generation(r)) for r in recs] == [("memory", 0)], where
        assert [p for p in before.values() if _alive(p)] == [], where
    finally:
        jobs.stop_job(job)
