"""Redundancy traffic of one rank for one version: sends, receives, parity encoding.

The coding group's :class:`~baft.store.coding.GroupLayout` says which byte ranges of which
shard feed which region on which holder. Both ends enumerate the same transfers in the
same order and cut them into pieces of at most ``piece_bytes``, so the piece index is a
tag that matches sends to receives without any handshake. Receives are posted when the
version begins; each send is posted as soon as the snapshot has covered its bytes (in a
bubble); regions with a single input (replicas, xor over two nodes) are received straight
into the store, others into staging buffers and encoded when everything has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baft.engine.transport import Handle, Transport
from baft.store.coding import GroupLayout, Region


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
        self, layout: GroupLayout | None, rank: int, transport: Transport, piece_bytes: int
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.transport = transport
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
            (p for p in pieces if p.src == rank), key=lambda p: p.src_offset + p.nbytes
        )
        self.recvs = [p for p in pieces if p.dst == rank]
        self.regions: dict[int, Region] = (
            {r.region_id: r for r in layout.regions(rank)} if layout is not None else {}
        )
        # Regions fed by several inputs are staged, then encoded.
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        for r in self.regions.values():
            if len(r.sources) > 1:
                for i, seg in enumerate(r.sources):
                    self._staging[(r.region_id, i)] = torch.zeros(seg.nbytes, dtype=torch.uint8)
        self._handles: list[Handle] = []
        self._next_send = 0
        self._data: torch.Tensor | None = None
        self._red: torch.Tensor | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    def begin(self, data: torch.Tensor, red: torch.Tensor) -> None:
        """Start a version: remember its buffers, zero parity padding, post every receive."""
        self._data, self._red = data, red
        self._handles, self._next_send = [], 0
        self.bytes_sent = self.bytes_received = 0
        for r in self.regions.values():
            if len(r.sources) == 1:
                used = r.sources[0].nbytes
                red[r.offset + used : r.offset + r.nbytes].zero_()
        for p in self.recvs:
            self._handles.append(self.transport.irecv(self._recv_target(p), p.src, p.tag))
            self.bytes_received += p.nbytes

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
        self.transport.isend(
            self._data[p.src_offset : p.src_offset + p.nbytes], p.dst, p.tag
        ).wait()
        self.bytes_sent += p.nbytes

    def finish(self) -> int:
        """Send what is left, wait for every piece, encode staged regions; returns bytes encoded."""
        assert self._data is not None and self._red is not None
        for p in self.take_sends(self._data.numel()):  # normally none: the worker sent them
            self.send_now(p)
        for h in self._handles:
            h.wait()
        self._handles = []
        encoded = 0
        assert self.layout is not None or not self.regions
        red_np = self._red.numpy()
        for r in self.regions.values():
            if len(r.sources) > 1:
                assert self.layout is not None
                inputs = [self._staging[(r.region_id, i)].numpy() for i in range(len(r.sources))]
                self.layout.encode(r.region_id, inputs, out=red_np[r.offset : r.offset + r.nbytes])
                encoded += sum(s.nbytes for s in r.sources)
        return encoded
