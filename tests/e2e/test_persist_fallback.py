"""Durable checkpoints: baft's DCP output loads with plain DCP, and a power loss (every
snapshot store gone) falls back to it and still ends bit-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from baft.config import CheckpointConfig, StoreConfig, TimeoutConfig
from baft.model.gpt import GPTStage
from baft.plan.types import CheckpointPolicy
from baft.store.disk import latest_version, version_dir
from baft.store.keys import torch_name
from tests.dist.runs import TINY_MODEL, run_job, tiny_config

pytestmark = pytest.mark.timeout(420)


def _config(out: Path, store: Path, inject: list[str], persist_every: int):
    cfg = tiny_config(out, iterations=10, batch=8, num_dp=2, num_pp=2, num_microbatches=2)
    cfg.checkpoint = CheckpointConfig(
        # full snapshots: the store's bytes are then the flat state that _snapshot_tensors
        # reads (auto picked full_every=3 on a loaded machine once: a payload layout)
        policy=CheckpointPolicy(
            redundancy="xor:2", persist_every=persist_every, keep_latest=2, full_every=1
        ),
        profile_iters=2,
        # the test compares the persisted bytes with the stores' after the job ended
        store=StoreConfig(root=str(store), keep_on_close=True),
        timeouts=TimeoutConfig(collective_s=30.0),
    )
    cfg.inject = inject
    return cfg


def _snapshot_tensors(store_job: Path, plan_input: dict, rank: int, node: int) -> dict[str, bytes]:
    """Whole tensors of one rank's committed shard, read straight from its store files."""
    d = store_job / f"node{node}" / f"rank{rank}"
    slot = json.loads((d / "commit.json").read_text())["slot"]
    manifest = json.loads((d / f"slot{slot}.json").read_text())
    data = (d / f"slot{slot}.data").read_bytes()
    out, pos = {}, 0
    for name, nbytes in plan_input["ranks"][rank]["layout"]["tensors"]:
        if manifest["owned_start"] <= pos and pos + nbytes <= manifest["owned_stop"]:
            lo = pos - manifest["owned_start"]
            out[name] = data[lo : lo + nbytes]
        pos += nbytes
    return out


def _plain_dcp_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """What an independent user does: a fresh full model (+ AdamW-shaped state), dcp.load."""
    model = GPTStage(TINY_MODEL, 0, TINY_MODEL.num_layers, has_embed=True, has_head=True)
    state: dict[str, torch.Tensor] = dict(model.state_dict())
    for fqn, p in model.named_parameters():
        state[f"optimizer.state.{fqn}.exp_avg"] = torch.zeros_like(p)
        state[f"optimizer.state.{fqn}.exp_avg_sq"] = torch.zeros_like(p)
        state[f"optimizer.state.{fqn}.step"] = torch.zeros((), dtype=torch.float32)
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


@pytest.mark.slow  # default tier: the smoke power cell, dist test_persister and test_persist_stages
def test_dcp_is_plain_loadable_and_power_loss_falls_back_to_it(tmp_path: Path) -> None:
    store = Path("/dev/shm") / f"baft-test-{tmp_path.name}"
    try:
        ref = run_job(_config(tmp_path / "ref", store, [], persist_every=1))
        ref_cfg = json.loads((tmp_path / "ref" / "config.json").read_text())
        ckdir = Path(ref_cfg["checkpoint"]["persist"]["dir"])
        job = store / ref_cfg["checkpoint"]["store"]["job_id"]
        plan_input = json.loads((tmp_path / "ref" / "plan_input.json").read_text())
        for r in plan_input["ranks"]:  # profiled iterations carry their length (stretch needs it)
            bmap = r["bubbles"]
            assert bmap["iteration_s"] > sum(x["idle_s"] for x in bmap["slots"]) > 0.0
        assert latest_version(ckdir) == 9  # the last committed version, persisted at close
        loaded = _plain_dcp_state(version_dir(ckdir, 9))
        compared = 0
        for rank in range(4):
            for name, raw in _snapshot_tensors(job, plan_input, rank, rank // 2).items():
                if name.startswith("extra."):
                    continue
                key = torch_name(name)
                got = loaded[key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                assert got == raw, name
                compared += 1
        # every model and optimizer tensor of both stages was compared exactly once per stage
        num_params = len(
            list(GPTStage(TINY_MODEL, 0, 4, has_embed=True, has_head=True).parameters())
        )
        assert compared == 4 * num_params

        failed = run_job(_config(tmp_path / "power", store, ["power:iter=7"], persist_every=2))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    (rec,) = failed["summary"]["recoveries"]
    assert rec["source"] == "disk"
    assert "from disk" in rec["reason"]
    assert rec["restored_version"] < 7 and rec["lost_iterations"] == 7 - rec["restored_version"]
    assert [m["loss"] for m in failed["metrics"]] == [m["loss"] for m in ref["metrics"]]
    assert failed["summary"]["final_state_digest"] == ref["summary"]["final_state_digest"]
