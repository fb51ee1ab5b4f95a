"""The one transport seam: point-to-point bytes and tiny agreements between ranks.

Checkpoint traffic runs on its own gloo process group, created once at start-up, so it
never queues behind (or deadlocks with) the pipeline's p2p and the DP all-reduce; the
reference measurements show a separate gloo group runs alongside the pipeline's without
trouble. Every call that can block is bounded by the timeout: collectives by the group's,
point-to-point handles by an explicit ``Work.wait(timeout)`` (gloo does not apply the
group's timeout to the wait of a send or receive, which would otherwise block forever on
a frozen peer).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Handle(Protocol):
    def wait(self) -> Any: ...


class VoteHandle(Protocol):
    def wait(self) -> list[int]: ...


class Transport(Protocol):
    """What the engine and the restore runtime need from the network."""

    rank: int
    world_size: int

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle: ...

    def all_min_async(self, values: list[int]) -> VoteHandle:
        """Start an elementwise MIN over every rank's ``values``; ``wait()`` returns it."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def close(self) -> None:
        """No more traffic from this rank (after the last agreement)."""
        ...


def destroy_group(group: Any) -> None:
    """Destroy a process group this process made for itself, now (not collective).

    A gloo group's worker threads drop their reference to a finished collective's
    tensors a moment after ``wait()`` returns; a tensor made in Python needs the GIL for
    that. If the interpreter is already shutting down, the thread is ended mid-release
    and the process aborts ("terminate called without an active exception": what CI saw
    once as a rank exited after its job's last commit vote; pytorch#179291 describes the
    same abort). ``destroy_process_group(group)`` only forgets
    the group; the caller must also drop its own reference, which joins those threads
    while the interpreter is alive."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # already forgotten: the user destroyed every group first
        pass


class TimedWork:
    """A send/receive handle whose ``wait()`` gives up after ``timeout_s`` seconds."""

    __slots__ = ("work", "timeout_s", "what")

    def __init__(self, work: Any, timeout_s: float, what: str) -> None:
        self.work = work
        self.timeout_s = timeout_s
        self.what = what

    def wait(self) -> Any:
        try:
            return self.work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            raise TimeoutError(
                f"checkpoint {self.what} got no answer in {self.timeout_s:g} s: "
                f"the peer stopped responding ({e})"
            ) from e


class _MinVote:
    """An all-reduce in flight; ``wait`` is bounded by the group's timeout."""

    def __init__(self, work: Any, t: torch.Tensor) -> None:
        self.work, self.t = work, t

    def wait(self) -> list[int]:
        self.work.wait()
        return [int(x) for x in self.t.tolist()]


class GlooTransport:
    """Transport over a dedicated gloo group spanning every rank."""

    def __init__(self, timeout_s: float) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        assert dist.get_group_rank(self.group, self.rank) == self.rank

    # Sends and receives go to the group object itself: ``dist.isend``'s Python checks
    # and rank mapping held the GIL for ~0.1 ms per piece (py-spy: the protect worker's
    # most frequent frame holding the GIL); the group spans every rank in order, so a
    # rank is its group rank.
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        work = self.group.send([tensor], dst, tag)
        return TimedWork(work, self.timeout_s, f"send to rank {dst}")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        work = self.group.recv([tensor], src, tag)
        return TimedWork(work, self.timeout_s, f"receive from rank {src}")

    def all_min_async(self, values: list[int]) -> VoteHandle:
        t = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        assert work is not None
        return _MinVote(work, t)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        """Destroy the group (see :func:`destroy_group`); the transport is unusable after."""
        group, self.group = self.group, None
        destroy_group(group)
