"""Every DP replica's own small state, in every replica's flat state (:class:`ReplicaRecords`).

DP replicas hold the same model and optimizer bytes, and the planner splits a stage's
snapshot among them: each copies a share, the redundancy protects the shares, a restore
puts the stage back together from them. Their small state is not the same: each
replica's data loader reads its own shard, its counters and its RNG stream are its own.
One copy per stage would give every replica, after a restore, the copy of whichever
replica owned those bytes (a loader that silently re-reads another replica's shard).

So each per-replica record (``extra.state.<key>``, ``extra.rng.<device>``:
:func:`baft.plan.names.is_per_replica`) is in the layout once per replica, in dp order:
``extra.state.dp<d>.<key>``, ``extra.rng.dp<d>.cpu``. A replica's own copy is the live
record :class:`~baft.pipeline.state.TrainingState` captures into; the others are mirrors
that :meth:`ReplicaRecords.exchange` fills with the other replicas' own records, once per
version, before its snapshot starts (one point-to-point message to and from every other
replica of the stage). Every replica's flat state is then again the same bytes, which the
planner's split, the redundancy (parity, replicas on other nodes), a restore's replica
exchange and the DCP persister all rely on, and it holds every replica's records: they
are protected, persisted and restored like any other bytes of the stage, and a restore
gives each replica back its own (:meth:`TrainingState.apply` reads only its own copy).
The cost: ``num_dp - 1`` mirrors of this rank's records in memory and in the stage's
snapshot (split among the replicas like the rest), and the exchange's messages per
version. With one replica nothing changes: the same names, layout and digest.

No process group here: the exchange takes any point-to-point transport
(``isend``/``irecv`` with a tag, handles with ``wait()``; the engine's).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from baft.errors import refusal
from baft.plan import names

__all__ = ["REPLICA_TAG", "ReplicaRecords", "replicated_digest"]

REPLICA_TAG = (1 << 30) + 41
"""Tag of the exchange's messages: far from the redundancy pieces' and a restore's tags
(their positions, counted from 0)."""


class PointToPoint(Protocol):
    """What the exchange needs of a transport (``baft.engine.transport.Transport`` is one)."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any: ...


def replicated_digest(digest: str, num_dp: int) -> str:
    """The layout digest of a stage whose per-replica records are in the layout
    ``num_dp`` times (``digest`` itself with one replica): a checkpoint saved with another
    number of replicas holds other records, and a restore refuses it as another layout."""
    if num_dp == 1:
        return digest
    return hashlib.sha256(f"{digest}|replicas={num_dp}".encode()).hexdigest()


