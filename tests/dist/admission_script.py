"""A README-quickstart script whose snapshot stores cannot fit: ``--store-root`` on a small
tmpfs (Docker's default /dev/shm is 64 MB). Launched with plain torchrun by
``test_admission_tmpfs.py``; every rank writes ``outcome.rank{r}.json`` (the error, or the
iterations it trained) before it exits."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import baft

WIDTH, LAYERS, BATCH = 1024, 3, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--store-root", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    loss_fn = nn.MSELoss() if rank == world - 1 else None
    schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    out = Path(a.out)
    outcome: dict[str, object] = {"trained": 0}
    try:
        ft = baft.protect(
            schedule=schedule, stages=[stage], optimizer=optimizer, run_dir=str(out / "run"),
            checkpoint=baft.CheckpointConfig(store=baft.StoreConfig(root=a.store_root)),
            ranks_per_node=1,
        )  # fmt: skip
        start = ft.restore()
        x = torch.randn(BATCH, WIDTH)
        for it in range(start, 3):
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=torch.zeros(BATCH, WIDTH))
            optimizer.step()
            outcome["trained"] = it + 1
        ft.close()
    except Exception as e:  # noqa: BLE001 - the outcome is what the test reads
        outcome["error"] = f"{type(e).__name__}: {e}"
    (out / f"outcome.rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
