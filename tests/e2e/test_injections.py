"""Every failure-injection kind, end to end (slow: run with `make test-all`).

Each case trains the same job as an unprotected reference (checkpointing off), with the
injections given; training must complete with the reference's loss log and every rank's
final state digest. Every recovery pins its source: from memory (losing at most one
iteration) with each rank's shard from the expected place (its own store, or parity when
its node's store is gone), and from disk only where the case leaves no memory path.
The default suite runs the kill, node-loss, corruption and rs:k+m cases of
``test_kill_recover.py``; this file is the rest of the fault matrix.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from baft.config import CheckpointConfig, StoreConfig, TimeoutConfig
from baft.plan.types import CheckpointPolicy
from tests.dist.runs import run_job, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _config(
    out: Path, store: Path | None, inject: list[str], timeout_s: float = 30.0, full_every: int = 1
):
    cfg = tiny_config(out, iterations=10, batch=8, num_dp=2, num_pp=2, num_microbatches=2)
    if store is None:  # the unprotected reference
        return cfg
    cfg.checkpoint = CheckpointConfig(
        policy=CheckpointPolicy(redundancy="xor:2", persist_every=2, full_every=full_every),
        profile_iters=2,
        store=StoreConfig(root=str(store)),
        timeouts=TimeoutConfig(collective_s=timeout_s),
    )
    cfg.inject = inject
    cfg.max_restarts = 4
    return cfg


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    path = Path("/dev/shm") / f"baft-inj-{tmp_path_factory.getbasetemp().name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_job(_config(tmp_path_factory.mktemp("ref"), None, []))


LOCAL = {str(r): "local" for r in range(4)}
NODE0_LOST = {"0": "parity", "1": "parity", "2": "local", "3": "local"}
NODE1_LOST = {"0": "local", "1": "local", "2": "parity", "3": "parity"}


def killed_after_snapshot(rank: int) -> list[tuple[str, dict[str, str]]]:
    """A rank killed (or hung) after snapshotting version v but before completing it: its
    parity partner may have received all of v's pieces and completed v before the group
    went down (a race), so v comes back with that rank's shard rebuilt from parity;
    otherwise v-1 comes back entirely from local stores. Nothing else is acceptable."""
    return [("memory", LOCAL), ("memory", {**LOCAL, str(rank): "parity"})]


# case -> (injections, per recovery: the acceptable (source, per-rank shard sources))
Options = list[tuple[str, dict[str, str] | None]]
CASES: dict[str, tuple[list[str], list[Options]]] = {
    "kill-at-iteration-start": (["kill:rank=3,iter=5,at=iteration"], [[("memory", LOCAL)]]),
    "kill-at-transfer": (["kill:rank=2,iter=5,at=transfer"], [killed_after_snapshot(2)]),
    "kill-at-persist": (["kill:rank=0,iter=5,at=persist"], [[("memory", LOCAL)]]),
    # the first restore is killed midway; the second restart completes it (one report)
    "kill-during-recovery": (
        ["kill:rank=1,iter=4", "kill:rank=3,iter=0,at=recovery"],
        [killed_after_snapshot(1)],
    ),
    # rank 2's store is deleted under it; it starts a fresh one and keeps protecting
    "delete-then-kill": (
        ["delete:rank=2,iter=5", "kill:rank=1,iter=7"],
        [killed_after_snapshot(1)],
    ),
    # rank 2's store is deleted while its snapshot of v5 is being written: the same-host
    # ranks pulling its bytes give v5 up (it fails the vote) instead of timing out
    "delete-mid-snapshot": (["delete:rank=2,iter=5,at=snapshot"], []),
    "both-nodes-in-turn": (
        ["node:0,iter=4", "node:1,iter=7"],
        [[("memory", NODE0_LOST)], [("memory", NODE1_LOST)]],
    ),
    # a corrupted parity region is not read when every data shard is intact
    "corrupt-parity-then-kill": (
        ["corrupt:rank=2,iter=6,target=redundancy,at=snapshot", "kill:rank=1,iter=6"],
        [killed_after_snapshot(1)],
    ),
    # partial memory loss: rank 1 dies; while the job restores, node 0 (ranks 0, 1) is
    # lost and rank 2's store is deleted. Rank 3's store survives, but every node-0 shard
    # had its parity partner on rank 2 or its own node: no memory path, DCP serves
    "partial-memory-loss-falls-back-to-disk": (
        [
            "kill:rank=1,iter=6",
            "delete:rank=2,iter=5,at=recovery",
            "node:0,iter=5,at=recovery",
        ],
        [[("disk", None)]],
    ),
    # corruption of a redundancy region that is needed: rank 1 dies mid-snapshot of v6;
    # while the job restores v5, rank 2's parity of v5 gets a flipped byte and node 0 is
    # lost. Rebuilding node 0 needs exactly that parity: the checksum must catch it
    # (no silent wrong restore) and the DCP checkpoint serves
    "needed-parity-corrupted-falls-back-to-disk": (
        [
            "kill:rank=1,iter=6,at=snapshot",
            "corrupt:rank=2,iter=5,target=redundancy,at=recovery",
            "node:0,iter=5,at=recovery",
        ],
        [[("disk", None)]],
    ),
    "hang": (["hang:rank=1,iter=5"], [killed_after_snapshot(1)]),
    "slow-peer": (["slow:rank=1,iter=4,s=0.2,iters=2"], []),
}


@pytest.mark.parametrize("full_every", [1, 2], ids=["full", "differential"])
@pytest.mark.parametrize("case", list(CASES))
def test_injection(
    case: str, full_every: int, tmp_path: Path, store: Path, reference: dict[str, Any]
) -> None:
    """Every case with full snapshots and with differential checkpoints (full_every=2:
    the rotation starts at v2, so v3 is the first rebuildable version)."""
    inject, expected = CASES[case]
    timeout = 8.0 if case == "hang" else 30.0
    got = run_job(_config(tmp_path / case, store, inject, timeout_s=timeout, full_every=full_every))
    assert [m["loss"] for m in got["metrics"]] == [m["loss"] for m in reference["metrics"]]
    assert got["summary"]["rank_digests"] == reference["summary"]["rank_digests"]
    assert got["summary"]["final_state_digest"] == reference["summary"]["final_state_digest"]
    recoveries = got["summary"]["recoveries"]
    assert len(recoveries) == len(expected), recoveries
    for r, options in zip(recoveries, expected, strict=True):
        assert (r["source"], r["sources"] or None) in options, r
    for r in recoveries:
        if r["source"] == "memory":
            assert r["lost_iterations"] <= 1, r
        else:
            assert "from disk" in r["reason"], r
    if case == "kill-during-recovery":
        assert recoveries[0]["attempt"] >= 2
