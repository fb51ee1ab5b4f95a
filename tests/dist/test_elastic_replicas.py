"""Elastic replicas: a fixed number of DP replicas, however many ranks compute them.

A pp=2 job with ``ElasticConfig(num_replicas=2)`` runs on 4 ranks (dp=2, each rank one
replica) and on 2 ranks (dp=1, each rank both replicas, one after the other). The model
has dropout (each replica's own RNG stream), each replica reads its own data through a
``state=`` loader (its own position), and an LR scheduler is the job's. With the
deterministic reduction both runs are bit-identical at every iteration (parameters and
loss), and equal to the same loop without baft on 4 ranks averaging with an all-reduce
(for 2 replicas a sum in either order is the same bits). A job that shrinks (4 ranks,
stores wiped, 2 ranks restore from its DCP checkpoint: the layout names replicas, not
ranks) and one that grows back (2 -> 4) continue on the same trajectory.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(300)
ITERATIONS = 6
REPLICAS = 2


class Loader:
    """Replica ``r``'s data: a position that advances once per micro-batch pair."""

    def __init__(self) -> None:
        self.position = 0

    def batch(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        g = torch.Generator().manual_seed(1000 * r + self.position)
        return torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _build(world: int, bn: bool = False) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, world // 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    pp = mesh.get_local_rank("pp")
    torch.manual_seed(pp)  # the same on every replica of a stage, and each replica's RNG
    # running statistics that each replica's forward moves (on the first stage: a later
    # one would need input_args, torch's shape inference feeding it uninitialised memory)
    norm = [nn.BatchNorm1d(6)] if bn and pp == 0 else []
    module = nn.Sequential(nn.Linear(6, 6), *norm, nn.Dropout(0.3), nn.Linear(6, 6))
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(
        stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
    )
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    del dist
    return {
        "mesh": mesh, "pp": pp, "module": module, "schedule": schedule, "opt": opt,
        "sched": sched, "loader": Loader(), "stage": stage,
    }  # fmt: skip


def _protect(s: dict[str, Any], root: str, full_every: int = 1, persist_every: int = 1) -> Any:
    import baft

    ck = baft.CheckpointConfig(
        policy=baft.CheckpointPolicy(
            redundancy="xor:2", persist_every=persist_every, full_every=full_every
        ),
        profile_iters=1,
        cost={"copy_Bps": 1e9},
        store=baft.StoreConfig(root=str(Path(root) / "shm"), job_id="el", keep_on_close=False),
        elastic=baft.ElasticConfig(num_replicas=REPLICAS),
    )
    return baft.protect(
        schedule=s["schedule"], stages=[s["stage"]], optimizer=s["opt"],
        run_dir=str(Path(root) / "run"), device_mesh=s["mesh"], checkpoint=ck,
        ranks_per_node=1, state={"loader": s["loader"], "lr": s["sched"]},
    )  # fmt: skip


def _body(s: dict[str, Any], r: int) -> None:
    x, y = s["loader"].batch(r)
    if s["pp"] == 0:
        s["schedule"].step(x)
    else:
        s["schedule"].step(target=y)


def _run(
    rank: int, world: int, root: str, start_at: int, stop_at: int, keep: bool, full_every: int = 1,
    persist_every: int = 1, bn: bool = False,
) -> Any:  # fmt: skip
    s = _build(world, bn)
    ft = _protect(s, root, full_every, persist_every)
    if keep:
        ft.checkpoint.store.keep_on_close = True
    start = ft.restore()
    record = ft.recovery.record if ft.recovery is not None else {}
    out: dict[str, Any] = {
        "start": start, "source": record.get("source", "fresh"), "reason": record.get("reason"),
    }  # fmt: skip
    for it in range(start, stop_at):
        s["opt"].zero_grad()
        replicas = []
        for r in ft.replicas():
            replicas.append(r)
            _body(s, r)
        torch.nn.utils.clip_grad_norm_(s["module"].parameters(), 1.0)
        s["opt"].step()
        s["sched"].step()
        out[it] = (_digest(s["module"]), replicas, ft.last_step.loss)
    ft.close()
    return out


def _plain(rank: int, world: int, bn: bool = False) -> dict[int, Any]:
    """The same loop without baft on 4 ranks: each rank its replica, all-reduce average,
    buffers from the first replica after the step (as DDP's ``broadcast_buffers``)."""
    import torch.distributed as dist

    s = _build(world, bn)
    r = s["mesh"].get_local_rank("dp")
    out = {}
    for it in range(ITERATIONS):
        s["opt"].zero_grad()
        _body(s, r)
        for p in s["module"].parameters():
            dist.all_reduce(p.grad, group=s["mesh"].get_group("dp"))
            p.grad.div_(REPLICAS)
        torch.nn.utils.clip_grad_norm_(s["module"].parameters(), 1.0)
        s["opt"].step()
        s["sched"].step()
        for b in s["module"].buffers():
            dist.broadcast(b, group=s["mesh"].get_group("dp"), group_src=0)
        out[it] = _digest(s["module"])
    return out


@pytest.mark.parametrize("bn", [False, True], ids=["plain", "batchnorm"])
def test_one_rank_per_stage_computing_both_replicas_is_bit_identical(
    gloo, tmp_path: Path, bn: bool
) -> None:
    """With BatchNorm the digests hold its running statistics too: every replica's
    forward starts from the iteration's, and the iteration ends with replica 0's."""
    a = (0, ITERATIONS, False, 1, 1, bn)
    four = gloo.run(_run, 4, args=(str(tmp_path / "a"), *a), timeout_s=240)
    two = gloo.run(_run, 2, args=(str(tmp_path / "b"), *a), timeout_s=240)
    plain = gloo.run(_plain, 4, args=(bn,), timeout_s=120)
    for it in range(ITERATIONS):
        for pp in range(2):
            # ranks (pp, dp): 4 ranks -> pp*2 + dp; 2 ranks -> pp
            assert four[pp * 2][it][0] == four[pp * 2 + 1][it][0] == two[pp][it][0], (it, pp)
            assert four[pp * 2][it][0] == plain[pp * 2][it], (it, pp)
        assert two[0][it][1] == [0, 1] and four[1][it][1] == [1]
    assert two[1][ITERATIONS - 1][2] is not None  # the last stage reports the mean loss
    mean = (four[2][ITERATIONS - 1][2] + four[3][ITERATIONS - 1][2]) / 2
    assert abs(two[1][ITERATIONS - 1][2] - mean) < 1e-6


@pytest.mark.slow  # default tier: the same resize from memory (test_shrink_and_grow_from_memory)
def test_shrink_and_grow_through_dcp_stay_on_the_trajectory(gloo, tmp_path: Path) -> None:
    ref = gloo.run(_run, 4, args=(str(tmp_path / "ref"), 0, ITERATIONS, False), timeout_s=240)
    root = str(tmp_path / "job")
    gloo.run(_run, 4, args=(root, 0, 2, True), timeout_s=240)
    shutil.rmtree(Path(root) / "shm")  # the hosts' memory is gone: DCP holds version 2
    shrunk = gloo.run(_run, 2, args=(root, 0, 4, True), timeout_s=240)
    assert shrunk[0]["start"] >= 1 and shrunk[0]["source"] == "disk", shrunk[0]
    shutil.rmtree(Path(root) / "shm")
    grown = gloo.run(_run, 4, args=(root, 0, ITERATIONS, False), timeout_s=240)
    assert grown[0]["start"] >= 3 and grown[0]["source"] == "disk", grown[0]
    for it in range(shrunk[0]["start"], 4):
        for pp in range(2):
            assert shrunk[pp][it][0] == ref[pp * 2][it][0], (it, pp)
            assert shrunk[pp][it][1] == [0, 1]
    for it in range(grown[0]["start"], ITERATIONS):
        for rank in range(4):
            assert grown[rank][it][0] == ref[rank][it][0], (it, rank)


@pytest.mark.parametrize(
    "full_every",
    [pytest.param(1, marks=pytest.mark.slow), 2],  # default tier: differential (the default)
)
def test_shrink_and_grow_from_memory(gloo, tmp_path: Path, full_every: int) -> None:
    """4 ranks -> 2 -> 4 with the stores in memory: each resize rebuilds the old job's
    shards (as its restart would) and assembles them for the new DP degree; the
    trajectory is the unchanged run's. No DCP tier until the grow: a clean end that
    passed a due version over persists its final state, newer than memory's, and a
    relaunch would resume from that (``test_shrink_and_grow_through_dcp...``)."""
    bn = True  # BatchNorm's statistics too: the stage's, restored from replica 0's share
    ref = gloo.run(_run, 4, args=(str(tmp_path / "ref"), 0, 9, False, 1, 1, bn), timeout_s=240)
    root = str(tmp_path / "job")
    gloo.run(_run, 4, args=(root, 0, 4, True, full_every, 0, bn), timeout_s=240)
    shrunk = gloo.run(_run, 2, args=(root, 0, 6, True, full_every, 0, bn), timeout_s=240)
    assert shrunk[0]["source"] == "memory" and shrunk[0]["start"] >= 2, shrunk[0]
    assert "shards of dp=2 (pp=2, tp=1, xor:2) rebuilt for dp=1" in shrunk[0]["reason"]
    grown = gloo.run(_run, 4, args=(root, 0, 9, False, full_every, 1, bn), timeout_s=240)
    assert grown[0]["source"] == "memory" and grown[0]["start"] >= 4, grown[0]
    assert "rebuilt for dp=2" in grown[0]["reason"], grown[0]
    for it in range(shrunk[0]["start"], 6):
        assert [shrunk[pp][it][0] for pp in range(2)] == [ref[2 * pp][it][0] for pp in range(2)]
    for it in range(grown[0]["start"], 9):
        assert [grown[r][it][0] for r in range(4)] == [ref[r][it][0] for r in range(4)], it