_COPY = re.compile(rf"^({re.escape(names.EXTRA_STATE)}|{re.escape(names.EXTRA_RNG)})dp\d+\.")
"""A replica's copy of a per-replica record (:func:`baft.plan.names.replica`)."""


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class ReplicaRecords:
    """One rank's layout with every DP replica's per-replica records, and the exchange
    that keeps the other replicas' copies (mirrors) current.

    ``named``: :meth:`TrainingState.tensors` (names without coordinates); ``replicas``:
    the ranks of this rank's replica group in dp order, ``rank`` among them. With
    ``num_replicas`` (virtual replicas, :mod:`baft.pipeline.elastic`) the layout holds
    that many copies whatever the number of ranks, each rank hosts ``num_replicas /
    len(replicas)`` consecutive ones, and their copies are tensors of their own (filled
    by :meth:`fill_hosted` at a version's start), not the live records.
    """

    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        rank: int,
        replicas: Sequence[int],
        num_replicas: int = 0,
    ) -> None:
        self.rank = rank
        self.replicas = tuple(replicas)
        if rank not in self.replicas:
            raise ValueError(f"rank {rank} is not among its replicas {self.replicas}")
        self.virtual = num_replicas > 0
        self.num_replicas = num_replicas or len(self.replicas)
        per_rank = self.num_replicas // len(self.replicas)
        self.host_of = [self.replicas[r // per_rank] for r in range(self.num_replicas)]
        """Virtual replica -> the rank that computes it."""
        self.hosted = [r for r in range(self.num_replicas) if self.host_of[r] == rank]
        self.dp = self.replicas.index(rank)
        self._named: list[tuple[str, torch.Tensor]] = []
        self._own: list[torch.Tensor] = []
        """This rank's per-replica records (live), layout order."""
        self.copies: dict[int, list[torch.Tensor]] = {r: [] for r in range(self.num_replicas)}
        """Virtual replica -> its copy of every per-replica record, layout order (without
        virtual replicas, this rank's own copies are the live records)."""
        self.own_names: dict[str, str] = {}
        """Layout name of each own record (the first hosted replica's) -> its
        :class:`TrainingState` name."""
        self.replica_sizes: dict[str, int] = {}
        """Layout name of every replica's copy of every per-replica record -> bytes."""
        for name, t in named:
            if self.num_replicas == 1 or not names.is_per_replica(name):
                self._named.append((name, t))
                continue
            self._own.append(t)
            for r in range(self.num_replicas):
                copy = names.replica(name, r)
                live = r in self.hosted and not self.virtual
                held = t if live else torch.zeros_like(t)
                if r == self.hosted[0]:
                    self.own_names[copy] = name
                self.copies[r].append(held)
                self.replica_sizes[copy] = t.numel() * t.element_size()
                self._named.append((copy, held))
        nbytes = sum(t.numel() * t.element_size() for t in self._own)
        self._peers = sorted({self.host_of[r] for r in range(self.num_replicas)} - {rank})
        self._send = torch.empty(nbytes * len(self.hosted), dtype=torch.uint8)
        self._recv = {
            peer: torch.empty(nbytes * self.host_of.count(peer), dtype=torch.uint8)
            for peer in self._peers
        }

    @property
    def num_dp(self) -> int:
        """The number of replicas in the layout (virtual ones when there are)."""
        return self.num_replicas

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The layout: :meth:`TrainingState.tensors` with every per-replica record once
        per replica (this replica's own copy is the live record), in canonical order."""
        return list(self._named)

    def fill_hosted(self, source: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """Virtual replicas: write every hosted replica's copies, ``source(r, live)``
        giving replica ``r``'s bytes of the record whose live tensor is ``live``."""
        if not self.virtual:
            return
        for r in self.hosted:
            for dst, live in zip(self.copies[r], self._own, strict=True):
                dst.copy_(source(r, live))

    def hosted_copy(self, r: int, live: torch.Tensor) -> torch.Tensor:
        """Replica ``r``'s copy of the record whose live tensor is ``live`` (with one
        replica, the layout holds the live record itself)."""
        if self.num_replicas == 1:
            return live
        i = next(i for i, t in enumerate(self._own) if t is live)
        return self.copies[r][i]

    def load_first_hosted(self) -> None:
        """Virtual replicas, after a restore wrote every copy: the live records take the
        first hosted replica's (what :meth:`TrainingState.apply` then loads)."""
        if self.virtual:
            for live, copy in zip(self._own, self.copies[self.hosted[0]], strict=True):
                live.copy_(copy)

    def exchange(self, transport: PointToPoint) -> None:
        """Send this rank's replicas' records to every other rank of the stage and write
        theirs into the mirrors (blocking; the transport bounds every wait). Every
        replica calls it at the same point of the same iteration (a version's start,
        after the small state was captured, before any snapshot copy of the version)."""
        if not self._peers or not self._own:
            return
        pos = 0
        for r in self.hosted:
            for t in self.copies[r]:
                b = _bytes_of(t)
                self._send[pos : pos + b.numel()].copy_(b)
                pos += b.numel()
        handles = [transport.irecv(buf, peer, REPLICA_TAG) for peer, buf in self._recv.items()]
        handles += [transport.isend(self._send, peer, REPLICA_TAG) for peer in self._peers]
        for h in handles:
            h.wait()
        for peer in self._peers:
            buf, pos = self._recv[peer], 0
            for r in (r for r in range(self.num_replicas) if self.host_of[r] == peer):
                for m in self.copies[r]:
                    b = _bytes_of(m)
                    b.copy_(buf[pos : pos + b.numel()])
                    pos += b.numel()

    def own_layout(self, saved: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """``saved`` (layout names without coordinates, bytes) as this replica's
        :class:`TrainingState` names it: the own copies renamed, the other replicas'
        dropped. Raises ValueError (a refusal) unless ``saved`` holds every replica's copy
        of every per-replica record with its size (a checkpoint of another number of
        replicas, or of one copy per stage, as baft wrote before per-replica records)."""
        saved = list(saved)
        if self.num_dp == 1:
            return saved
        sizes = dict(saved)
        differ = [n for n in self.replica_sizes if n not in sizes]
        differ += [n for n in sizes if _COPY.match(n) and n not in self.replica_sizes]
        resized = [
            f"{n} ({sizes[n]} -> {b} bytes)"
            for n, b in self.replica_sizes.items()
            if n in sizes and sizes[n] != b
        ]
        if differ or resized:
            what = []
            if differ:
                what.append(f"differ in {', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}")
            if resized:
                what.append(f"resized {', '.join(resized[:4])}")
            raise refusal(
                ValueError(
                    f"the saved small state does not hold the own records of all {self.num_dp} "
                    f"DP replicas ({'; '.join(what)}): it was saved with another number of "
                    "replicas, or by a baft that kept one copy per stage; nothing was restored"
                )
            )
        return [
            (self.own_names.get(n, n), b)
            for n, b in saved
            if n in self.own_names or n not in self.replica_sizes
        ]
