"""torchtitan 0.3.0's own Trainer with baft as its checkpointer, killed from outside.

``tests/e2e/titan_train.py`` runs ``torchtitan.trainer.Trainer`` (llama3 debugmodel split
by ``pipeline_llm``, ``parallelize_llama``'s FSDP2 and TP, its AdamW container, warmup
LR scheduler, HF tokenizer and text data loader) with ``BaftCheckpointManager`` under a
real ``torchrun`` on gloo. Each test runs it once without baft (``checkpoint.enable``
False), then with baft, and ``kill -9``s one rank's training process (its real pid, found
under the agent) at a random moment once every rank has committed a version a restore
can rebuild (:data:`POLICY`: before that a restore starts over from step 0 by design):
under ``-m baft.inprocess`` (the survivors keep their processes) or with torchrun's group
restart (``--max-restarts``). The job must end with exit 0, one recovery from memory of
that version or a newer one, losing at most one step, and on every rank the same bytes as
the run without baft: every local shard of the model and optimizer state, LR schedulers,
data loader position, RNG, step, and each step's loss and gradient norm.
``BAFT_TITAN_SEED`` replays a kill moment (``-rP`` prints it).

All are slow (a 4-rank pair of runs takes about 2 minutes on 2 CPU cores; default-tier
cover: ``tests/dist/test_torchtitan_manager.py``, the manager in torchtitan's own classes).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baft.train.launch import launch_env
from tests.e2e.jobs import (
    REPO,
    iterations_done,
    kill_tree,
    read_jsonl,
    torchrun,
    training_pids,
    worker_pids,
)

pytest.importorskip("torchtitan")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SCRIPT = REPO / "tests" / "e2e" / "titan_train.py"
STEPS = 12
LAYOUTS = {
    "fsdp2_pp": (4, ["--pp=2", "--dp-shard=2"]),
    "fsdp2_tp_pp": (8, ["--pp=2", "--dp-shard=2", "--tp=2"]),
    "hsdp_pp": (4, ["--pp=2", "--dp-replicate=2", "--dp-shard=1"]),
}
POLICY = "redundancy=xor:2,full_every=4"
"""Differential checkpoints with a fixed window: ``full_every=auto`` picks k from the
profiled bubbles (up to 8, so it varies with the machine's load), and a version is
rebuildable from memory only once its rotation is a whole window old (the first at
v(first + k - 1), i.e. after step 7 here with k=4: baft's first version is v3); a kill
before that starts over from step 0 by design."""
COMPARED = ("model", "optim", "lr", "lr_schedulers", "dataloader", "rng", "train_state")


def _env() -> dict[str, str]:
    env = launch_env()
    env["TORCHDYNAMO_DISABLE"] = "1"  # torchtitan compiles flex/block masks; unused on CPU
    env["HF_DATASETS_OFFLINE"] = "1"
    env["BAFT_INPROCESS_PRELOAD"] = "torchtitan.trainer,torchtitan.models.llama3"
    return env


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """The runs' directory, outside pytest's numbered temporary directories: a pytest
    session started meanwhile (another suite on this machine) deletes all but the newest
    three of those, and with them a running job's checkpoint folder. Its unique name
    (``mkdtemp``) also names each run's store root, ``/dev/shm/<work>/<case>``: no path is
    shared with another run or another session. Both are removed at the end unless
    ``BAFT_TITAN_KEEP`` is set (to look at the runs' logs)."""
    root = Path(tempfile.mkdtemp(prefix="baft-titan-"))
    yield root
    if not os.environ.get("BAFT_TITAN_KEEP"):
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / root.name, ignore_errors=True)


@pytest.fixture(scope="module")
def assets(work: Path) -> Path:
    root = work / "assets"
    cmd = [sys.executable, str(SCRIPT), f"--out={root}", f"--assets={root}", "--make-assets"]
    subprocess.run(cmd, check=True, cwd=REPO, timeout=120)
    return root


def _command(layout: str, out: Path, assets: Path, launch: str, store: Path) -> list[str]:
    world, dims = LAYOUTS[layout]
    cmd = torchrun(world, out / "logs", None, max_restarts=0 if launch == "ref" else 3)
    cmd += ["-m", "baft.inprocess"] if launch == "inprocess" else []
    cmd += [str(SCRIPT), f"--out={out}", f"--assets={assets}", f"--steps={STEPS}", *dims]
    if launch == "ref":
        return [*cmd, "--unprotected"]
    return [*cmd, f"--ranks-per-node={world // 2}", f"--store-root={store}", f"--policy={POLICY}"]


def _states(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"state.rank{r}.json").read_text()) for r in range(world)]


_REFERENCES: dict[str, list[dict[str, Any]]] = {}


def _reference(layout: str, tmp: Path, assets: Path) -> list[dict[str, Any]]:
    if layout not in _REFERENCES:
        out = tmp / f"ref-{layout}"
        cmd = _command(layout, out, assets, "ref", tmp)
        r = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, timeout=900)
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        _REFERENCES[layout] = _states(out, LAYOUTS[layout][0])
    return _REFERENCES[layout]


def _restorable(out: Path, world: int) -> int:
    """The newest version every rank knows is committed and rebuildable from memory
    (``titan_train.py`` writes ``<out>/restorable/rank<R>`` after each step); -1: none."""
    got = []
    for r in range(world):
        try:
            got.append(int((out / "restorable" / f"rank{r}").read_text()))
        except (OSError, ValueError):
            got.append(-1)
    return min(got)


