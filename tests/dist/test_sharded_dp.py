"""Shards are not replicas: ``baft.protect`` refuses them before the first step, and a
restore checks every shard's identity before it writes a byte (2 gloo ranks).

1. Stages ``fully_shard``-ed over the mesh dim baft calls ``dp`` (replicas), or DTensor
   parameters placed ``Shard(0)`` over it, are refused with a message naming the tensor,
   the dim and the fix (name the dim ``dp_shard``: tests/dist/test_fsdp2_mesh.py); the
   optimizer is left unhooked. Replicated DTensors pass, and their layout
   records their placements.
2. DP ranks whose tensors differ in shape but not in bytes are not replicas either (the
   byte count matched; the layout digest does not): refused, naming the first tensor.
3. A restore (from memory, and from DCP) into a state whose layout changed without its
   byte count (a buffer's dtype) raises ShardIdentityError before writing: the live
   parameters stay as they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(180)


def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return type(e).__name__, str(e)
    return None


def _one_stage(module: nn.Module, mesh: Any) -> tuple[Any, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.square().mean())
    return stage, schedule


def _protect_dp(module: nn.Module, mesh: Any, root: str) -> Any:
    import baft

    stage, schedule = _one_stage(module, mesh)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ft = None
    # never restored: no engine is built, the policy only has to be valid
    ck = baft.CheckpointConfig(policy=baft.CheckpointPolicy(redundancy="none", persist_every=0), store=baft.StoreConfig(root=str(Path(root) / "shm")))

    def go() -> None:
        nonlocal ft
        ft = baft.protect(
            schedule=schedule, stages=[stage], optimizer=opt, run_dir=str(Path(root) / "run"),
            device_mesh=mesh, checkpoint=ck,
        )  # fmt: skip

    err = _error(go)
    hooked = bool(opt._optimizer_step_pre_hooks) or "step" in vars(schedule)
    return err, hooked, ft


def _refusals(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))

    torch.manual_seed(0)
    fsdp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    fully_shard(fsdp, mesh=mesh["dp"])
    out["fsdp"] = _protect_dp(fsdp, mesh, root)[:2]

    def placed(placement: Any) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8))
        for name, p in list(m[0].named_parameters()):
            dt = distribute_tensor(p.detach(), mesh["dp"], [placement])
            setattr(m[0], name, nn.Parameter(dt))
        return m

    out["shard"] = _protect_dp(placed(Shard(0)), mesh, root)[:2]
    err, hooked, ft = _protect_dp(placed(Replicate()), mesh, root)
    out["replicate"] = (err, hooked)
    out["replicate_layout"] = [
        (i.name, i.global_shape, i.placements, i.shape, i.offset)
        for i in ft.state.layout()
        if i.name.startswith(("model.", "optim."))
    ]
    ft.close()

    # same bytes, other shapes on the two DP ranks: not replicas
    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(8, 4, bias=False) if rank == 0 else nn.Linear(4, 8, bias=False))
    out["shapes"] = _protect_dp(odd, mesh, root)[:2]
    return out


def test_sharded_dp_is_refused_before_the_first_step(gloo, tmp_path: Path) -> None:
    got = gloo.run(_refusals, 2, args=(str(tmp_path),), timeout_s=120)
    help_ = (
        "baft treats the mesh dim 'dp_replicate' (or 'dp') as replicas (identical bytes on "
        "every rank along it); shard over a dim named 'dp_shard' instead (fully_shard(mesh="
        "mesh['dp_shard']), or mesh['dp_replicate', 'dp_shard'] for HSDP) and pass that mesh "
        "as baft.protect(device_mesh=...)"
    )
    for rank, out in enumerate(got):
        assert out["fsdp"] == (
            (
                "ValueError",
                "stage module 0 (FSDPSequential): <stage module> is fully_shard-ed over "
                "mesh dim 'dp', which spans ranks [0, 1] that baft's device_mesh calls "
                f"'dp'; {help_}",
            ),
            False,
        )
        assert out["shard"] == (
            (
                "ValueError",
                "parameter 0.weight is a DTensor sharded over mesh dim 'dp' (Shard(dim=0)), "
                f"which spans ranks [0, 1] that baft's device_mesh calls 'dp'; {help_}",
            ),
            False,
        )
        assert out["replicate"] == (None, True)
        assert out["replicate_layout"] == [
            ("model.0.weight", (8, 8), "dp:Replicate()", (8, 8), (0, 0)),
            ("model.0.bias", (8,), "dp:Replicate()", (8,), (0,)),
            ("optim.0.weight.exp_avg", (8, 8), "dp:Replicate()", (8, 8), (0, 0)),
            ("optim.0.weight.exp_avg_sq", (8, 8), "dp:Replicate()", (8, 8), (0, 0)),
            ("optim.0.weight.step", (), "", (), ()),
            ("optim.0.bias.exp_avg", (8,), "dp:Replicate()", (8,), (0,)),
            ("optim.0.bias.exp_avg_sq", (8,), "dp:Replicate()", (8,), (0,)),
            ("optim.0.bias.step", (), "", (), ()),
        ], rank
        assert out["shapes"] == (
            (
                "ValueError",
                "DP ranks dp0 and dp1 of pp0.tp0 are not replicas: model.0.weight: "
                "global_shape (4, 8) vs (8, 4), shape (4, 8) vs (8, 4). " + help_,
            ),
            False,
        )


def _two_stages(rank: int, world: int, mark_dtype: torch.dtype) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(10 + rank)
    module = nn.Sequential(nn.Linear(8, 8))
    module.register_buffer("mark", torch.zeros(4, dtype=mark_dtype))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.square().mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    return {"module": module, "stage": stage, "schedule": schedule, "opt": opt}


def _protect_pp(s: dict[str, Any], root: str, where: str, shm: str) -> Any:
    import baft

    ck = baft.CheckpointConfig(
        policy=baft.CheckpointPolicy(
            redundancy="replicate:1", persist_every=1 if where == "disk" else 0
        ),
        profile_iters=1,
        cost={"copy_Bps": 1e9},
        # keep_on_close: continue the finished loop from memory
        store=baft.StoreConfig(
            root=str(Path(root) / shm), job_id=f"identity-{where}", keep_on_close=True
        ),
    )
    return baft.protect(
        schedule=s["schedule"], stages=[s["stage"]], optimizer=s["opt"],
        run_dir=str(Path(root) / where), checkpoint=ck, ranks_per_node=1,
    )  # fmt: skip


def _identity(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for where, shm in (("memory", "shm"), ("disk", "empty-shm")):  # DCP: no store at all
        s = _two_stages(rank, world, torch.float32)
        ft = _protect_pp(s, root, where, "shm")
        ft.restore()
        for it in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
            s["opt"].zero_grad()
            s["schedule"].step(x) if rank == 0 else s["schedule"].step(target=x)
            s["opt"].step()
        ft.close()
        s2 = _two_stages(rank, world, torch.int32)  # the same bytes, another dtype
        before = [p.detach().clone() for p in s2["module"].parameters()]
        ft2 = _protect_pp(s2, root, where, shm)
        out[where] = _error(ft2.restore)
        out[f"{where}_untouched"] = all(
            torch.equal(a, b) for a, b in zip(before, s2["module"].parameters(), strict=True)
        )
        ft2.close()
    return out


def test_a_restore_checks_shard_identity_before_writing(gloo, tmp_path: Path) -> None:
    got = gloo.run(_identity, 2, args=(str(tmp_path),), timeout_s=150)
    tail = (
        "names, dtypes, global or local shapes, placements or offsets differ; nothing was "
        "restored. Restore with the model, optimizer and device_mesh the checkpoint was "
        "saved with, or start a new run (another run_dir / job_id)"
    )
    for rank, out in enumerate(got):
        for where in ("memory", "disk"):
            kind, text = out[where]
            assert kind == "ShardIdentityError", (rank, where, out[where])
            assert text.endswith(tail), text
            assert f"was saved from other tensors than pp{rank}.tp0's live state" in text
            assert out[f"{where}_untouched"], (rank, where)
        assert out["memory"][1].startswith("the v3 shard of rank "), out["memory"]
        assert out["disk"][1].startswith("DCP checkpoint v"), out["disk"]
