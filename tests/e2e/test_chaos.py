"""Chaos (issue 28): one job takes several random faults from outside and must end
bit-identical to the unprotected run, every recovery from memory.

The job: ``baft train``'s GPT on 4 ranks (dp=2 x pp=2), two declared nodes played by two
torchrun agents with their own store roots and ``BAFT_HOST_ID``s, xor:2 parity across
them, no DCP (so nothing but memory can bring a version back). In a seeded random order
and at random moments it takes: kill -9 of a worker; kill -STOP of a worker (the
watchdog must detect the hang); the loss of a node (its agent and workers killed, its
store root wiped, a replacement agent joining as a new host); kill -9 of two ranks at
once; and a kill -9 of a worker while the job is restoring from the previous one.

The seed is printed (``-s``) and in any failure message; ``BAFT_CHAOS_SEED=N`` replays it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.e2e import jobs
from tests.e2e.matrix import Case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CASE = Case("gpt", "dp2pp2", "1f1b", "1", "xor", "off", "hostid", "kill")
ITERATIONS = 44
FAULTS = ("kill", "stop", "node", "two", "kill-in-recovery")


def _recoveries(job: jobs.Job) -> list[dict]:
    return jobs.read_jsonl(job.out / "recoveries.jsonl")


def _wait_recovered(job: jobs.Job, count: int, done: int, timeout_s: float = 240.0) -> None:
    """Until ``count`` recoveries are recorded and the job is past iteration ``done``."""
    deadline = time.monotonic() + timeout_s
    while len(_recoveries(job)) < count or jobs.iterations_done(job.out, 4) <= done:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no recovery #{count} past iteration {done} in {timeout_s} s")
        if any(a.poll() is not None for a in job.agents.values()):
            raise RuntimeError(f"an agent ended: {[a.poll() for a in job.agents.values()]}")
        time.sleep(0.01)


def _new_workers(job: jobs.Job, old: set[int], timeout_s: float = 120.0) -> dict[int, int]:
    """The restarted group's workers (every rank on a pid not in ``old``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = job.workers()
        if len(now) == 4 and not (set(now.values()) & old):
            return now
        time.sleep(0.005)
    raise RuntimeError("the group did not restart")


def _fault(
    job: jobs.Job, kind: str, rng: random.Random, hosts: list[str], stopped: list[int]
) -> str:
    workers = job.workers()
    victim = rng.randrange(4)
    if kind == "kill":
        jobs.signal_all([workers[victim]], signal.SIGKILL)
        return f"kill -9 rank {victim}"
    if kind == "stop":
        jobs.signal_all([workers[victim]], signal.SIGSTOP)
        stopped.append(workers[victim])
        return f"kill -STOP rank {victim} (pid {workers[victim]})"
    if kind == "two":
        a, b = rng.sample(range(4), 2)
        jobs.signal_all([workers[a], workers[b]], signal.SIGKILL)
        return f"kill -9 ranks {a} and {b} at once"
    if kind == "node":
        lost = rng.choice(sorted(job.agents))
        jobs.kill_agent(job.agents.pop(lost))
        shutil.rmtree(job.root / lost, ignore_errors=True)
        new = hosts.pop(0)
        job.spawn(new, job.port)
        return f"host {lost} lost (store wiped), replacement host {new} joined"
    jobs.signal_all([workers[victim]], signal.SIGKILL)
    again = _new_workers(job, set(workers.values()))
    time.sleep(rng.uniform(0.0, 1.0))  # restart -> rendezvous -> inventory -> transfer
    second = rng.randrange(4)
    before = len(_recoveries(job))
    jobs.signal_all([again[second]], signal.SIGKILL)
    return f"kill -9 rank {victim}, then rank {second} of the restarted group ({before} recoveries recorded then)"


def test_chaos_ends_bit_identical_with_every_recovery_from_memory(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    seed = int(os.environ.get("BAFT_CHAOS_SEED", random.randrange(2**31)))
    print(f"chaos seed {seed} (BAFT_CHAOS_SEED={seed} to replay)")
    rng = random.Random(seed)
    order = list(FAULTS)
    rng.shuffle(order)
    ref = jobs.reference(CASE, tmp_path_factory.mktemp("ref"), iterations=ITERATIONS)

    root = Path("/dev/shm") / f"baft-chaos-{tmp_path.name}"
    out = tmp_path / "run"
    shutil.rmtree(root, ignore_errors=True)
    out.mkdir(parents=True)
    job = jobs.Job(case=CASE, out=out, root=root, env=jobs.launch_env())
    job.iterations, job.max_restarts = ITERATIONS, 12
    stopped: list[int] = []
    done: list[str] = []
    spare = ["c", "d", "e"]
    header = f"chaos seed {seed}: reproduce with BAFT_CHAOS_SEED={seed} .venv/bin/pytest -q -s -m slow tests/e2e/test_chaos.py"
    try:
        job.start(["a", "b"])
        at = 0
        for count, kind in enumerate(order, start=1):
            at = max(at, jobs.iterations_done(out, 4)) + rng.randint(3, 5)
            jobs.wait_for(job, at)
            time.sleep(rng.uniform(0.0, 0.03))
            did = _fault(job, kind, rng, spare, stopped)
            done.append(f"after iteration {at}: {did}")
            print(done[-1])
            _wait_recovered(job, count, at)
        rcs = job.wait(300)
        recs = _recoveries(job)
        problems = (
            jobs.check_training(CASE, job, ref, ITERATIONS)
            if all(rc == 0 for rc in rcs.values())
            else [f"agents ended with {rcs}"]
        )
        not_memory = [
            (r.get("source"), r.get("reason")) for r in recs if r.get("source") != "memory"
        ]
        if not_memory:
            problems.append(f"recoveries not from memory: {not_memory}")
        if len(recs) != len(FAULTS):
            problems.append(f"{len(recs)} recoveries recorded for {len(FAULTS)} faults")
    except RuntimeError as e:
        problems = [f"{e}"]
    finally:
        for agent in job.agents.values():
            if agent.poll() is None:
                jobs.kill_agent(agent)
        jobs.signal_all(stopped, signal.SIGKILL)
        job.rdzv = None
        shutil.rmtree(root, ignore_errors=True)
    if problems:
        pytest.fail("\n".join([header, *done, *problems, *job.log, job.tail()]), pytrace=False)
