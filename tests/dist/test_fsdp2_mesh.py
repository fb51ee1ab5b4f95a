"""torchtitan's mesh dims and FSDP2 stages in ``baft.protect`` (4 gloo ranks, issue 30).

1. :func:`baft.pipeline.mesh.mesh_from_user` folds ``dp_shard`` x ``cp`` x ``tp`` into
   baft's shard axis and takes ``dp_replicate`` (or ``dp``) as the replicas, for any
   subset of the names in any order whose ranks are numbered pp-major; it refuses
   unknown names, ``cp`` > 1, ``dp`` beside ``dp_replicate`` and meshes numbered another
   way, with a message.
2. ``protect`` accepts FSDP2 stages sharded over ``dp_shard`` (mesh given or found from
   the DTensor parameters), knows that HSDP averages its own gradients, and refuses CPU
   offload and shards along dim 1 before anything is hooked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(240)


def _error(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return type(e).__name__, str(e)


def _view(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from baft.pipeline.mesh import mesh_from_user

    def go() -> Any:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        view, own = mesh_from_user(mesh, 0, torch.device("cpu"))
        t = view.topology
        c = view.coords
        return (t.num_pp, t.num_dp, t.num_tp), (c.pp, c.dp, c.tp), own is not None

    return _error(go)


def _meshes(rank: int, world: int) -> dict[str, Any]:
    return {
        "pp_shard": _view((2, 2), ("pp", "dp_shard")),
        "hsdp": _view((1, 2, 2), ("pp", "dp_replicate", "dp_shard")),
        "shard_tp": _view((2, 2), ("dp_shard", "tp")),
        "cp_one": _view((2, 1, 2), ("pp", "cp", "dp_shard")),
        "legacy": _view((2, 2, 1), ("pp", "dp", "tp")),
        "names_reordered": _view((2, 2), ("dp_shard", "pp")),
        "cp": _view((2, 2), ("pp", "cp")),
        "unknown": _view((2, 2), ("pp", "ep")),
        "both_dp": _view((2, 2), ("dp", "dp_replicate")),
        "both_shard": _view((2, 2), ("dp_shard", "fsdp")),
        "fsdp_name": _view((2, 2), ("pp", "fsdp")),
    }


def test_mesh_dims_map_onto_replicas_and_shards(gloo) -> None:
    got = gloo.run(_meshes, 4, timeout_s=200)
    for rank, out in enumerate(got):
        assert out["pp_shard"] == ((2, 1, 2), (rank // 2, 0, rank % 2), True)
        assert out["hsdp"] == ((1, 2, 2), (0, rank // 2, rank % 2), True)
        assert out["shard_tp"] == ((1, 1, 4), (0, 0, rank), True)  # one shard axis
        assert out["cp_one"] == ((2, 1, 2), (rank // 2, 0, rank % 2), True)
        assert out["legacy"] == ((2, 2, 1), (rank // 2, rank % 2, 0), False)
        kind, msg = out["names_reordered"]
        assert kind == "ValueError" and "numbered pp-major" in msg and "[[0, 1], [2, 3]]" in msg
        assert out["cp"] == (
            "ValueError",
            "context parallel (device_mesh dim 'cp' of size 2) is not supported: its ranks "
            "hold pieces of the activations baft does not checkpoint",
        )
        kind, msg = out["unknown"]
        assert kind == "ValueError" and msg.startswith("device_mesh dim(s) ['ep'] unknown")
        assert out["both_dp"] == (
            "ValueError",
            "device_mesh has both 'dp' and 'dp_replicate': they name the same dim",
        )
        assert out["both_shard"] == (
            "ValueError",
            "device_mesh has both 'dp_shard' and 'fsdp': they name the same dim",
        )
        assert out["fsdp_name"] == ((2, 1, 2), (rank // 2, 0, rank % 2), True)


def _protect(
    module: nn.Module, mesh: Any, root: str, name: str, given: bool = True, elastic: int = 0
) -> Any:
    """protect() on a one-stage pipeline over ``mesh["pp"]``, with ``device_mesh=mesh``
    when ``given``: (error or None, optimizer hooked, Protected)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import baft

    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.square().mean())
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ck = baft.CheckpointConfig(
        policy=baft.CheckpointPolicy(redundancy="none", persist_every=0),
        store=baft.StoreConfig(root=str(Path(root) / "shm")),
        elastic=baft.ElasticConfig(num_replicas=elastic),
    )
    ft = None

    def go() -> None:
        nonlocal ft
        ft = baft.protect(
            schedule=schedule, stages=[stage], optimizer=opt, run_dir=str(Path(root) / name),
            device_mesh=mesh if given else None, checkpoint=ck,
        )  # fmt: skip

    err = _error(go)
    return err, bool(opt._optimizer_step_pre_hooks), ft


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 7))


