"""Using baft from your own torch.distributed.pipelining training script.

Run (2 pipeline ranks on CPU; add --inject to see a crash and an in-memory recovery):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 2 examples/own_training.py --out runs/example

Everything that is not marked ``# baft`` is an ordinary pipelining loop.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import baft  # baft


def make_stage(stage: int, num_stages: int, width: int = 256) -> nn.Module:
    torch.manual_seed(1234 + stage)  # deterministic init per stage
    layers: list[nn.Module] = [nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)]
    if stage == num_stages - 1:
        layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def batch(iteration: int, width: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Data as a pure function of the iteration: resuming replays it exactly."""
    g = torch.Generator().manual_seed(iteration)
    return torch.randn(32, width, generator=g), torch.randint(0, 10, (32,), generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/example")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--inject", action="append", default=[])
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = make_stage(rank, world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    ft = baft.protect(  # baft
        schedule=schedule,
        stages=[stage],
        optimizer=optimizer,
        run_dir=a.out,
        checkpoint=baft.CheckpointConfig(
            redundancy="replicate:1", persist_every=0, inject=a.inject
        ),
        ranks_per_node=1,  # each rank its own failure domain
    )
    start = ft.restore()  # baft: 0 on a fresh job, the restored version after a crash
    losses = {}
    for it in range(start, a.iterations):
        x, y = batch(it)
        loss = ft.step(  # baft: replaces schedule.step(...) + optimizer.step()
            it, x if rank == 0 else None, y if rank == world - 1 else None
        )
        if loss is not None:
            losses[it] = loss
    ft.close()  # baft
    if rank == world - 1:
        out = Path(a.out) / f"losses.attempt{start}.json"
        out.write_text(json.dumps(losses))
        digest = sum(float(p.double().sum()) for p in module.parameters())
        (Path(a.out) / "final.json").write_text(json.dumps({"start": start, "param_sum": digest}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
