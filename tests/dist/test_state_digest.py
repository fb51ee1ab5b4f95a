"""The final-state digest covers every rank and refuses DP replicas that differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)


def _digests(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch

    from baft.train.config import ParallelConfig
    from baft.pipeline.mesh import init_mesh
    from baft.train.trainer import Trainer
    from tests.dist.runs import tiny_config

    cfg = tiny_config(Path(out), num_dp=2, num_pp=1, num_microbatches=1)
    mesh = init_mesh(ParallelConfig(num_dp=2, num_pp=1, num_microbatches=1))
    trainer = Trainer(cfg, mesh)
    trainer.run_step(0)
    result: dict[str, Any] = {
        "same": trainer.rank_digests(),
        "names": len(trainer.state_digests()),
    }
    if rank == 1:  # a replica restored wrongly: one value of one exp_avg differs
        state = trainer.optimizer.state[trainer.params[3]]
        state["exp_avg"].view(-1)[0] += torch.tensor(1e-3)
    try:
        trainer.rank_digests()
        result["error"] = None
    except RuntimeError as e:
        result["error"] = str(e)
    return result


def test_every_rank_is_digested_and_differing_replicas_raise(gloo, tmp_path: Path) -> None:
    got = gloo.run(_digests, 2, args=(str(tmp_path),), timeout_s=90)
    same = got[0]["same"]
    assert same == got[1]["same"]
    assert sorted(same) == ["dp0.pp0.tp0", "dp1.pp0.tp0"]
    assert same["dp0.pp0.tp0"] == same["dp1.pp0.tp0"]  # identical replicas, identical digests
    assert got[0]["names"] > 3
    for out in got:
        assert out["error"] is not None
        assert out["error"].startswith(
            "DP replicas dp0 and dp1 of pp0.tp0 hold different state: optim."
        ), out["error"]
        assert out["error"].endswith(".exp_avg"), out["error"]