def _stages(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import Shard

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "dp_shard"))

    m = _model()
    fully_shard(m, mesh=mesh["dp_shard"])
    err, hooked, ft = _protect(m, mesh, root, "fsdp")
    t = ft.mesh.topology
    out["fsdp"] = (err, hooked, (t.num_pp, t.num_dp, t.num_tp), ft.mesh.coords.tp)
    out["fsdp_layout"] = [
        (i.name, i.global_shape, i.placements, i.shape, i.offset)
        for i in ft.state.layout()
        if i.name.startswith("model.2.")
    ]
    ft.close()

    m = _model()
    fully_shard(m, mesh=mesh["dp_shard"])
    err, hooked, ft = _protect(m, mesh, root, "found", given=False)  # from the DTensors
    t = ft.mesh.topology
    out["found"] = (err, hooked, (t.num_pp, t.num_dp, t.num_tp))
    ft.close()

    names = ("pp", "dp_replicate", "dp_shard")
    hsdp_mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=names)
    m = _model()
    fully_shard(m, mesh=hsdp_mesh["dp_replicate", "dp_shard"])
    err, hooked, ft = _protect(m, hsdp_mesh, root, "hsdp")
    t = ft.mesh.topology
    out["hsdp"] = (err, hooked, (t.num_pp, t.num_dp, t.num_tp), ft.runner.averaged_by)
    ft.close()

    m = _model()
    fully_shard(m, mesh=mesh["dp_shard"], offload_policy=CPUOffloadPolicy(pin_memory=False))
    groups = len(dist.distributed_c10d._world.pg_map)
    out["offload"] = _protect(m, mesh, root, "offload")[:2]
    # the refusal ended the groups of the mesh baft made for the user's (pp, dp_shard) one
    out["groups_left"] = len(dist.distributed_c10d._world.pg_map) - groups

    m = _model()
    fully_shard(m, mesh=mesh["dp_shard"], shard_placement_fn=lambda p: Shard(p.dim() - 1))
    out["dim1"] = _protect(m, mesh, root, "dim1")[:2]

    m = _model()
    fully_shard(m, mesh=mesh["dp_shard"])
    out["elastic"] = _protect(m, mesh, root, "elastic", elastic=2)[:2]
    return out


def test_fsdp2_stages_are_protected_and_what_baft_cannot_restore_is_refused(
    gloo, tmp_path: Path
) -> None:
    got = gloo.run(_stages, 4, args=(str(tmp_path),), timeout_s=200)
    for rank, out in enumerate(got):
        assert out["fsdp"] == (None, True, (1, 1, 4), rank)
        n, start = ((2, 0), (2, 2), (2, 4), (1, 6))[rank]  # 7 rows over 4 ranks: 2,2,2,1
        assert out["fsdp_layout"] == [
            ("model.2.weight", (7, 8), "dp_shard:Shard(dim=0)", (n, 8), (start, 0)),
            ("model.2.bias", (7,), "dp_shard:Shard(dim=0)", (n,), (start,)),
        ], rank
        assert out["found"] == (None, True, (1, 1, 4))
        assert out["hsdp"] == (None, True, (1, 2, 2), "FSDP2")
        err, hooked = out["offload"]
        assert out["groups_left"] == 0
        assert not hooked and err[0] == "ValueError" and "CPUOffloadPolicy" in err[1]
        err, hooked = out["dim1"]
        assert not hooked and err[0] == "ValueError"
        assert "0.weight is sharded along dim 1" in err[1] and "Shard(0) only" in err[1]
        err, hooked = out["elastic"]  # elastic replicas: FSDP2's shards move with dp
        assert not hooked and err[0] == "ValueError" and "FSDP2 (dp_shard or HSDP)" in err[1]
