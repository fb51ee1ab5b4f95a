"""A torchtitan-shaped FSDP2 x pipeline (x TP) training script, protected by baft.

Run (4 ranks on CPU: 2 pipeline stages, each sharded over 2 ranks with FSDP2):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 \\
        --max-restarts 2 --log-dir runs/fsdp2/logs --redirects 3 \\
        examples/fsdp2_pipeline.py --pp 2 --dp-shard 2 --out runs/fsdp2

then kill a worker from another shell (``pkill -9 -f 'fsdp2_pipeline.py' -n``): torchrun
restarts the group, baft restores every rank's local shards from memory, and the run ends
with the bytes it would have had without the failure. ``--unprotected`` runs the same loop
without baft, ``--tp 2`` adds tensor parallelism inside every block, ``--dp-replicate 2``
makes it HSDP.

Everything not marked ``# baft`` is what a torchtitan-style script does: one model with
unique FQNs (``layers.<i>...``) cut into pipeline stages by deleting what a stage does
not run, each block and each stage ``fully_shard``-ed over ``mesh["dp_shard"]``, AdamW,
gradient clipping on DTensor norms, a warmup schedule, a per-replica sampler.
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

import baft  # baft

WIDTH, HIDDEN, CLASSES, LAYERS, DATASET, BATCH = 32, 48, 7, 4, 512, 8
# CLASSES = 7: the head's rows shard unevenly (4 + 3) over two dp_shard ranks


class Block(nn.Module):
    """Pre-norm MLP block with a residual and dropout (the RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.w1 = nn.Linear(WIDTH, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.w2(nn.functional.gelu(self.w1(self.norm(x)))))


class Model(nn.Module):
    """Input projection, ``LAYERS`` blocks, head; a stage sets the parts it lacks to None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.head: nn.Module | None = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def stage_model(stage: int, num_stages: int) -> Model:
    """The whole model built the same way on every rank, then cut to ``stage``'s blocks."""
    torch.manual_seed(1234)
    model = Model()
    per = LAYERS // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.embed = None
    if stage < num_stages - 1:
        model.head = None
    return model


def parallelize(model: Model, mesh: DeviceMesh) -> None:
    """TP inside every block (when the mesh has a ``tp`` dim), then FSDP2 per block and
    per stage, as torchtitan's ``parallelize`` does."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for block in model.layers.values():
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
            parallelize_module(block, mesh["tp"], plan)
    dp = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp, reshard_after_forward=False)
    fully_shard(model, mesh=dp, reshard_after_forward=False)


class Sampler:
    """This data-parallel rank's batches of dataset indices; its position is its state."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.dp_rank, self.dp_size, self.position = dp_rank, dp_size, 0

    def next_batch(self) -> list[int]:
        g = torch.Generator().manual_seed(self.position)
        order = torch.randperm(DATASET, generator=g)[: BATCH * self.dp_size]
        self.position += 1
        return order[self.dp_rank * BATCH : (self.dp_rank + 1) * BATCH].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters on several meshes (with TP the blocks live on
    (dp_shard, tp), the embedding and head on dp_shard): one norm per mesh, combined, as
    torchtitan does for parameters on different meshes."""
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]) for ps in by_mesh.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def sha(t: torch.Tensor) -> str:
    t = t.to_local() if isinstance(t, DTensor) else t
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def final_state(model: Model, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict:
    """Digests of the local shards, the optimizer state, and the gathered parameters."""
    out: dict[str, Any] = {"local": {}, "full": {}, "optim": {}, **extra}
    for fqn, p in model.named_parameters():
        out["local"][fqn] = sha(p)
        out["full"][fqn] = sha(p.full_tensor() if isinstance(p, DTensor) else p)
        for key, v in optimizer.state[p].items():
            out["optim"][f"{fqn}.{key}"] = sha(v) if isinstance(v, torch.Tensor) else repr(v)
    return out


def full_state(model: Model, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This stage's gathered parameters and optimizer state, keyed as torch's
    ``get_model_state_dict`` / flattened ``get_optimizer_state_dict`` key them.
    Collective over the stage's ``dp_shard`` ranks (``full_tensor``)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    names = {id(p): fqn for fqn, p in model.named_parameters()}
    out: dict[str, Any] = {"model": {}, "optim": {}}
    for fqn, p in model.named_parameters():
        out["model"][fqn] = full(p)
        for key, v in optimizer.state[p].items():
            out["optim"][f"state.{fqn}.{key}"] = full(v) if isinstance(v, torch.Tensor) else v
    for g in optimizer.param_groups:
        for p in g["params"]:
            for k, v in g.items():
                if k != "params":
                    out["optim"][f"param_groups.{names[id(p)]}.{k}"] = v
    return out


def dump_full(model: Model, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """``--dump-full``: every stage's :func:`full_state`, merged, saved by rank 0."""
    mine = full_state(model, optimizer)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() == 0:
        merged: dict[str, Any] = {"model": {}, "optim": {}}
        for part in gathered:
            merged["model"].update(part["model"])
            merged["optim"].update(part["optim"])
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(merged, path)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/fsdp2")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp-shard", type=int, default=2)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--unprotected", action="store_true", help="the same loop without baft")
    p.add_argument(
        "--dump-full",
        default="",
        help="directory: rank 0 saves the gathered state at each iteration's start (v<it>.pt)",
    )
    b = p.add_argument_group("baft (defaults: baft's)")
    b.add_argument("--redundancy", default="xor:2")
    b.add_argument("--persist-every", type=int, default=50, help="DCP every N checkpoints")
    b.add_argument("--full-every", default="auto", help="differential versions: auto, or N")
    b.add_argument("--ranks-per-node", type=int, default=0, help="ranks per failure domain")
    b.add_argument("--store-root", default="", help="host-memory store (default /dev/shm)")
    b.add_argument("--job-id", default="")
    b.add_argument("--keep-stores", action="store_true", help="keep the stores at the end")
    b.add_argument("--timeout", type=float, default=60.0, help="collective/watchdog seconds")
    return p.parse_args()


