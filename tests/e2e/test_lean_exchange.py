"""The lean protect path under real failures: redundancy between ranks of one host moves
through their stores (no socket), and a rank killed while that exchange is in flight, or a
lost node, still recovers from memory bit-identically to an unprotected run. The same
job with ``exchange=network`` takes the transport path and ends identical too."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

from baft.config import CheckpointConfig, ExchangeConfig, StoreConfig, TimeoutConfig
from baft.plan.types import CheckpointPolicy
from baft.train.config import TrainConfig
from tests.dist.runs import run_job, tiny_config

pytestmark = pytest.mark.timeout(420)


def _config(
    out: Path, store: Path | None, inject: list[str], *, emulated: bool, **ck: Any
) -> TrainConfig:
    cfg = tiny_config(
        out, iterations=10, batch=8, num_dp=1, num_pp=2, num_microbatches=2, ranks_per_node=1
    )
    if emulated:  # accelerator semantics: the copy thread path (ThreadCopy)
        cfg = dataclasses.replace(
            cfg, compute="emulated", emulated_times={"fwd": [0.004, 0.004], "bwd": [0.008, 0.008]}
        )
    if store is not None:
        cfg.checkpoint = CheckpointConfig(
            # full snapshots: the byte accounting below is per whole shard (auto's k
            # follows the measured bubbles)
            policy=CheckpointPolicy(redundancy="xor:2", persist_every=0, full_every=1),
            profile_iters=2,
            **ck,
            store=StoreConfig(root=str(store)),
            timeouts=TimeoutConfig(collective_s=30.0),
        )
        cfg.inject = inject
        cfg.max_restarts = 3
    return cfg


@pytest.fixture
def store(tmp_path: Path):
    path = Path("/dev/shm") / f"baft-lean-{tmp_path.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert [m["loss"] for m in got["metrics"]] == [m["loss"] for m in ref["metrics"]]
    assert got["summary"]["rank_digests"] == ref["summary"]["rank_digests"]
    assert got["summary"]["final_state_digest"] == ref["summary"]["final_state_digest"]


def _checkpointed(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["bytes"] for m in metrics if m["bytes"]["snapshot"]]


@pytest.mark.slow  # default tier: every smoke cell exchanges through same-host memory; unit test_exchange_paths
@pytest.mark.parametrize("emulated", [False, True], ids=["real", "emulated"])
def test_kill_mid_same_host_exchange_and_node_loss_recover_bit_exactly(
    tmp_path: Path, store: Path, emulated: bool
) -> None:
    ref = run_job(_config(tmp_path / "ref", None, [], emulated=emulated))
    inject = ["kill:rank=1,iter=4,at=transfer", "node:0,iter=7"]
    got = run_job(_config(tmp_path / "got", store, inject, emulated=emulated))
    _same(got, ref)
    first, second = got["summary"]["recoveries"]
    assert first["source"] == "memory" and first["lost_iterations"] <= 1, first
    assert first["sources"] == {"0": "local", "1": "local"}, first
    assert second["source"] == "memory" and second["sources"] == {"0": "parity", "1": "local"}
    # every checkpoint's redundancy came through the stores: pulled, nothing on the network
    for b in _checkpointed(got["metrics"]):
        assert b["pull"] > 0 and b["recv"] == 0 and b["send"] == 0, b


@pytest.mark.slow
def test_network_exchange_gives_the_same_training(tmp_path: Path, store: Path) -> None:
    ref = run_job(_config(tmp_path / "ref", None, [], emulated=False))
    got = run_job(
        _config(
            tmp_path / "net",
            store,
            ["node:1,iter=6"],
            emulated=False,
            exchange=ExchangeConfig(paths="network"),
        )
    )
    _same(got, ref)
    (r,) = got["summary"]["recoveries"]
    assert r["source"] == "memory" and r["sources"] == {"0": "local", "1": "parity"}, r
    for b in _checkpointed(got["metrics"]):
        assert b["pull"] == 0 and b["recv"] > 0 and b["send"] == b["snapshot"], b
