"""The one transport seam: point-to-point bytes and tiny agreements between ranks.

Checkpoint traffic runs on its own gloo process group, created once at start-up, so it
never queues behind (or deadlocks with) the pipeline's p2p and the DP all-reduce; the
reference measurements show a separate gloo group runs alongside the pipeline's without
trouble. Every call that can block takes a timeout (the group's).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Handle(Protocol):
    def wait(self) -> Any: ...


class Transport(Protocol):
    """What the engine and the restore runtime need from the network."""

    rank: int
    world_size: int

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle: ...

    def all_min(self, value: int) -> int: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class GlooTransport:
    """Transport over a dedicated gloo group spanning every rank."""

    def __init__(self, timeout_s: float) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        work = dist.isend(tensor, dst, group=self.group, tag=tag)
        assert work is not None
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        work = dist.irecv(tensor, src, group=self.group, tag=tag)
        assert work is not None
        return work

    def all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        dist.broadcast(tensor, src, group=group or self.group)
