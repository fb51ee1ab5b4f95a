"""Chaos (issue 28): one job takes many random faults from outside and must end
bit-identical to the unprotected run, every recovery from memory.

The job: ``baft train``'s GPT on 4 ranks (dp=2 x pp=2), two declared nodes played by two
torchrun agents with their own store roots and ``BAFT_HOST_ID``s, xor:2 parity across
them, no DCP (so nothing but memory can bring a version back). Two launches:

- ``inprocess`` (the default a user gets, ``-m baft.inprocess``): 13 faults in a seeded
  random order at random moments: kill -9 of a training process (four times, the
  survivors must keep their processes when it is recovered in-process); kill -STOP of one
  (twice, the watchdog must detect the hang); two killed at once; the host without rank 0
  lost and rank 0's host lost (agent, supervisors, training processes killed, store root
  wiped, a replacement agent joining as a new host); while the job recovers in-process
  from a kill -9: another kill -9 (twice; in-process recovery gives up, torchrun's group
  restart takes over), a kill -STOP, and a host lost. Single kills and hangs are
  recovered in-process unless a rank failed a 4th time in one launch attempt (then the
  group restarts, as documented); host losses restart the group.
- ``group`` (torchrun's group restart): kill -9 of a worker; kill -STOP of a worker; the
  loss of a node; kill -9 of two ranks at once; and a kill -9 of a worker while the job
  is restoring from the previous one.

After a kill -STOP the watchdogs' hang records must name the frozen rank and no other.
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

WORLD = 4
CASES = {
    launch: Case("gpt", "dp2pp2", "1f1b", "1", "xor", "off", "hostid", launch, "kill")
    for launch in ("inprocess", "group")
}
FAULTS = {
    "inprocess": (
        *["kill"] * 4,
        "stop",
        "stop",
        "two",
        "node",
        "node0",
        "kill-in-recovery",
        "kill-in-recovery",
        "node-in-recovery",
        "stop-in-recovery",
    ),  # fmt: skip
    "group": ("kill", "stop", "node", "two", "kill-in-recovery"),
}
ITERATIONS = {"inprocess": 110, "group": 44}


def _recoveries(job: jobs.Job) -> list[dict]:
    return jobs.read_jsonl(job.out / "recoveries.jsonl")


def _wait_recovered(job: jobs.Job, count: int, done: int, timeout_s: float = 240.0) -> None:
    """Until ``count`` recoveries are recorded and the job is past iteration ``done``."""
    deadline = time.monotonic() + timeout_s
    while len(_recoveries(job)) < count or jobs.iterations_done(job.out, WORLD) <= done:
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
        if len(now) == WORLD and not (set(now.values()) & old):
            return now
        time.sleep(0.005)
    raise RuntimeError("the group did not restart")


def _replaced(job: jobs.Job, rank: int, old: int, timeout_s: float = 120.0) -> dict[int, int]:
    """The training processes once ``rank``'s is a new one (its replacement was forked:
    the in-process recovery is under way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = job.workers()
        if now.get(rank, old) != old:
            return now
        time.sleep(0.005)
    raise RuntimeError(f"rank {rank}'s training process {old} was not replaced")


def _lose_host(job: jobs.Job, lost: str, hosts: list[str]) -> str:
    new = hosts.pop(0)
    job.lose_host(lost, new)
    return f"host {lost} lost (store wiped), replacement host {new} joined"


def _fault(
    job: jobs.Job,
    kind: str,
    victim: int,
    rng: random.Random,
    hosts: list[str],
    stopped: list[int],
) -> str:
    """Deliver one fault of ``kind`` (``victim``: the rank a kill or stop hits first)."""
    workers = job.workers()
    if len(workers) != WORLD:
        raise RuntimeError(f"training processes of {sorted(workers)} only, before {kind}")
    if kind == "kill":
        jobs.signal_all([workers[victim]], signal.SIGKILL)
        return f"kill -9 rank {victim} (pid {workers[victim]})"
    if kind == "stop":
        jobs.signal_all([workers[victim]], signal.SIGSTOP)
        stopped.append(workers[victim])
        return f"kill -STOP rank {victim} (pid {workers[victim]})"
    if kind == "two":
        a, b = rng.sample(range(WORLD), 2)
        jobs.signal_all([workers[a], workers[b]], signal.SIGKILL)
        return f"kill -9 ranks {a} and {b} at once"
    if kind == "node" and not job.inprocess:
        return _lose_host(job, rng.choice(sorted(job.agents)), hosts)
    if kind in ("node", "node0"):
        rank0 = job.host_of(0)
        lost = rank0 if kind == "node0" else next(h for h in sorted(job.agents) if h != rank0)
        return f"{_lose_host(job, lost, hosts)} ({'rank 0' if kind == 'node0' else 'not rank 0'}'s)"
    # a fault while the job recovers from a kill -9
    jobs.signal_all([workers[victim]], signal.SIGKILL)
    before = len(_recoveries(job))
    if job.inprocess:  # the replacement is forked: the survivors re-enter, restore
        again = _replaced(job, victim, workers[victim])
        time.sleep(rng.uniform(0.0, 0.3))
    else:
        again = _new_workers(job, set(workers.values()))
        time.sleep(rng.uniform(0.0, 1.0))  # restart -> rendezvous -> inventory -> transfer
    first = f"kill -9 rank {victim}, then ({before} recoveries recorded)"
    second = rng.randrange(WORLD)
    if kind == "node-in-recovery":
        return f"{first} {_lose_host(job, rng.choice(sorted(job.agents)), hosts)}"
    if second not in again:
        raise RuntimeError(f"no training process of rank {second} during the recovery: {again}")
    if kind == "stop-in-recovery":
        jobs.signal_all([again[second]], signal.SIGSTOP)
        stopped.append(again[second])
        return f"{first} kill -STOP rank {second} (pid {again[second]})"
    jobs.signal_all([again[second]], signal.SIGKILL)
    return f"{first} kill -9 rank {second} (pid {again[second]})"