def _killed_run(layout: str, tmp: Path, assets: Path, launch: str) -> dict[str, Any]:
    """Launch with baft, SIGKILL one rank's training process at a random moment once a
    version is rebuildable from memory on every rank (0-2 steps after the first one is,
    then 0-1 s into a step), wait for the end. Returns the states, the recoveries, the
    victim, the pids before and the version that was rebuildable at the kill."""
    seed = int(os.environ.get("BAFT_TITAN_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    world = LAYOUTS[layout][0]
    tmp.mkdir(parents=True, exist_ok=True)
    out, store = tmp / "run", Path("/dev/shm") / tmp.parent.name / tmp.name
    progress = out / "checkpoint" / "baft"
    more, victim, delay = rng.randint(0, 2), rng.randrange(world), rng.uniform(0, 1)
    what = f"BAFT_TITAN_SEED={seed}: kill -9 rank {victim} {delay:.2f} s after step "
    log = open(tmp / "agent.log", "w")  # noqa: SIM115
    agent = subprocess.Popen(
        _command(layout, out, assets, launch, store), env=_env(), cwd=REPO, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while (ready := _restorable(out, world)) < 0:
            assert agent.poll() is None and time.monotonic() < deadline, (what, "no version")
            time.sleep(0.05)
        after = iterations_done(progress, world) + more
        what += f"{after} (v{ready} rebuildable {more} step(s) before)"
        while (done := iterations_done(progress, world)) < after:
            assert agent.poll() is None and time.monotonic() < deadline, what
            time.sleep(0.05)
        time.sleep(delay)
        pids = training_pids(agent.pid) if launch == "inprocess" else worker_pids(agent)
        assert agent.poll() is None and done < STEPS, (what, "the job ended before the kill")
        os.kill(pids[victim], signal.SIGKILL)
        print(what)  # shown with -rP or on failure: BAFT_TITAN_SEED replays it
        rc = agent.wait(600)
    finally:
        if agent.poll() is None:
            kill_tree(agent)
        log.close()
    assert rc == 0, (what, (tmp / "agent.log").read_text()[-4000:])
    recs = read_jsonl(progress / "recoveries.jsonl")
    return {"states": _states(out, world), "recs": recs, "victim": victim, "pids": pids,
            "what": what, "ready": ready}  # fmt: skip


def _check_bit_identical(got: dict[str, Any], ref: list[dict[str, Any]]) -> None:
    what = got["what"]
    for rank, (state, want) in enumerate(zip(got["states"], ref, strict=True)):
        diff = [k for k in COMPARED if state[k] != want[k]]
        assert not diff, (what, rank, diff)
        ran = state["steps"]  # each step this process ran: the same loss and grad norm
        assert ran and all(ran[s] == want["steps"][s] for s in ran), (what, rank, ran)
        assert state["train_state"]["step"] == STEPS


def _check_recovered(got: dict[str, Any], launch: str) -> None:
    what, recs = got["what"], got["recs"]
    assert [r["source"] for r in recs] == ["memory"], (what, recs)
    assert recs[0]["lost_iterations"] <= 1, (what, recs)
    assert recs[0]["restored_version"] >= got["ready"], (what, recs)
    resumed = recs[0]["resume_iteration"]
    for rank, state in enumerate(got["states"]):
        same_process = state["pid"] == got["pids"][rank]
        # in-process: only the killed process is replaced; group restart: every one
        assert same_process == (launch == "inprocess" and rank != got["victim"]), (what, rank)
        if not same_process:  # a new process resumed after the restored step
            assert min(int(s) for s in state["steps"]) == resumed + 1, (what, rank, resumed)


@pytest.mark.parametrize("launch", ["inprocess", "group"])
def test_fsdp2_pp_titan_trainer_killed_from_outside(launch: str, assets: Path, work: Path) -> None:
    tmp = work / f"fsdp2-{launch}"
    ref = _reference("fsdp2_pp", work, assets)
    got = _killed_run("fsdp2_pp", tmp, assets, launch)
    _check_recovered(got, launch)
    _check_bit_identical(got, ref)


def test_fsdp2_tp_pp_titan_trainer_killed_in_process(assets: Path, work: Path) -> None:
    tmp = work / "tp"
    ref = _reference("fsdp2_tp_pp", work, assets)
    got = _killed_run("fsdp2_tp_pp", tmp, assets, "inprocess")
    _check_recovered(got, "inprocess")
    _check_bit_identical(got, ref)


def test_hsdp_pp_titan_data_loader_position_per_replica(assets: Path, work: Path) -> None:
    """pp 2 x dp_replicate 2: torchtitan's data loader state is per DP rank
    (``dp_rank_N``), so each replica must get its own position back (baft keeps every
    replica's ``state=`` objects: ``extra.state.dp<d>.dataloader``); before per-replica
    state replica 1 restored replica 0's copy, torchtitan's loader logged ``DataLoader
    state is empty for dp rank 1`` and started over."""
    tmp = work / "hsdp"
    ref = _reference("hsdp_pp", work, assets)
    got = _killed_run("hsdp_pp", tmp, assets, "inprocess")
    _check_recovered(got, "inprocess")
    for rank, (state, want) in enumerate(zip(got["states"], ref, strict=True)):
        position = (state["dataloader"], state["dataloader_yielded"])
        assert position == (want["dataloader"], want["dataloader_yielded"]), (rank, position)
    _check_bit_identical(got, ref)
