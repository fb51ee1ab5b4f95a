"""A user's loop whose DP replicas each keep their own small state (issue 41, part 2).

Every data-parallel rank ``d`` of ``D`` reads its own shard of the dataset (shard lengths
differ, so the replicas' loaders roll over into a new epoch at different iterations, as
torchtitan's per-rank loaders do), counts what it read in its own counter, and draws its
dropout masks from its own RNG stream (seeded ``100 + d``). The model and optimizer stay
replicas: the gradients are averaged (by the loop over ``dp``, or by FSDP2 over
``dp_replicate`` x ``dp_shard`` with ``--dp-shard 2``). Each replica's ``state=`` objects
and RNG hold different values, so a restore that hands every replica one replica's copy
ends on other bytes than the same loop without baft.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        tests/e2e/replica_state_script.py --out runs/rs --dp-replicate 2 [--unprotected]

Writes ``state.rank{r}.json``: the loader's and counter's state, the RNG's digest, every
local parameter and optimizer-state digest, and the losses of every iteration it ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

WIDTH, CLASSES, DATASET, BATCH = 16, 5, 128, 4


class ShardLoader:
    """Batches of this data-parallel rank's shard (of ``d::D``, the first ``28 - 5 d``
    samples: shards of different lengths), reshuffled per epoch from a seed of its own."""

    def __init__(self, d: int, num: int) -> None:
        self.shard = list(range(d, DATASET, num))[: 28 - 5 * d]
        self.d, self.epoch, self.position = d, 0, 0

    def next_batch(self) -> list[int]:
        if self.position + BATCH > len(self.shard):
            self.epoch, self.position = self.epoch + 1, 0
        g = torch.Generator().manual_seed(1000 * self.d + self.epoch)
        order = torch.randperm(len(self.shard), generator=g).tolist()
        out = [self.shard[i] for i in order[self.position : self.position + BATCH]]
        self.position += BATCH
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class Counter:
    """What this replica has read (its own sum of sample indices)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def sha(t: torch.Tensor) -> str:
    t = t.to_local() if isinstance(t, DTensor) else t
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--dp-replicate", type=int, default=2)
    p.add_argument("--dp-shard", type=int, default=1, help="> 1: FSDP2 HSDP")
    p.add_argument("--unprotected", action="store_true")
    p.add_argument("--redundancy", default="xor:2")
    p.add_argument("--persist-every", type=int, default=0)
    p.add_argument("--full-every", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--store-root", default="/dev/shm/baft")
    p.add_argument("--job-id", default="")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds per iteration")
    return p.parse_args()


def main() -> None:  # noqa: PLR0915 - one straight user loop
    a = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hsdp = a.dp_shard > 1
    if hsdp:
        mesh = init_device_mesh(
            "cpu",
            (1, a.dp_replicate, a.dp_shard),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard"),
        )
        d = mesh["dp_replicate"].get_local_rank() * a.dp_shard + mesh["dp_shard"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (1, a.dp_replicate, 1), mesh_dim_names=("pp", "dp", "tp"))
        d = mesh["dp"].get_local_rank()
    num = a.dp_replicate * a.dp_shard
    torch.manual_seed(1234)  # identical model on every replica
    module = nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, CLASSES))
    if hsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    loader, counter = ShardLoader(d, num), Counter()
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(DATASET, WIDTH, generator=g)
    labels = torch.randint(0, CLASSES, (DATASET,), generator=g)
    torch.manual_seed(100 + d)  # this replica's own dropout stream

    start, ft = 0, None
    if not a.unprotected:
        import baft

        ft = baft.protect(
            schedule=schedule,
            stages=[stage],
            optimizer=optimizer,
            run_dir=a.out,
            device_mesh=mesh,
            checkpoint=baft.CheckpointConfig(
                policy=baft.CheckpointPolicy(
                    redundancy=a.redundancy, persist_every=a.persist_every, full_every=a.full_every
                ),
                profile_iters=2,
                cost={"copy_Bps": 1e9},
                store=baft.StoreConfig(root=a.store_root, job_id=a.job_id),
                persist=baft.PersistConfig(dir=str(Path(a.out) / "checkpoints")),
                timeouts=baft.TimeoutConfig(collective_s=a.timeout),
            ),
            ranks_per_node=a.ranks_per_node,
            state={"loader": loader, "counter": counter},
            average_gradients=None if hsdp else False,
        )
        start = ft.restore()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    losses: dict[int, float] = {}
    for it in range(start, a.iterations):
        index = loader.next_batch()
        counter.seen += sum(index)
        optimizer.zero_grad()
        mb: list[torch.Tensor] = []
        schedule.step(inputs[index], target=labels[index], losses=mb)
        if not hsdp:  # FSDP2 averages over dp_replicate x dp_shard itself
            for p in module.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad.div_(a.dp_replicate)
        optimizer.step()
        losses[it] = float(torch.stack(mb).detach().mean())
        time.sleep(a.sleep)
    if ft is not None:
        ft.close()
    state = {
        "loader": loader.state_dict(),
        "counter": counter.state_dict(),
        "rng": sha(torch.get_rng_state()),
        "params": {n: sha(p) for n, p in module.named_parameters()},
        "optim": {
            f"{n}.{k}": sha(v) if isinstance(v, torch.Tensor) else repr(v)
            for n, p in module.named_parameters()
            for k, v in optimizer.state[p].items()
        },
    }
    (out / f"state.rank{rank}.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    (out / f"losses.rank{rank}.attempt{start}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    import baft

    baft.run(main)