def _kept(job: jobs.Job, before: dict[int, int], victim: int, new: list[dict]) -> str | None:
    """After a single kill recovered in-process: what is wrong with the survivors."""
    if not new or any(jobs.generation(r) < 1 for r in new):
        return None  # fell back to a group restart (e.g. a rank's 4th failure): allowed
    now = job.workers()
    moved = {r: (p, now.get(r)) for r, p in before.items() if r != victim and now.get(r) != p}
    return f"survivors did not keep their processes (before, now): {moved}" if moved else None


@pytest.mark.parametrize("launch", list(CASES))
def test_chaos_ends_bit_identical_with_every_recovery_from_memory(
    launch: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    case, iterations = CASES[launch], ITERATIONS[launch]
    seed = int(os.environ.get("BAFT_CHAOS_SEED", random.randrange(2**31)))
    print(f"chaos seed {seed} (BAFT_CHAOS_SEED={seed} to replay)")
    rng = random.Random(seed)
    order = list(FAULTS[launch])
    rng.shuffle(order)
    ref = jobs.reference(case, tmp_path_factory.mktemp("ref"), iterations=iterations)

    root = Path("/dev/shm") / f"baft-chaos-{tmp_path.name}"
    out = tmp_path / "run"
    shutil.rmtree(root, ignore_errors=True)
    out.mkdir(parents=True)
    job = jobs.Job(case=case, out=out, root=root, env=jobs.launch_env())
    job.iterations, job.max_restarts = iterations, 12
    stopped: list[int] = []
    done: list[str] = []
    problems: list[str] = []
    spare = [h for h in jobs.ADDRS if h not in ("a", "b")]
    header = (
        f"chaos ({launch}) seed {seed}: reproduce with BAFT_CHAOS_SEED={seed} "
        f".venv/bin/pytest -q -s -m slow tests/e2e/test_chaos.py -k {launch}"
    )
    try:
        job.start(["a", "b"])
        at = 0
        for kind in order:
            at = max(at, jobs.iterations_done(out, WORLD)) + rng.randint(3, 5)
            jobs.wait_for(job, at)
            time.sleep(rng.uniform(0.0, 0.03))
            before, count = job.workers(), len(_recoveries(job))
            hangs = len(jobs.read_jsonl(out / "hangs.jsonl"))
            victim = rng.randrange(WORLD)
            did = _fault(job, kind, victim, rng, spare, stopped)
            _wait_recovered(job, count + 1, at)
            recs = _recoveries(job)
            how = [
                f"gen {jobs.generation(r)}" if jobs.generation(r) else f"attempt {r.get('attempt')}"
                for r in recs[count:]
            ]
            done.append(f"after iteration {at}: {did}; recovered: {', '.join(how)}")
            print(done[-1])
            if kind == "kill" and job.inprocess:
                wrong = _kept(job, before, victim, recs[count:])
                if wrong:
                    problems.append(f"{done[-1]}: {wrong}")
            if kind == "stop":  # the watchdogs name the frozen rank, no other
                named = [h.get("suspect") for h in jobs.read_jsonl(out / "hangs.jsonl")[hangs:]]
                if any(s is not None and s != victim for s in named):
                    problems.append(f"{done[-1]}: the watchdogs named ranks {named}")
        rcs = job.wait(300)
        recs = _recoveries(job)
        if all(rc == 0 for rc in rcs.values()):
            problems += jobs.check_training(case, job, ref, iterations)
        else:
            problems.append(f"agents ended with {rcs}")
        not_memory = [
            (r.get("source"), r.get("reason")) for r in recs if r.get("source") != "memory"
        ]
        if not_memory:
            problems.append(f"recoveries not from memory: {not_memory}")
        if not job.inprocess and len(recs) != len(order):
            problems.append(f"{len(recs)} recoveries recorded for {len(order)} faults")
        if job.inprocess and not any(jobs.generation(r) for r in recs):
            problems.append(f"no recovery was in-process: {[r.get('attempt') for r in recs]}")
    except RuntimeError as e:
        problems.append(f"{e}")
    finally:
        for agent in job.agents.values():
            if agent.poll() is None:
                jobs.kill_agent(agent)
        jobs.signal_all(stopped, signal.SIGKILL)
        jobs.reap(root.name)
        job.rdzv = None
        shutil.rmtree(root, ignore_errors=True)
    if problems:
        pytest.fail("\n".join([header, *done, *problems, *job.log, job.tail()]), pytrace=False)
