"""A rank's checkpointable state seen as one flat byte range.

The flat state is the concatenation (canonical order, no padding) of the raw bytes of
every tensor the trainer yields from ``named_state()``. Chunks and DP-shard ownership are
byte ranges of it; :meth:`FlatState.pieces` maps a range to (tensor, offset, length)
pieces once, so the per-iteration copy loop does no lookups.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from baft.engine.device import Pair
from baft.pipeline.encoding import typed_view as typed_view
from baft.plan.types import TensorSpec


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage (0-d tensors included)."""
    if not t.is_contiguous():
        raise ValueError("checkpointed tensors must be contiguous")
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass(frozen=True, slots=True)
class Piece:
    """``nbytes`` bytes at ``tensor_offset`` of tensor ``index``, at ``out_offset`` of the range."""

    index: int
    tensor_offset: int
    out_offset: int
    nbytes: int


class FlatState:
    """Named tensors laid end to end as one byte range."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.offsets: list[int] = []
        pos = 0
        for name, t in named:
            self.names.append(name)
            self.tensors.append(t)
            self.offsets.append(pos)
            pos += t.numel() * t.element_size()
        self.nbytes = pos
        self._views = [byte_view(t) for t in self.tensors]

    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(name=n, nbytes=t.numel() * t.element_size())
            for n, t in zip(self.names, self.tensors, strict=True)
        )

    def pieces(self, start: int, stop: int) -> tuple[Piece, ...]:
        """The tensor pieces covering flat bytes ``[start, stop)``."""
        if not 0 <= start <= stop <= self.nbytes:
            raise ValueError(f"range [{start}, {stop}) outside flat state of {self.nbytes} bytes")
        out = []
        i = max(0, bisect.bisect_right(self.offsets, start) - 1)
        pos = start
        while pos < stop and i < len(self.tensors):
            t_start = self.offsets[i]
            t_stop = t_start + self._views[i].numel()
            if t_stop > pos:
                n = min(stop, t_stop) - pos
                out.append(Piece(i, pos - t_start, pos - start, n))
                pos += n
            i += 1
        return tuple(out)

    def view(self, piece: Piece) -> torch.Tensor:
        """The live bytes of one piece (a view: writes go into the tensor)."""
        return self._views[piece.index][piece.tensor_offset : piece.tensor_offset + piece.nbytes]

    def pairs(self, pieces: tuple[Piece, ...], out: torch.Tensor) -> list[Pair]:
        """(destination in ``out``, live source) views of ``pieces``, in ``out`` order:
        what a :class:`~baft.engine.device.DeviceCopy` copies for one chunk."""
        return [(out[p.out_offset : p.out_offset + p.nbytes], self.view(p)) for p in pieces]

    def write_from(self, start: int, data: torch.Tensor) -> None:
        """Overwrite flat bytes ``[start, start + len(data))`` of the live tensors."""
        for p in self.pieces(start, start + data.numel()):
            self.view(p).copy_(data[p.out_offset : p.out_offset + p.nbytes])