def checkpoint_config(a: argparse.Namespace) -> baft.CheckpointConfig:  # baft
    full_every = 0 if a.full_every == "auto" else int(a.full_every)  # 0: auto
    policy = baft.CheckpointPolicy(
        redundancy=a.redundancy, persist_every=a.persist_every, full_every=full_every
    )
    store = baft.StoreConfig(job_id=a.job_id, keep_on_close=a.keep_stores)
    if a.store_root:
        store.root = a.store_root
    return baft.CheckpointConfig(
        policy=policy, store=store, timeouts=baft.TimeoutConfig(collective_s=a.timeout)
    )


def main() -> None:
    a = arguments()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dims = [("pp", a.pp), ("dp_replicate", a.dp_replicate), ("dp_shard", a.dp_shard)]
    dims += [("tp", a.tp)]
    dims = [(n, s) for n, s in dims if s > 1 or n in ("pp", "dp_shard")]
    mesh = init_device_mesh("cpu", [s for _, s in dims], mesh_dim_names=[n for n, _ in dims])
    pp = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp_shard"].get_local_rank()
    if a.dp_replicate > 1:
        dp_rank += a.dp_shard * mesh["dp_replicate"].get_local_rank()
    model = stage_model(pp, a.pp)
    parallelize(model, mesh)
    device = torch.device("cpu")
    stage = PipelineStage(model, pp, a.pp, device, group=mesh["pp"].get_group())
    schedule_cls = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(
        stage, n_microbatches=a.microbatches, loss_fn=nn.functional.cross_entropy
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    sampler = Sampler(dp_rank, a.dp_shard * a.dp_replicate)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(DATASET, WIDTH, generator=g)
    labels = torch.randint(0, CLASSES, (DATASET,), generator=g)
    torch.manual_seed(99 + pp)  # one seed per stage, the same on its DP ranks (as torchtitan)

    start, ft = 0, None
    if not a.unprotected:
        ft = baft.protect(  # baft
            schedule=schedule,
            stages=[stage],
            optimizer=optimizer,
            run_dir=a.out,
            device_mesh=mesh,
            checkpoint=checkpoint_config(a),
            ranks_per_node=a.ranks_per_node,
            state={"lr_scheduler": scheduler, "sampler": sampler},
        )
        start = ft.restore()  # baft: 0 on a fresh job, the restored version after a crash
    losses: dict[int, float] = {}
    for it in range(start, a.iterations):
        if a.dump_full:  # the state of version ``it``
            dump_full(model, optimizer, Path(a.dump_full) / f"v{it:08d}.pt")
        index = sampler.next_batch()
        optimizer.zero_grad()
        mb_losses: list[torch.Tensor] = []
        if pp == 0:
            schedule.step(inputs[index])
        elif pp == a.pp - 1:
            schedule.step(target=labels[index], losses=mb_losses)
        else:
            schedule.step()
        clip_grad_norm(list(model.parameters()), 1.0)
        optimizer.step()
        scheduler.step()
        if mb_losses:
            losses[it] = float(torch.stack(mb_losses).detach().mean())
    if a.dump_full:
        dump_full(model, optimizer, Path(a.dump_full) / f"v{a.iterations:08d}.pt")
    if ft is not None:
        ft.close()  # baft
    extra = {"scheduler": repr(scheduler.state_dict()), "sampler": sampler.state_dict()}
    extra["rng"] = sha(torch.get_rng_state())
    state = final_state(model, optimizer, extra)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"state.rank{dist.get_rank()}.json").write_text(json.dumps(state, indent=1))
    if losses and dist.get_rank() == dist.get_world_size() - 1:
        (out / f"losses.attempt{start}.json").write_text(json.dumps(losses))
    if dist.get_rank() == 0:
        (out / "final.json").write_text(json.dumps({"start": start, "pid": os.getpid()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    baft.run(main)  # baft: under `-m baft.inprocess`, survivors re-enter main() after a failure
