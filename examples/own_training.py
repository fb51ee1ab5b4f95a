"""Using baft from your own torch.distributed.pipelining training script.

Run (2 pipeline ranks, on CPU, or one GPU per rank where CUDA is present; add --inject
to see a crash and an in-memory recovery):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 2 --log-dir runs/example/logs --redirects 3 \\
        examples/own_training.py --out runs/example --inject kill:rank=1,iter=5,at=transfer

In-process recovery (only the failed process is replaced; the others re-enter ``main()``):
the same command with ``-m baft.inprocess`` before the script.

(``--log-dir``/``--redirects 3``: each worker's output goes to a file under
``runs/example/logs/``, so the survivors' stack traces after a kill stay off the console.)

Everything not marked ``# baft`` is an ordinary pipelining loop: BatchNorm (buffers),
dropout (the RNG), SGD with momentum, an LR scheduler with warmup, gradient clipping and
a sampler that keeps its own position. ``--unprotected`` runs the same loop without baft;
both end with the same bytes in every parameter, buffer, optimizer and scheduler state
and have read the same batches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import baft  # baft

WIDTH, CLASSES, DATASET, BATCH = 64, 10, 512, 32


def make_stage(stage: int, num_stages: int) -> nn.Module:
    torch.manual_seed(1234 + stage)  # deterministic init per stage
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    if stage == 0:
        # Running statistics: buffers that training updates. (On a later stage, build
        # the PipelineStage with input_args/output_args: torch's shape inference would
        # feed it uninitialised memory on every process's first step.)
        layers.append(nn.BatchNorm1d(WIDTH))
    layers += [nn.GELU(), nn.Dropout(0.1)]  # dropout draws from the RNG every forward
    if stage == num_stages - 1:
        layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


class ShuffleSampler:
    """Batches of dataset indices, reshuffled every epoch; its position is its state."""

    def __init__(self, size: int, batch: int, seed: int) -> None:
        self.size, self.batch, self.seed = size, batch, seed
        self.epoch, self.position = 0, 0

    def next_batch(self) -> list[int]:
        if self.position + self.batch > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=g)
        out = order[self.position : self.position + self.batch].tolist()
        self.position += self.batch
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(DATASET, WIDTH, generator=g), torch.randint(
        0, CLASSES, (DATASET,), generator=g
    )


def sha(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def plain(value: Any) -> Any:
    """A state_dict as JSON: tensors by digest, everything else by value."""
    if isinstance(value, torch.Tensor):
        return {"sha256": sha(value), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return repr(value)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/example")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--inject", action="append", default=[])
    p.add_argument("--persist-every", type=int, default=0, help="DCP every N checkpoints")
    p.add_argument("--unprotected", action="store_true", help="the same loop without baft")
    a = p.parse_args()
    torch.set_num_threads(1)
    if torch.cuda.is_available():  # one GPU per local rank (baft picks the same device)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # bit-identical trajectories on GPUs need deterministic kernels, baft or not
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = make_stage(rank, world).to(device)
    stage = PipelineStage(module, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=a.iterations)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[3])
    sampler = ShuffleSampler(DATASET, BATCH, seed=7)  # every stage reads the same batches
    inputs, labels = (t.to(device) for t in dataset())
    torch.manual_seed(99)  # the dropout masks' sequence

    start, ft = 0, None
    if not a.unprotected:
        ft = baft.protect(  # baft
            schedule=schedule,
            stages=[stage],
            optimizer=optimizer,
            run_dir=a.out,
            checkpoint=baft.CheckpointConfig(
                policy=baft.CheckpointPolicy(
                    redundancy="replicate:1", persist_every=a.persist_every
                ),
                profile_iters=1,
                cost={"copy_Bps": 1e9},  # skip the start-up copy calibration
            ),
            ranks_per_node=1,  # each rank its own failure domain
            state={"lr_scheduler": scheduler, "sampler": sampler},
        )
        ft.inject(a.inject)  # failure drills (--inject); nothing when none is given
        start = ft.restore()  # baft: 0 on a fresh job, the restored version after a crash
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    batch_log = open(out / f"batches.rank{rank}.jsonl", "a")  # noqa: SIM115 - one per run
    losses: dict[int, float] = {}
    for it in range(start, a.iterations):
        index = sampler.next_batch()
        batch_log.write(json.dumps({"iteration": it, "batch": index}) + "\n")
        batch_log.flush()
        x, y = inputs[index], labels[index]
        optimizer.zero_grad()
        mb_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=mb_losses)
        else:
            schedule.step()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if mb_losses:
            losses[it] = float(torch.stack(mb_losses).detach().mean())
    if ft is not None:
        ft.close()  # baft
    batch_log.close()
    state = {
        "module": plain(module.state_dict()),  # parameters and buffers
        "optimizer": plain(optimizer.state_dict()),
        "scheduler": plain(scheduler.state_dict()),
        "sampler": sampler.state_dict(),
        "rng": sha(torch.get_rng_state()),
    }
    if device.type == "cuda":  # dropout draws from the device's generator there
        state["cuda_rng"] = sha(torch.cuda.get_rng_state(device))
    (out / f"state.rank{rank}.json").write_text(json.dumps(state, indent=1))
    if rank == world - 1:
        (out / f"losses.attempt{start}.json").write_text(json.dumps(losses))
        (out / "final.json").write_text(json.dumps({"start": start}))
    dist.destroy_process_group()


if __name__ == "__main__":
    baft.run(main)  # baft: under `-m baft.inprocess`, survivors re-enter main() after a failure
