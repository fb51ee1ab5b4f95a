"""``restore()`` in a user's own loop, over real gloo ranks in one job (processes start once).

1. A 2-stage pipeline trains 3 iterations of the plain loop (zero_grad, schedule.step,
   clipping, optimizer.step, scheduler.step) under ``baft.protect`` with an LR scheduler
   and a sampler registered in ``state=``; every version's state is recorded.
2. Restarting with something that does not match fails on every rank with an error
   naming it before any byte is written (the parameters and small state stay): a
   changed model, a different optimizer (Adam for AdamW: the same tensors), a missing
   ``state`` key.
3. The unchanged setup restores the newest committed version: parameters, buffers,
   optimizer state, hyperparameters, scheduler, sampler and RNG equal what they were at
   the top of that iteration.
4. With differential checkpoints (``full_every=2``) the restore replays a recorded step
   (hooks standing aside) and lands on the same bytes.
5. ``ft.step`` and the plain loop are one trajectory (same bytes, same losses).
6. With DP replicas the step refuses un-averaged gradients and says what to do;
   ``ft.average_gradients()`` makes the replicas step identically.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(240)


class Sampler:
    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> int:
        self.position += 1
        return self.position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def _digest(module: nn.Module, opt: torch.optim.Optimizer, sched: Any, sampler: Sampler) -> str:
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode() + v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in sorted(st.items()):
            h.update(
                f"{i}.{k}".encode()
                + v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            )
    h.update(
        repr([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]).encode()
    )
    h.update(repr(sched.state_dict()).encode() + repr(sampler.state_dict()).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return type(e).__name__, str(e)
    return None


def _setup(
    rank: int, world: int, *, extra_layer: bool = False, adam: bool = False
) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(10 + rank)
    layers: list[nn.Module] = [nn.Linear(8, 8), nn.BatchNorm1d(8) if rank == 0 else nn.GELU()]
    if extra_layer:
        layers.append(nn.Linear(8, 8))
    module = nn.Sequential(*layers, nn.Dropout(0.2))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(
        stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
    )
    cls = torch.optim.Adam if adam else torch.optim.AdamW
    opt = cls(module.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return {
        "module": module,
        "stage": stage,
        "schedule": schedule,
        "opt": opt,
        "sched": sched,
        "sampler": Sampler(),
    }


def _protect(
    s: dict[str, Any],
    root: str,
    state: dict[str, Any] | None = None,
    full_every: int = 1,
    persist_every: int = 0,
    keep_stores: bool = True,
    writer: str = "thread",
) -> Any:
    import baft

    # the jobs here continue a finished loop from memory: keep the stores at close()
    ck = baft.CheckpointConfig(
        policy=baft.CheckpointPolicy(
            redundancy="replicate:1", persist_every=persist_every, full_every=full_every
        ),
        profile_iters=1,
        cost={"copy_Bps": 1e9},
        store=baft.StoreConfig(
            root=str(Path(root) / "shm"), job_id="restore-test", keep_on_close=keep_stores
        ),
        persist=baft.PersistConfig(writer=writer),
    )
    return baft.protect(
        schedule=s["schedule"],
        stages=[s["stage"]],
        optimizer=s["opt"],
        run_dir=str(Path(root) / "run"),
        checkpoint=ck,
        ranks_per_node=1,
        state=state if state is not None else {"lr": s["sched"], "sampler": s["sampler"]},
    )


def _iteration(s: dict[str, Any], rank: int) -> None:
    g = torch.Generator().manual_seed(s["sampler"].next_batch())
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    s["opt"].zero_grad()
    if rank == 0:
        s["schedule"].step(x)
    else:
        s["schedule"].step(target=y)
    nn.utils.clip_grad_norm_(s["module"].parameters(), 0.5)
    s["opt"].step()
    s["sched"].step()


def _restore_job(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s = _setup(rank, world)
    ft = _protect(s, root)
    out["start"] = ft.restore()
    versions = {}
    for it in range(4):
        versions[it] = _digest(s["module"], s["opt"], s["sched"], s["sampler"])
        _iteration(s, rank)
    ft.close()
    out["end_iteration"] = ft.iteration

    # a changed model: refused before a byte is written
    s2 = _setup(rank, world, extra_layer=True)
    before = [p.detach().clone() for p in s2["module"].parameters()]
    ft2 = _protect(s2, root)
    out["changed_model"] = _error(ft2.restore)
    out["changed_untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, s2["module"].parameters(), strict=True)
    )
    ft2.close()

    # a missing state key
    s3 = _setup(rank, world)
    ft3 = _protect(s3, root, state={"lr": s3["sched"]})
    out["missing_key"] = _error(ft3.restore)
    ft3.close()

    # a different optimizer (the same tensors): refused before a byte is written too
    s4 = _setup(rank, world, adam=True)
    sched_before = s4["sched"].state_dict()
    before = [p.detach().clone() for p in s4["module"].parameters()]
    ft4 = _protect(s4, root)
    out["other_optimizer"] = _error(ft4.restore)
    out["other_untouched"] = (
        s4["sched"].state_dict() == sched_before
        and s4["sampler"].position == 0
        and all(torch.equal(a, b) for a, b in zip(before, s4["module"].parameters(), strict=True))
    )
    ft4.close()

    # the same setup: the newest committed version, exactly as it was
    s5 = _setup(rank, world)
    ft5 = _protect(s5, root)
    start = ft5.restore()
    out["restored"] = start
    out["restored_equal"] = (
        _digest(s5["module"], s5["opt"], s5["sched"], s5["sampler"]) == versions[start]
    )
    _iteration(s5, rank)  # and it trains on from there
    out["iteration_after"] = ft5.iteration
    ft5.close()

    # differential checkpoints (full_every=2): the restore replays a recorded optimizer
    # step (with the scheduler's lr of that step) while the loop's hooks stand aside
    diff_root = str(Path(root) / "diff")
    s6 = _setup(rank, world)
    ft6 = _protect(s6, diff_root, full_every=2)
    ft6.restore()
    versions = {}
    for it in range(5):
        versions[it] = _digest(s6["module"], s6["opt"], s6["sched"], s6["sampler"])
        _iteration(s6, rank)
    out["diff_k"] = ft6.engine.k
    ft6.close()
    s7 = _setup(rank, world)
    ft7 = _protect(s7, diff_root, full_every=2)
    start = ft7.restore()
    out["diff_restored"] = start
    out["diff_replayed"] = ft7.recovery.record.get("replay", {})
    out["diff_equal"] = (
        _digest(s7["module"], s7["opt"], s7["sched"], s7["sampler"]) == versions[start]
    )
    ft7.close()
    return out


def test_restore_in_the_users_loop(gloo, tmp_path: Path) -> None:
    got = gloo.run(_restore_job, 2, args=(str(tmp_path),), timeout_s=180)
    for rank, out in enumerate(got):
        assert out["start"] == 0 and out["end_iteration"] == 4, out
        kind, message = out["changed_model"]
        assert kind == "ValueError", out
        assert message.startswith("the model/optimizer state differs from the saved one; "), message
        assert "new: model.2.bias, model.2.weight, optim.2.bias.exp_avg" in message, message
        assert "resized" not in message and "saved but absent" not in message, message
        assert out["changed_untouched"] is True
        assert out["missing_key"] == (
            "ValueError",
            "the model/optimizer state differs from the saved one; saved but absent now: "
            "extra.state.sampler",
        ), rank
        assert out["other_optimizer"] == (
            "ValueError",
            "the state was saved with optimizer AdamW, this run uses Adam",
        ), rank
        assert out["other_untouched"] is True
        assert out["restored"] == 3, out  # version 3 committed at close()
        assert out["restored_equal"] is True
        assert out["iteration_after"] == 4
        assert out["diff_k"] == 2, out
        assert out["diff_restored"] >= 3, out
        assert out["diff_equal"] is True, out
        assert out["diff_replayed"]["replayed_steps"] == 1, out


def _dp_job(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import baft

    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(0)  # identical replicas
    module = nn.Linear(4, 4)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(
        stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
    )
    opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def memory_only(job: str) -> baft.CheckpointConfig:  # no parity, no DCP: cheap
        policy = baft.CheckpointPolicy(redundancy="none", persist_every=0)
        return baft.CheckpointConfig(
            policy=policy, store=baft.StoreConfig(root=str(Path(root) / "shm"), job_id=job)
        )

    ft = baft.protect(
        schedule=schedule, stages=[stage], optimizer=opt, run_dir=str(Path(root) / "dp-avg"),
        device_mesh=mesh, ranks_per_node=1, checkpoint=memory_only("dp-avg"),
    )  # fmt: skip
    ft.restore()
    g = torch.Generator().manual_seed(rank)  # each replica its own data
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    before = [p.detach().clone() for p in module.parameters()]
    opt.zero_grad()
    schedule.step(x, target=y)
    out: dict[str, Any] = {"unaveraged": _error(opt.step)}
    out["untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True)
    )
    ft.average_gradients()
    opt.step()
    out["weight"] = module.weight.detach().numpy().tobytes()
    ft.close()
    # average_gradients=True: averaged in the step pre-hook, the loop unchanged
    ft = baft.protect(
        schedule=schedule, stages=[stage], optimizer=opt, run_dir=str(Path(root) / "dp-auto"),
        device_mesh=mesh, ranks_per_node=1, checkpoint=memory_only("dp-auto"),
        average_gradients=True,
    )  # fmt: skip
    ft.restore()
    opt.zero_grad()
    schedule.step(x, target=y)
    opt.step()
    out["auto_weight"] = module.weight.detach().numpy().tobytes()
    out["auto_moved"] = out["auto_weight"] != out["weight"]
    ft.close()
    # checkpoints on, RNG seeded per replica: restore() says the replicas differ
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("baft").addHandler(handler)
    ck = baft.CheckpointConfig(
        policy=baft.CheckpointPolicy(redundancy="none", persist_every=0),
        store=baft.StoreConfig(root=str(Path(root) / "shm"), job_id="dp-test"),
    )
    ft = baft.protect(
        schedule=schedule, stages=[stage], optimizer=opt, run_dir=str(Path(root) / "dp"),
        device_mesh=mesh, ranks_per_node=1, checkpoint=ck, average_gradients=True,
    )  # fmt: skip
    torch.manual_seed(100 + rank)
    ft.restore()
    ft.close()
    logging.getLogger("baft").removeHandler(handler)
    out["warnings"] = [m for m in records if m.startswith("DP replicas")]
    return out


def test_dp_replicas_must_average_gradients(gloo, tmp_path: Path) -> None:
    from baft.pipeline.step import DP_AVERAGE_HELP

    got = gloo.run(_dp_job, 2, args=(str(tmp_path),), timeout_s=120)
    for out in got:
        assert out["unaveraged"] == (
            "RuntimeError",
            f"optimizer.step() with 2 DP replicas but gradients not averaged: {DP_AVERAGE_HELP}",
        )
        assert out["untouched"] is True
    assert got[0]["weight"] == got[1]["weight"]  # averaged: the replicas stay identical
    assert got[0]["auto_moved"] is True
    # replicas seeded differently keep their own RNG (per-replica records): no warning
    assert got[0]["warnings"] == [] and got[1]["warnings"] == []
    assert got[0]["auto_weight"] == got[1]["auto_weight"]


def _shorthand_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """The same 3 iterations through ``ft.step`` and through the plain loop."""
    from torch.distributed.distributed_c10d import _world

    out: dict[str, Any] = {"groups_before": len(_world.pg_map)}
    for how in ("shorthand", "loop"):
        s = _setup(rank, world)
        ft = _protect(s, str(Path(root) / how), state={"sampler": s["sampler"]})
        ft.restore()
        losses = []
        for it in range(3):
            g = torch.Generator().manual_seed(s["sampler"].next_batch())
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
            if how == "shorthand":
                losses.append(ft.step(it, x if rank == 0 else None, y if rank == 1 else None))
            else:
                s["opt"].zero_grad()
                if rank == 0:
                    s["schedule"].step(x)
                else:
                    s["schedule"].step(target=y)
                s["opt"].step()
                losses.append(ft.last_step.loss)
        out[how] = (_digest(s["module"], s["opt"], s["sched"], s["sampler"]), losses, ft.iteration)
        out[f"{how}_committed"] = ft.metrics["committed_version"]
        ft.close()
        out[f"{how}_groups_after_close"] = len(_world.pg_map)
    return out


def test_shorthand_and_loop_have_one_trajectory(gloo, tmp_path: Path) -> None:
    got = gloo.run(_shorthand_job, 2, args=(str(tmp_path),), timeout_s=120)
    for rank, out in enumerate(got):
        assert out["shorthand"] == out["loop"], rank
        assert out["loop"][2] == 3
        assert out["loop_committed"] == out["shorthand_committed"] == 1  # checkpoints ran
        # close() destroys the groups protect() made (their threads must not outlive it)
        assert out["shorthand_groups_after_close"] == out["groups_before"], out
        assert out["loop_groups_after_close"] == out["groups_before"], out
    assert got[1]["loop"][1][0] is not None and got[0]["loop"][1][0] is None  # last stage
