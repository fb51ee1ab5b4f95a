"""An in-process :class:`~baft.engine.transport.Transport`: ranks are threads of one process.

It lets the engine's exchange (and anything else written against the transport seam) be
tested in milliseconds without launching processes. Point-to-point messages are matched
by (source, destination, tag) like gloo's; a receive completes when the matching send has
copied its bytes into the receiver's buffer. Collectives meet at a barrier. Every wait
takes the transport's timeout, and a rank marked failed (``fail``) makes its peers' waits
raise at once, as a dead gloo peer's closed connection would.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch


class PeerFailed(RuntimeError):
    """A peer of this in-process group was marked failed."""


class _Mailbox:
    """State shared by the ranks of one in-process group."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.recvs: dict[tuple[int, int, int], tuple[torch.Tensor, threading.Event]] = {}
        self.sends: dict[tuple[int, int, int], tuple[torch.Tensor, threading.Event]] = {}
        self.failed: set[int] = set()
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)
        self.gathered: list[Any] = [None] * world_size


class _Handle:
    def __init__(self, box: _Mailbox, event: threading.Event, peer: int) -> None:
        self._box, self._event, self._peer = box, event, peer

    def wait(self) -> None:
        deadline = self._box.timeout_s
        step = 0.01
        waited = 0.0
        while not self._event.wait(step):
            if self._peer in self._box.failed:
                raise PeerFailed(f"peer rank {self._peer} failed")
            waited += step
            if waited >= deadline:
                raise TimeoutError(f"no message from/to rank {self._peer} in {deadline} s")


class LocalTransport:
    """One rank's end of an in-process group (see the module docstring)."""

    def __init__(self, box: _Mailbox, rank: int) -> None:
        self._box = box
        self.rank = rank
        self.world_size = box.world_size

    @staticmethod
    def group(world_size: int, timeout_s: float = 10.0) -> list[LocalTransport]:
        """Transports of ranks ``0 .. world_size - 1`` of a new in-process group."""
        box = _Mailbox(world_size, timeout_s)
        return [LocalTransport(box, r) for r in range(world_size)]

    def fail(self) -> None:
        """This rank dies: its peers' pending and future waits on it raise PeerFailed."""
        self._box.failed.add(self.rank)
        self._box.barrier.abort()

    def _match(self, key: tuple[int, int, int], tensor: torch.Tensor, sending: bool) -> _Handle:
        box = self._box
        peer = key[1] if sending else key[0]
        with box.cond:
            other = (box.recvs if sending else box.sends).pop(key, None)
            if other is None:
                event = threading.Event()
                (box.sends if sending else box.recvs)[key] = (tensor, event)
                return _Handle(box, event, peer)
            dst, src = (other[0], tensor) if sending else (tensor, other[0])
            dst.copy_(src)
            other[1].set()
        done = threading.Event()
        done.set()
        return _Handle(box, done, peer)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _Handle:
        return self._match((self.rank, dst, tag), tensor, sending=True)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> _Handle:
        return self._match((src, self.rank, tag), tensor, sending=False)

    def _meet(self) -> None:
        try:
            self._box.barrier.wait()
        except threading.BrokenBarrierError:
            raise PeerFailed("a peer failed during a collective") from None

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._box.gathered[self.rank] = obj
        self._meet()
        out = list(self._box.gathered)
        self._meet()
        return out

    def all_min_async(self, values: list[int]) -> _Vote:
        """Every rank meets when it waits (ranks resolve votes in the same order)."""
        return _Vote(self, list(values))

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """No threads of its own to raise."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing to release in process."""


class _Vote:
    def __init__(self, transport: LocalTransport, values: list[int]) -> None:
        self._transport, self._values = transport, values

    def wait(self) -> list[int]:
        everyone = self._transport.all_gather_object(self._values)
        return [int(min(col)) for col in zip(*everyone, strict=True)]
