"""Elastic replicas with tensor parallelism: DTensor parameters, TP degree fixed.

A one-stage job with ``tp=2`` (a column-parallel then a row-parallel ``nn.Linear``,
dropout on the local shard) and ``ElasticConfig(num_replicas=2)`` runs on 4 ranks (dp=2:
each TP pair one replica) and on 2 ranks (dp=1: the TP pair computes both replicas).
Both are bit-identical at every iteration to each other and to the same loop without
baft on 4 ranks (each TP rank all-reducing its local gradient shards over its DP group).
A job that shrinks from 4 to 2 ranks restores every TP rank's shards from memory and
stays on that trajectory. FSDP2 (``dp_shard``) is still refused, by name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.dist.test_elastic_replicas import Loader

pytestmark = pytest.mark.timeout(300)
ITERATIONS = 6
REPLICAS = 2


def _digest(module: nn.Module) -> str:
    from baft.pipeline.encoding import local

    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(local(t).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _build(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1, world // 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(3)  # the same weights on every replica, and each replica's RNG
    module = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 6))
    parallelize_module(module, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(
        stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
    )
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    return {"mesh": mesh, "module": module, "schedule": schedule, "opt": opt, "stage": stage}


def _run(rank: int, world: int, root: str, stop_at: int, keep: bool) -> Any:
    import baft

    s = _build(world)
    loader = Loader()
    ck = baft.CheckpointConfig(
        policy=baft.CheckpointPolicy(redundancy="xor:2", persist_every=0, full_every=2),
        profile_iters=1,
        cost={"copy_Bps": 1e9},
        store=baft.StoreConfig(root=str(Path(root) / "shm"), job_id="tp", keep_on_close=keep),
        elastic=baft.ElasticConfig(num_replicas=REPLICAS),
    )
    ft = baft.protect(
        schedule=s["schedule"], stages=[s["stage"]], optimizer=s["opt"],
        run_dir=str(Path(root) / "run"), device_mesh=s["mesh"], checkpoint=ck,
        ranks_per_node=1, state={"loader": loader},
    )  # fmt: skip
    start = ft.restore()
    record = ft.recovery.record if ft.recovery is not None else {}
    out: dict[Any, Any] = {"start": start, "source": record.get("source", "fresh")}
    out["reason"] = record.get("reason")
    for it in range(start, stop_at):
        s["opt"].zero_grad()
        for r in ft.replicas():
            x, y = loader.batch(r)
            s["schedule"].step(x, target=y)
        torch.nn.utils.clip_grad_norm_(s["module"].parameters(), 1.0)
        s["opt"].step()
        out[it] = _digest(s["module"])
    ft.close()
    return out


def _plain(rank: int, world: int) -> dict[int, str]:
    """The same loop without baft: each TP pair its replica, an all-reduce average of
    every TP rank's local gradient shards over its DP group."""
    import torch.distributed as dist

    from baft.pipeline.encoding import local

    s = _build(world)
    loader = Loader()
    r = s["mesh"].get_local_rank("dp")
    out = {}
    for it in range(ITERATIONS):
        s["opt"].zero_grad()
        x, y = loader.batch(r)
        s["schedule"].step(x, target=y)
        for p in s["module"].parameters():
            g = local(p.grad)
            dist.all_reduce(g, group=s["mesh"].get_group("dp"))
            g.div_(REPLICAS)
        torch.nn.utils.clip_grad_norm_(s["module"].parameters(), 1.0)
        s["opt"].step()
        out[it] = _digest(s["module"])
    return out


def test_tp_ranks_computing_both_replicas_are_bit_identical_and_shrink_from_memory(
    gloo, tmp_path: Path
) -> None:
    plain = gloo.run(_plain, 4, timeout_s=120)
    four = gloo.run(_run, 4, args=(str(tmp_path / "a"), ITERATIONS, False), timeout_s=240)
    root = str(tmp_path / "job")
    gloo.run(_run, 4, args=(root, 4, True), timeout_s=240)
    shrunk = gloo.run(_run, 2, args=(root, ITERATIONS, False), timeout_s=240)
    for it in range(ITERATIONS):
        for tp in range(2):  # ranks (dp, tp): 4 ranks -> dp*2 + tp
            assert four[tp][it] == four[2 + tp][it] == plain[tp][it], (it, tp)
    assert four[0][0] != four[1][0]  # each TP rank its own shards
    assert shrunk[0]["source"] == "memory" and shrunk[0]["start"] >= 2, shrunk[0]
    assert "rebuilt for dp=1" in shrunk[0]["reason"], shrunk[0]
    for it in range(shrunk[0]["start"], ITERATIONS):
        assert [shrunk[tp][it] for tp in range(2)] == [four[tp][it] for tp in range(2)], it
