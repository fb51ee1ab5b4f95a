"""The data-parallel job the peers' recovery rows train (torchft, NVRx's in-process Wrapper).

Both peers protect data-parallel replicas, not pipeline stages: torchft's unit of
redundancy is a replica group, NVRx restarts a function that rebuilds its state. So their
job is the recovery bench's model (the reference GPT, same layers, width, seed, AdamW and
byte-level data), whole on each of two DP replicas: replica ``r`` trains on rows
``[2r, 2r + 2)`` of global batch ``step`` (the recovery bench's global batch of 4), and a
step's gradient is the mean over the replicas that took part. The state per replica is the
whole model and its optimizer (twice a pipeline rank's).

Pure torch; no process group here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from baft.model.config import ModelConfig
from baft.model.gpt import build_stage_module, loss_fn
from baft.train.data import ByteDataSource

REPLICAS = 2
GLOBAL_BATCH = 4


@dataclass(frozen=True)
class DPJob:
    """What every replica builds; ``lr``, ``weight_decay`` and ``seed`` are
    :class:`baft.train.config.TrainConfig`'s defaults."""

    layers: int
    d_model: int
    seq_len: int = 32
    num_heads: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        cfg = ModelConfig(
            num_layers=self.layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            seq_len=self.seq_len,
        )
        module = build_stage_module(cfg, 0, 1, self.seed)  # one stage: the whole model
        opt = torch.optim.AdamW(
            module.parameters(), lr=self.lr, weight_decay=self.weight_decay, foreach=False
        )
        return module, opt

    def data(self) -> ByteDataSource:
        return ByteDataSource(seq_len=self.seq_len, global_batch=GLOBAL_BATCH, seed=self.seed)


def replica_batch(
    data: ByteDataSource, step: int, replica: int, replicas: int = REPLICAS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s rows of global batch ``step`` (a pure function of both)."""
    x, y = data.batch(step)
    per = GLOBAL_BATCH // replicas
    sl = slice(replica * per, (replica + 1) * per)
    return x[sl].contiguous(), y[sl].contiguous()


def forward_backward(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = loss_fn(module(x), y)
    loss.backward()
    return float(loss.detach())


def state_tensors(module: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the replica's state, in a fixed order: parameters, buffers, then
    each parameter's optimizer state (``step``, ``exp_avg``, ``exp_avg_sq``)."""
    out = [(f"model.{n}", p.detach()) for n, p in module.named_parameters()]
    out += [(f"buffer.{n}", b) for n, b in module.named_buffers()]
    for n, p in module.named_parameters():
        for k, v in sorted(opt.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out.append((f"optim.{n}.{k}", v))
    return out


def state_digest(module: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over the names and bytes of :func:`state_tensors`: equal digests mean a
    bit-identical state."""
    h = hashlib.sha256()
    for name, t in state_tensors(module, opt):
        c = t.detach().contiguous().cpu()
        h.update(f"{name}:{c.dtype}:{tuple(c.shape)}\n".encode())
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_bytes(module: nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for _, t in state_tensors(module, opt))


def state_dict(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": module.state_dict(), "optim": opt.state_dict()}


def load_state_dict(module: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    module.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def replay(
    job: DPJob, schedule: list[tuple[int, list[int], int]]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The job's trajectory in one process, step by step: the gradients of the listed
    replicas' rows summed (as an allreduce of one flat buffer does), divided by the
    divisor, then the optimizer step. One intra-op thread, as the workers: a matmul's
    bits depend on how many threads split it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay(job, schedule)
    finally:
        torch.set_num_threads(threads)


def _replay(
    job: DPJob, schedule: list[tuple[int, list[int], int]]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    module, opt = job.build()
    data = job.data()
    params = list(module.parameters())
    for step, replicas, divisor in schedule:
        total: torch.Tensor | None = None
        for r in replicas:
            opt.zero_grad()
            forward_backward(module, *replica_batch(data, step, r))
            flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            total = flat if total is None else total + flat
        assert total is not None, f"step {step}: no replica's gradient"
        total /= divisor
        off = 0
        for p in params:
            n = p.numel()
            p.grad = total[off : off + n].view_as(p).clone()
            off += n
        opt.step()
    return module, opt
