"""The one transport seam: point-to-point bytes and tiny agreements between ranks.

Checkpoint traffic runs on its own gloo process group, created once at start-up, so it
never queues behind (or deadlocks with) the pipeline's p2p and the DP all-reduce; the
reference measurements show a separate gloo group runs alongside the pipeline's without
trouble. Every call that can block is bounded by the timeout: collectives by the group's,
point-to-point handles by an explicit ``Work.wait(timeout)`` (gloo does not apply the
group's timeout to the wait of a send or receive, which would otherwise block forever on
a frozen peer).

The group's own threads (gloo's I/O loop and its work threads) run at idle CPU priority
like baft's background threads, raised while the training thread waits on them
(:meth:`GlooTransport.waiting`; :class:`baft.engine.priority.ForeignThreads`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from baft.engine.priority import ForeignThreads


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

    def waiting(self) -> ContextManager[None]:
        """Around a wait of the training thread on this transport's traffic (its threads
        at normal priority meanwhile)."""
        ...

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

    __slots__ = ("work", "timeout_s", "what", "waiting")

    def __init__(
        self,
        work: Any,
        timeout_s: float,
        what: str,
        waiting: Callable[[], ContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.work = work
        self.timeout_s = timeout_s
        self.what = what
        self.waiting = waiting

    def wait(self) -> Any:
        try:
            with self.waiting():
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

    def __init__(
        self, work: Any, t: torch.Tensor, waiting: Callable[[], ContextManager[None]]
    ) -> None:
        self.work, self.t, self.waiting = work, t, waiting

    def wait(self) -> list[int]:
        with self.waiting():
            self.work.wait()
        return [int(x) for x in self.t.tolist()]


def _task_ids() -> set[int]:
    """Native ids of this process's threads (empty where ``/proc`` has none)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


class GlooTransport:
    """Transport over a dedicated gloo group spanning every rank."""

    def __init__(self, timeout_s: float) -> None:
        before = _task_ids()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # the threads the group started (gloo's tcp loop and its two work threads; a
        # thread another started meanwhile would only be lowered too, and raised at waits)
        self.threads = ForeignThreads(sorted(_task_ids() - before))
        self._owner = threading.get_ident()
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
        return TimedWork(work, self.timeout_s, f"send to rank {dst}", self.waiting)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        work = self.group.recv([tensor], src, tag)
        return TimedWork(work, self.timeout_s, f"receive from rank {src}", self.waiting)

    def waiting(self) -> ContextManager[None]:
        """The group's threads at normal priority while the training thread (the one
        that made the transport) waits; other threads' waits (the protect worker's, at
        idle priority itself) leave them idle."""
        if threading.get_ident() != self._owner:
            return contextlib.nullcontext()
        return self.threads.boosted()

    def all_min_async(self, values: list[int]) -> VoteHandle:
        t = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        assert work is not None
        return _MinVote(work, t, self.waiting)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with self.waiting():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def close(self) -> None:
        """Destroy the group (see :func:`destroy_group`); the transport is unusable after."""
        group, self.group = self.group, None
        destroy_group(group)
