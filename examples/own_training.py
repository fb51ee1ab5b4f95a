"""Using baft from your own torch.distributed.pipelining training script.

Run (2 pipeline ranks on CPU; add --inject to see a crash and an in-memory recovery):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 2 examples/own_training.py --out runs/example

Everything that is not marked ``# baft`` is an ordinary pipelining loop.
"""

from __future__ import annotations

import argparse
import hashlib
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


def state_digests(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of every parameter, buffer and optimizer state tensor, plus the hyperparameters."""

    def sha(t: torch.Tensor) -> str:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return hashlib.sha256(raw).hexdigest()

    out = {f"model.{k}": sha(v) for k, v in module.state_dict().items()}
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for key, value in state.items():
            out[f"optim.{index}.{key}"] = sha(value) if torch.is_tensor(value) else repr(value)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    out["optim.param_groups"] = repr(groups)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/example")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--inject", action="append", default=[])
    p.add_argument("--unprotected", action="store_true", help="the same loop without baft")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = make_stage(rank, world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    if a.unprotected:  # the plain pipelining loop, for comparison
        start, ft = 0, None
        Path(a.out).mkdir(parents=True, exist_ok=True)
    else:
        ft = baft.protect(  # baft
            schedule=schedule,
            stages=[stage],
            optimizer=optimizer,
            run_dir=a.out,
            checkpoint=baft.CheckpointConfig(
                policy=baft.CheckpointPolicy(redundancy="replicate:1", persist_every=0),
                inject=a.inject,
            ),
            ranks_per_node=1,  # each rank its own failure domain
        )
        start = ft.restore()  # baft: 0 on a fresh job, the restored version after a crash
    losses = {}
    for it in range(start, a.iterations):
        x, y = batch(it)
        x_in, y_in = (x if rank == 0 else None), (y if rank == world - 1 else None)
        if ft is not None:
            loss = ft.step(it, x_in, y_in)  # baft: replaces schedule.step(...) + optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
            mb_losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(x_in)
            elif rank == world - 1:
                schedule.step(target=y_in, losses=mb_losses)
            else:
                schedule.step()
            optimizer.step()
            loss = float(torch.stack(mb_losses).mean()) if mb_losses else None
        if loss is not None:
            losses[it] = loss
    if ft is not None:
        ft.close()  # baft
    out = Path(a.out)
    (out / f"state.rank{rank}.json").write_text(json.dumps(state_digests(module, optimizer)))
    if rank == world - 1:
        (out / f"losses.attempt{start}.json").write_text(json.dumps(losses))
        (out / "final.json").write_text(json.dumps({"start": start}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
