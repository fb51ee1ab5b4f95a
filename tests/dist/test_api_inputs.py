"""Bad input to ``baft.protect`` fails at once with the exact message, on every rank.

One 2-rank gloo job walks every mistake in turn (the processes start once): wrong mesh
dim names, an optimizer baft cannot checkpoint (LBFGS), ``step()`` before ``restore()``, a second
``restore()``, and a memory budget the stores cannot fit (refused at ``restore()`` before
the first step, every rank with the same error, not one rank blocked in a collective).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(180)

BUDGET_TAIL = (
    "but budget_bytes is 400,000 B; raise the host-memory budget, pick a lighter "
    "redundancy policy, or add DP replicas so shards shrink"
)


def _stage(rank: int, world: int) -> tuple[Any, Any, nn.Module]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(rank)
    width = 16 if rank == 0 else 1024  # the last stage's state is ~25x the first's
    module = nn.Sequential(nn.Linear(16, width), nn.GELU())
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.square().mean())
    return stage, schedule, module


def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return type(e).__name__, str(e)
    return None


def _bad_inputs(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import baft

    out: dict[str, Any] = {}
    stage, schedule, module = _stage(rank, world)
    adamw = torch.optim.AdamW(module.parameters(), lr=1e-3)
    run = str(Path(root) / "run")
    ck = baft.CheckpointConfig(policy=baft.CheckpointPolicy(persist_every=0), store=baft.StoreConfig(root=str(Path(root) / "shm")))

    bad_mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("pp", "dp", "x"))
    out["mesh"] = _error(
        lambda: baft.protect(
            schedule=schedule, stages=[stage], optimizer=adamw, run_dir=run, device_mesh=bad_mesh
        )
    )
    lbfgs = torch.optim.LBFGS(module.parameters(), lr=1e-3)
    out["optimizer"] = _error(
        lambda: baft.protect(schedule=schedule, stages=[stage], optimizer=lbfgs, run_dir=run)
    )
    ft = baft.protect(
        schedule=schedule,
        stages=[stage],
        optimizer=adamw,
        run_dir=run,
        checkpoint=ck,
        ranks_per_node=1,
    )
    # the caller's config is left as given (protect() fills a copy: job id, persist dir)
    out["config_untouched"] = (ck.store.job_id, ck.persist.dir) == ("", "") and (
        ft.checkpoint.store.job_id != "" and ft.checkpoint.persist.dir.endswith("checkpoints")
    )
    x = torch.randn(4, 16)
    before = [p.detach().clone() for p in module.parameters()]
    out["step_first"] = _error(lambda: ft.step(0, x if rank == 0 else None, x))
    # nothing ran: the rejected step did not train unprotected
    # the user's own loop before restore(): schedule.step and optimizer.step refuse too
    out["loop_first"] = _error(lambda: schedule.step(x) if rank == 0 else schedule.step(target=x))
    out["optimizer_first"] = _error(adamw.step)
    out["untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True)
    )
    out["twice"] = _error(
        lambda: baft.protect(
            schedule=schedule,
            stages=[stage],
            optimizer=adamw,
            run_dir=run,
            checkpoint=ck,
            ranks_per_node=1,
        )
    )
    ft.close()  # the schedule and optimizer are the user's again
    out["unwrapped"] = "step" not in vars(schedule) and not adamw._optimizer_step_pre_hooks

    # a budget only rank 0's store fits: both ranks are refused before the first step with
    # rank 1's numbers; rank 0 must not train on into a collective
    tight = baft.CheckpointConfig(policy=baft.CheckpointPolicy(redundancy="none", persist_every=0), profile_iters=1, cost={"copy_Bps": 1e9}, store=baft.StoreConfig(root=str(Path(root) / "shm"), budget_bytes=400_000))
    ft2 = baft.protect(
        schedule=schedule,
        stages=[stage],
        optimizer=adamw,
        run_dir=str(Path(root) / "tight"),
        checkpoint=tight,
        ranks_per_node=1,
    )
    out["budget"] = _error(ft2.restore)
    out["restore_twice"] = _error(ft2.restore)
    out["step_after"] = _error(lambda: ft2.step(0, x if rank == 0 else None, x))
    return out


def test_protect_rejects_bad_input_on_every_rank(gloo, tmp_path: Path) -> None:
    got = gloo.run(_bad_inputs, 2, args=(str(tmp_path),), timeout_s=120)
    for rank, out in enumerate(got):
        assert out["mesh"] == (
            "ValueError",
            "device_mesh dim(s) ['x'] unknown: baft understands pp, dp_replicate, dp, "
            "dp_shard, fsdp, cp, tp (torchtitan's names; 'dp' is another name for "
            "dp_replicate: replicas)",
        ), rank
        assert out["optimizer"] == (
            "ValueError",
            "baft checkpoints the state of SGD, Adam, AdamW, Adagrad, RMSprop (torch.optim, "
            "per-tensor steps); got torch.optim.lbfgs.LBFGS",
        )
        assert out["step_first"] == (
            "RuntimeError",
            "step() before restore(): call start = ft.restore() first (it opens the snapshot "
            "stores and returns the iteration to resume from); without it nothing would be "
            "checkpointed",
        )
        assert out["loop_first"] == out["step_first"]
        assert out["optimizer_first"] == out["step_first"]
        assert out["untouched"] is True
        assert out["config_untouched"] is True
        assert out["twice"] == (
            "ValueError",
            "this optimizer is already protected by an earlier baft.protect(): call that "
            "one's close() first",
        )
        assert out["unwrapped"] is True
        assert out["restore_twice"] == (
            "RuntimeError",
            "restore() was already called: call it once, before the first step()",
        )
        kind, message = out["budget"]
        assert kind == "MemoryBudgetError"
        # refused at restore(), before the first step, every rank with rank 1's numbers
        assert message.startswith(
            "the snapshot stores cannot fit this host's memory: rank 1 needs at least "
        ), message
        assert "but the store budget is 400,000 B (StoreConfig.budget_bytes)" in message
        # the loop after it raises, naming why (it would train unprotected)
        assert out["step_after"] == (
            "RuntimeError", f"restore() failed (MemoryBudgetError: {message}); nothing is "
            "checkpointed, so the loop must not go on: fix the cause and launch again",
        )  # fmt: skip
    assert got[0]["budget"] == got[1]["budget"]


def test_protect_without_a_process_group_says_how_to_start_one(tmp_path: Path) -> None:
    import torch.distributed as dist

    import baft

    assert not dist.is_initialized()
    module = nn.Linear(4, 4)
    with pytest.raises(ValueError) as err:
        baft.protect(
            schedule=None,
            stages=[],
            optimizer=torch.optim.AdamW(module.parameters()),
            run_dir=str(tmp_path),
        )
    assert str(err.value) == "initialise torch.distributed first (torchrun + init_process_group)"
