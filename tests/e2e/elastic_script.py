"""A user's pipelining script with elastic DP replicas (README "A host gone for good").

pp=2, with as many DP ranks per stage as torchrun gives it (``WORLD_SIZE / 2``), and a
fixed number of replicas (``--replicas``, default 2) that those ranks compute: each
iteration processes every replica's micro-batches, whatever the number of hosts::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 2 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --max-restarts 10 \\
        tests/e2e/elastic_script.py --out runs/el     # -m baft.inprocess before it: in-process

Each stage is a fresh ``nn.Sequential`` with dropout (each replica's RNG), BatchNorm on
the first (running statistics: the first replica's after every iteration), AdamW, a step
LR schedule (the job's), gradient clipping, and a sampler per replica whose position is
in ``state=`` (swapped by ``ft.replicas()``). ``--unprotected`` runs the same loop
without baft (each rank one replica, an all-reduce average: for 2 replicas the same bits
as baft's deterministic reduction; buffers broadcast from the first replica). Every rank appends ``{"it", "world", "digest", "t"}`` per
iteration to ``OUT/trace.pp{p}.jsonl`` (one file per stage: the ranks of a stage hold the
same bytes) and rank 0 of each stage writes ``OUT/final.pp{p}.json`` at the end.
``--sleep S`` slows each iteration so that a fault from outside lands mid-run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

WIDTH = 16


class Sampler:
    """One replica's data: a position advanced once per iteration."""

    def __init__(self) -> None:
        self.position = 0

    def batch(self, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100_000 * replica + self.position)
        self.position += 1
        return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def digest(module: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--persist-every", type=int, default=50)
    ap.add_argument("--full-every", default="auto", help="1: whole state every version")
    ap.add_argument("--unprotected", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.unprotected:
        num_dp = world // args.pp
    else:  # the world's DP degree; waits for a host when it cannot hold every stage
        import baft

        num_dp = baft.elastic_dp(args.replicas, model_ranks=args.pp)
    mesh = init_device_mesh("cpu", (args.pp, num_dp, 1), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    torch.manual_seed(7 + pp)  # the stage's weights, and every replica's first RNG state
    # the first stage's BatchNorm: running statistics that every replica's forward moves
    norm = [nn.BatchNorm1d(WIDTH)] if pp == 0 else []
    module = nn.Sequential(nn.Linear(WIDTH, WIDTH), *norm, nn.GELU(), nn.Dropout(0.2))
    stage = PipelineStage(module, pp, args.pp, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, y: (o - y).square().mean())
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    sampler = Sampler()

    def body(replica: int) -> None:
        x, y = sampler.batch(replica)
        if pp == 0:
            schedule.step(x)
        elif pp == args.pp - 1:
            schedule.step(target=y)
        else:
            schedule.step()

    ft = None
    start = 0
    if not args.unprotected:
        import baft

        ck = baft.CheckpointConfig(
            policy=baft.CheckpointPolicy.parse(
                f"persist={args.persist_every},full_every={args.full_every}"
            ),
            profile_iters=1,
            store=baft.StoreConfig(root=os.environ.get("BAFT_STORE_ROOT", "/dev/shm/baft")),
            elastic=baft.ElasticConfig(num_replicas=args.replicas),
        )
        ft = baft.protect(
            schedule=schedule, stages=[stage], optimizer=opt, run_dir=str(out / "run"),
            device_mesh=mesh, checkpoint=ck, ranks_per_node=2,
            state={"sampler": sampler, "lr": lr},
        )  # fmt: skip
        start = ft.restore()
    for it in range(start, args.iterations):
        opt.zero_grad()
        if ft is not None:
            for r in ft.replicas():
                body(r)
        else:
            body(dp)
            for p in module.parameters():
                dist.all_reduce(p.grad, group=mesh.get_group("dp"))
                p.grad.div_(args.replicas)
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        lr.step()
        if ft is None:  # the first replica's statistics, as DDP's broadcast_buffers
            for b in module.buffers():
                dist.broadcast(b, group=mesh.get_group("dp"), group_src=0)
        if dp == 0:
            with (out / f"trace.pp{pp}.jsonl").open("a") as f:
                rec = {"it": it, "world": world, "digest": digest(module, opt), "t": time.time()}
                f.write(json.dumps(rec) + "\n")
        time.sleep(args.sleep)
    if ft is not None:
        ft.close()
    if dp == 0:
        (out / f"final.pp{pp}.json").write_text(
            json.dumps({"digest": digest(module, opt), "world": world})
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    import baft

    baft.run(main)  # under `-m baft.inprocess`: survivors re-enter main() after a failure
