"""Redundancy traffic of one rank for one version: sends, receives, parity encoding.

The coding group's :class:`~baft.store.coding.GroupLayout` says which byte ranges of which
shard feed which region on which holder. Both ends enumerate the same transfers in the
same order and cut them into pieces of at most ``piece_bytes``, so the piece index is a
tag that matches sends to receives without any handshake. Receives are posted when the
version begins; each send is posted as soon as the snapshot has covered its bytes (in a
bubble); regions with a single input (replicas, xor over two nodes) are received straight
into the store, others into staging buffers and encoded when everything has arrived.

Move bytes once: a sender on the same host as the holder (``peers``) sends nothing. The
holder pulls those pieces from the sender's store mapping (:class:`~baft.store.peer.
PeerStore`) as soon as the sender's published progress covers them (``pull_ready``, run
in bubbles by the engine's worker), hashing each piece as it copies it, and parity
regions encode straight from the senders' mappings without staging copies. Only pieces
between hosts use the transport. Which path each byte took is counted (``bytes_pulled``
vs ``bytes_sent``/``bytes_received``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import xxhash

from baft.engine.transport import Handle, Transport
from baft.liveness.generation import check_aborted
from baft.store.coding import GroupLayout, Region
from baft.store.hashing import copy_hashing
from baft.store.manifest import checksum
from baft.store.peer import PeerStore


class Background(Protocol):
    """Where hashing of received pieces runs: the protect worker (its gate, its priority)."""

    def submit(self, item: Callable[[], None]) -> None: ...

    def drain(self) -> None: ...


class PeerStoreGone(RuntimeError):
    """A same-host sender's store was removed while this rank waited for its bytes: the
    version cannot complete here (this rank votes it incomplete; the job goes on)."""


@dataclass(frozen=True, slots=True)
class _Piece:
    tag: int
    src: int
    dst: int
    src_offset: int
    nbytes: int
    region_id: int
    input_index: int
    input_offset: int
    """Offset of this piece inside its transfer (= inside the region input)."""


class RedundancyExchange:
    """Moves and encodes one version's redundancy for ``rank``."""

    def __init__(
        self,
        layout: GroupLayout | None,
        rank: int,
        transport: Transport,
        piece_bytes: int,
        *,
        peers: Mapping[int, PeerStore] | None = None,
        timeout_s: float = 60.0,
        background: Background | None = None,
    ) -> None:
        self.layout = layout
        self.background = background
        """Hashes pieces received over the network as they arrive (else: at ``finish``)."""
        self.rank = rank
        self.transport = transport
        self.timeout_s = timeout_s
        self.peers: dict[int, PeerStore] = dict(peers or {})
        """Ranks on this host (other than ``rank``) -> their store, read in place."""
        local = set(self.peers)
        pieces: list[_Piece] = []
        if layout is not None:
            for t in layout.transfers():
                for off in range(0, t.nbytes, piece_bytes):
                    n = min(piece_bytes, t.nbytes - off)
                    pieces.append(
                        _Piece(
                            len(pieces),
                            t.src_rank,
                            t.dst_rank,
                            t.src_offset + off,
                            n,
                            t.dst_region_id,
                            t.input_index,
                            off,
                        )
                    )
        self.sends = sorted(
            (p for p in pieces if p.src == rank and p.dst not in local),
            key=lambda p: p.src_offset + p.nbytes,
        )
        self.recvs = [p for p in pieces if p.dst == rank and p.src not in local]
        self.regions: dict[int, Region] = (
            {r.region_id: r for r in layout.regions(rank)} if layout is not None else {}
        )
        same_host = [p for p in pieces if p.dst == rank and p.src in local]
        # Single-input regions are copied piece by piece as the sender progresses; inputs
        # of encoded regions are read in place at the end.
        self._pulls: dict[int, list[_Piece]] = {}
        self._local_inputs: dict[tuple[int, int], _Piece] = {}
        """(region, input index) -> the whole input, read in place from the sender."""
        for p in same_host:
            region = self.regions[p.region_id]
            if len(region.sources) == 1:
                self._pulls.setdefault(p.src, []).append(p)
            elif p.input_offset == 0:
                seg = region.sources[p.input_index]
                whole = dataclasses.replace(p, src_offset=seg.offset, nbytes=seg.nbytes)
                self._local_inputs[(p.region_id, p.input_index)] = whole
        for queue in self._pulls.values():
            queue.sort(key=lambda p: p.src_offset)
        # Regions fed by several inputs over the network are staged, then encoded.
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        for p in self.recvs:
            region = self.regions[p.region_id]
            if len(region.sources) > 1 and (p.region_id, p.input_index) not in self._staging:
                seg = region.sources[p.input_index]
                self._staging[(p.region_id, p.input_index)] = torch.zeros(
                    seg.nbytes, dtype=torch.uint8
                )
        self._handles: list[Handle] = []
        self._arrivals: threading.Thread | None = None
        self._arrival_error: BaseException | None = None
        self._next_send = 0
        self._next_pull: dict[int, int] = {}
        self._hashers: dict[int, xxhash.xxh3_64] = {}
        self._version = -1
        self._data: torch.Tensor | None = None
        self._red: torch.Tensor | None = None
        self.region_checksums: dict[int, int] = {}
        """Checksums computed on the way (pulled or encoded regions) for the manifest."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bytes_pulled = 0
        self.seconds = {"send": 0.0, "pull": 0.0, "recv_wait": 0.0, "encode": 0.0}

    def paths(self) -> dict[str, int]:
        """Bytes this rank receives per version by path: ``shm`` (same host), ``net``."""
        return {
            "shm": sum(p.nbytes for q in self._pulls.values() for p in q)
            + sum(p.nbytes for p in self._local_inputs.values()),
            "net": sum(p.nbytes for p in self.recvs),
        }

    def begin(self, data: torch.Tensor, red: torch.Tensor, version: int = -1) -> None:
        """Start a version: remember its buffers, zero parity padding, post every receive."""
        self._data, self._red, self._version = data, red, version
        self._handles, self._next_send = [], 0
        self._next_pull = dict.fromkeys(self._pulls, 0)
        self._hashers = {}
        self.region_checksums = {}
        self.bytes_sent = self.bytes_received = self.bytes_pulled = 0
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        for r in self.regions.values():
            if len(r.sources) == 1:
                used = r.sources[0].nbytes
                red[r.offset + used : r.offset + r.nbytes].zero_()
        self.bytes_received = sum(p.nbytes for p in self.recvs)
        self._arrivals, self._arrival_error = None, None
        if self.background is None or not self.recvs:
            self._handles = [self._post_recv(p) for p in self.recvs]
            return
        self._arrivals = threading.Thread(
            target=self._await_arrivals, args=(self.background,), name="baft-recv", daemon=True
        )
        self._arrivals.start()

    def _post_recv(self, p: _Piece) -> Handle:
        return self.transport.irecv(self._recv_target(p), p.src, p.tag)

    def _await_arrivals(self, bg: Background) -> None:
        """Post the version's receives, wait for each piece in order and queue its hashing
        on the protect worker: the training thread neither posts them (a gloo irecv call
        took 0.4-12 ms for 17 pieces here, under load) nor hashes the received bytes in
        one pass at the optimizer step (gloo writes them on its own threads; nobody else
        touches them). This thread only posts and waits."""
        try:
            for p in self.recvs:
                h = self._post_recv(p)
                self._handles.append(h)
            for p, h in zip(self.recvs, list(self._handles), strict=True):
                h.wait()
                if len(self.regions[p.region_id].sources) == 1:
                    bg.submit(functools.partial(self._hash_received, p))
        except BaseException as e:  # noqa: BLE001 - re-raised by finish()
            self._arrival_error = e

    def _hash_received(self, p: _Piece) -> None:
        assert self._red is not None
        lo = self.regions[p.region_id].offset + p.input_offset
        hasher = self._hashers.setdefault(p.region_id, xxhash.xxh3_64())
        hasher.update(self._red.numpy()[lo : lo + p.nbytes].data)

    def _recv_target(self, p: _Piece) -> torch.Tensor:
        region = self.regions[p.region_id]
        if len(region.sources) == 1:
            assert self._red is not None
            start = region.offset + p.input_offset
            return self._red[start : start + p.nbytes]
        buf = self._staging[(p.region_id, p.input_index)]
        return buf[p.input_offset : p.input_offset + p.nbytes]

    def take_sends(self, covered: int) -> list[_Piece]:
        """Claim the not yet sent pieces within the first ``covered`` shard bytes."""
        out = []
        while self._next_send < len(self.sends):
            p = self.sends[self._next_send]
            if p.src_offset + p.nbytes > covered:
                break
            out.append(p)
            self._next_send += 1
        return out

    def send_now(self, p: _Piece) -> None:
        """Send one claimed piece and wait until it has left (on the caller's thread)."""
        assert self._data is not None
        start = time.perf_counter()
        self.transport.isend(
            self._data[p.src_offset : p.src_offset + p.nbytes], p.dst, p.tag
        ).wait()
        self.seconds["send"] += time.perf_counter() - start
        self.bytes_sent += p.nbytes

    # ------------------------------------------------------------ same host
    def _final(self, p: _Piece, progress: dict[int, tuple[int, int] | None]) -> np.ndarray | None:
        """The sender's bytes of ``p`` if its published progress says they are final."""
        if p.src not in progress:
            progress[p.src] = self.peers[p.src].covered(self._version)
        cov = progress[p.src]
        if cov is None or cov[1] < p.src_offset + p.nbytes:
            return None
        data = self.peers[p.src].data(cov[0])
        if data is None or data.size < p.src_offset + p.nbytes:
            return None
        return data[p.src_offset : p.src_offset + p.nbytes]

    def pull_ready(self) -> int:
        """Copy every same-host piece whose bytes are final into the store (never waits);
        each piece is hashed as it is copied. Returns the bytes copied."""
        if not self._pulls or self._red is None:
            return 0
        start = time.perf_counter()
        red = self._red.numpy()
        progress: dict[int, tuple[int, int] | None] = {}
        copied = 0
        for src, queue in self._pulls.items():
            i = self._next_pull[src]
            while i < len(queue):
                p = queue[i]
                got = self._final(p, progress)
                if got is None:
                    break
                region = self.regions[p.region_id]
                lo = region.offset + p.input_offset
                hasher = self._hashers.setdefault(p.region_id, xxhash.xxh3_64())
                copy_hashing(hasher, p.nbytes, functools.partial(_copy_block, red, lo, got))
                copied += p.nbytes
                i += 1
            self._next_pull[src] = i
        self.bytes_pulled += copied
        self.seconds["pull"] += time.perf_counter() - start
        return copied

    def _pulls_left(self) -> bool:
        return any(self._next_pull[s] < len(q) for s, q in self._pulls.items())

    def _wait_same_host(self) -> None:
        """Pull what is left, waiting (bounded by the timeout) for senders' progress."""
        start = time.perf_counter()
        deadline = start + self.timeout_s
        pause = 1e-4
        while True:
            self.pull_ready()
            progress: dict[int, tuple[int, int] | None] = {}
            waiting = [p for p in self._local_inputs.values() if self._final(p, progress) is None]
            if not self._pulls_left() and not waiting:
                break
            late = sorted(
                {p.src for p in waiting}
                | {s for s, q in self._pulls.items() if self._next_pull[s] < len(q)}
            )
            gone = [s for s in late if self.peers[s].gone()]
            if gone:
                raise PeerStoreGone(
                    f"rank {self.rank}: the store of same-host peer(s) {gone} was removed "
                    f"while v{self._version} was protected"
                )
            check_aborted()  # an in-process recovery began: no socket to shut here
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: same-host peers {late} did not finish v{self._version} "
                    f"within {self.timeout_s} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        self.seconds["recv_wait"] += time.perf_counter() - start

    # ------------------------------------------------------------ finish
    def _wait_arrivals(self) -> None:
        """Every network receive of the version has landed (and, with a background, its
        hashing has run)."""
        if self._arrivals is None:
            for h in self._handles:
                h.wait()
            return
        # each receive's wait is bounded by the transport's timeout; this only guards that
        self._arrivals.join(self.timeout_s * (len(self._handles) + 1))
        if self._arrivals.is_alive():
            raise TimeoutError(f"rank {self.rank}: receives of v{self._version} never ended")
        if self._arrival_error is not None:
            raise self._arrival_error
        assert self.background is not None
        self.background.drain()

    def _input(self, region: Region, index: int, progress: dict) -> np.ndarray:
        staged = self._staging.get((region.region_id, index))
        if staged is not None:
            return staged.numpy()
        if region.sources[index].nbytes == 0:  # an empty segment: no piece carries it
            return np.zeros(0, np.uint8)
        got = self._final(self._local_inputs[(region.region_id, index)], progress)
        assert got is not None, "same-host input not final after waiting"
        return got

    def finish(self) -> int:
        """Send what is left, wait for every piece, encode staged regions; returns bytes encoded."""
        assert self._data is not None and self._red is not None
        for p in self.take_sends(self._data.numel()):  # normally none: the worker sent them
            self.send_now(p)
        start = time.perf_counter()
        self._wait_arrivals()
        self._handles = []
        self.seconds["recv_wait"] += time.perf_counter() - start
        self._wait_same_host()
        encoded = 0
        assert self.layout is not None or not self.regions
        red_np = self._red.numpy()
        start = time.perf_counter()
        progress: dict[int, tuple[int, int] | None] = {}
        for r in self.regions.values():
            out = red_np[r.offset : r.offset + r.nbytes]
            if len(r.sources) > 1:
                assert self.layout is not None
                inputs = [self._input(r, i, progress) for i in range(len(r.sources))]
                self.layout.encode(r.region_id, inputs, out=out)
                self.region_checksums[r.region_id] = checksum(out)  # still in cache
                encoded += sum(s.nbytes for s in r.sources)
            elif r.region_id in self._hashers:  # pulled: hashed on the way, plus padding
                hasher = self._hashers[r.region_id]
                hasher.update(out[r.sources[0].nbytes :].data)
                self.region_checksums[r.region_id] = hasher.intdigest()
            elif r.sources[0].nbytes == 0:  # an empty segment: the region is its padding
                self.region_checksums[r.region_id] = checksum(out)
        self.seconds["encode"] += time.perf_counter() - start
        return encoded


def _copy_block(red: np.ndarray, at: int, got: np.ndarray, lo: int, hi: int) -> memoryview:
    """Copy bytes ``[lo, hi)`` of a pulled piece to ``red[at + lo : at + hi]``; the
    copied bytes, for hashing."""
    dst = red[at + lo : at + hi]
    np.copyto(dst, got[lo:hi])
    return dst.data
