"""Every failure-injection kind, end to end (slow: run with `make test-all`).

Each case trains the same job as a failure-free reference, with the injections given;
training must complete with the reference's loss log and final state digest, every
recovery from memory must lose at most one iteration, and falls back to disk only when
memory cannot serve (said in the reason).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from baft.config import CheckpointConfig
from tests.dist.runs import run_job, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _config(out: Path, store: Path, inject: list[str], timeout_s: float = 30.0):
    cfg = tiny_config(out, iterations=10, batch=8, num_dp=2, num_pp=2, num_microbatches=2)
    cfg.checkpoint = CheckpointConfig(
        redundancy="xor:2",
        persist_every=2,
        profile_iters=2,
        store_root=str(store),
        inject=inject,
        timeout_s=timeout_s,
        max_restarts=4,
    )
    return cfg


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    path = Path("/dev/shm") / f"baft-inj-{tmp_path_factory.getbasetemp().name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, store: Path) -> dict[str, Any]:
    return run_job(_config(tmp_path_factory.mktemp("ref"), store, []))


CASES = {
    "kill-at-iteration-start": (["kill:rank=3,iter=5,at=iteration"], 1),
    "kill-at-transfer": (["kill:rank=2,iter=5,at=transfer"], 1),
    "kill-at-persist": (["kill:rank=0,iter=5,at=persist"], 1),
    # the first restore is killed midway; the second restart completes it (one report)
    "kill-during-recovery": (["kill:rank=1,iter=4", "kill:rank=3,iter=0,at=recovery"], 1),
    # early in iteration 6 rank 0 flips a byte of its committed v5; rank 1 then dies
    # before v6 commits, so v5 must be restored with rank 0's shard rebuilt from parity
    "corrupt-then-kill": (["corrupt:rank=0,iter=6,at=snapshot", "kill:rank=1,iter=6"], 1),
    "delete-then-kill": (["delete:rank=2,iter=5", "kill:rank=1,iter=7"], 1),
    "both-nodes-in-turn": (["node:0,iter=4", "node:1,iter=7"], 2),
    "hang": (["hang:rank=1,iter=5"], 1),
    "slow-peer": (["slow:rank=1,iter=4,s=0.2,iters=2"], 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_injection(case: str, tmp_path: Path, store: Path, reference: dict[str, Any]) -> None:
    inject, num_recoveries = CASES[case]
    timeout = 8.0 if case == "hang" else 30.0
    got = run_job(_config(tmp_path / case, store, inject, timeout_s=timeout))
    assert [m["loss"] for m in got["metrics"]] == [m["loss"] for m in reference["metrics"]]
    assert got["summary"]["final_state_digest"] == reference["summary"]["final_state_digest"]
    recoveries = got["summary"]["recoveries"]
    assert len(recoveries) == num_recoveries, recoveries
    for r in recoveries:
        if r["source"] == "memory":
            assert r["lost_iterations"] <= 1, r
        else:
            assert r["source"] == "disk" and "from disk" in r["reason"], r
    if case == "kill-during-recovery":
        assert recoveries[0]["attempt"] >= 2
    if case == "corrupt-then-kill":
        (r,) = recoveries
        assert r["restored_version"] == 5 and r["sources"]["0"] == "parity", r
