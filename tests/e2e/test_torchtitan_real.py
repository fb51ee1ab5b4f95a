"""torchtitan 0.3.0's own Trainer with baft as its checkpointer, killed from outside.

``tests/e2e/titan_train.py`` runs ``torchtitan.trainer.Trainer`` (llama3 debugmodel split
by ``pipeline_llm``, ``parallelize_llama``'s FSDP2 and TP, its AdamW container, warmup
LR scheduler, HF tokenizer and text data loader) with ``BaftCheckpointManager`` under a
real ``torchrun`` on gloo. Each test runs it once without baft (``checkpoint.enable``
False), then with baft, and ``kill -9``s one rank's training process (its real pid, found
under the agent) at a random moment after a few steps: under ``-m baft.inprocess`` (the
survivors keep their processes) or with torchrun's group restart (``--max-restarts``).
The job must end with exit 0, one recovery from memory losing at most one step, and on
every rank the same bytes as the run without baft: every local shard of the model and
optimizer state, LR schedulers, data loader position, RNG, step, and each step's loss and
gradient norm. ``BAFT_TITAN_SEED`` replays a kill moment.

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
    three of those, and with them a running job's checkpoint folder."""
    root = Path(tempfile.mkdtemp(prefix="baft-titan-"))
    yield root
    if not os.environ.get("BAFT_TITAN_KEEP"):  # set: keep the runs' logs to look at
        shutil.rmtree(root, ignore_errors=True)


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
    return [*cmd, f"--ranks-per-node={world // 2}", f"--store-root={store}"]


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


def _killed_run(layout: str, tmp: Path, assets: Path, launch: str) -> dict[str, Any]:
    """Launch with baft, SIGKILL one rank's training process at a random moment after
    step 4 (baft's first versions are committed after its profiling steps), wait for
    the end. Returns the states, the recoveries, the victim and the pids before."""
    seed = int(os.environ.get("BAFT_TITAN_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    world = LAYOUTS[layout][0]
    tmp.mkdir(parents=True, exist_ok=True)
    out, store = tmp / "run", Path("/dev/shm") / f"{tmp.parent.name}-{tmp.name}"
    progress = out / "checkpoint" / "baft"
    after, victim, delay = rng.randint(4, STEPS - 4), rng.randrange(world), rng.uniform(0, 1)
    what = f"BAFT_TITAN_SEED={seed}: kill -9 rank {victim} {delay:.2f} s after step {after}"
    log = open(tmp / "agent.log", "w")  # noqa: SIM115
    agent = subprocess.Popen(
        _command(layout, out, assets, launch, store), env=_env(), cwd=REPO, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while iterations_done(progress, world) < after:
            assert agent.poll() is None and time.monotonic() < deadline, what
            time.sleep(0.05)
        time.sleep(delay)
        pids = training_pids(agent.pid) if launch == "inprocess" else worker_pids(agent)
        os.kill(pids[victim], signal.SIGKILL)
        rc = agent.wait(600)
    finally:
        if agent.poll() is None:
            kill_tree(agent)
        log.close()
    assert rc == 0, (what, (tmp / "agent.log").read_text()[-4000:])
    recs = read_jsonl(progress / "recoveries.jsonl")
    return {"states": _states(out, world), "recs": recs, "victim": victim, "pids": pids,
            "what": what}  # fmt: skip


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


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="baft keeps one copy of state= objects per DP replica group today (replicas "
    "share it); torchtitan's data loader state is per DP rank (dp_rank_N), so replica 1 "
    "restores without its position. Per-replica state= objects are being added in "
    "baft/pipeline/small_state.py (another engineer's work); drop this mark with it.",
)
def test_hsdp_pp_titan_data_loader_position_per_replica(assets: Path, work: Path) -> None:
    tmp = work / "hsdp"
    ref = _reference("hsdp_pp", work, assets)
    got = _killed_run("hsdp_pp", tmp, assets, "inprocess")
    if [r["source"] for r in got["recs"]] != ["memory"]:  # not the expected failure
        raise RuntimeError(f"{got['what']}: recoveries {got['recs']}")
    for rank, (state, want) in enumerate(zip(got["states"], ref, strict=True)):
        position = (state["dataloader"], state["dataloader_yielded"])
        assert position == (want["dataloader"], want["dataloader_yielded"]), (rank, position)
