"""Differential payloads at run time: the gradient record and the version's byte views.

:class:`PayloadViews` maps a :class:`~baft.plan.payload.PayloadLayout` (names and sizes)
onto the live tensors: for version ``v`` a :class:`~baft.engine.flat.FlatState` over the
always-tensors, the record meta blob, the gradients of step ``v - 1`` and the tensors of
slice ``v % k``, padded to the payload size, so the executor copies a payload exactly as
it copies a full snapshot (same tasks, chunks, copier and redundancy).

:class:`RecordCapture` takes the record at the optimizer step: the gradients *by
reference* (the step runner zeroes gradients with ``set_to_none``, so the next backward
allocates new tensors and the captured ones stay as the optimizer read them; copying
them happens in the next iteration's bubbles, never at the step), and every param
group's hyperparameters, encoded exactly (no pickle).
"""

from __future__ import annotations

import torch

from baft.engine.flat import FlatState
from baft.pipeline.encoding import local as _local
from baft.pipeline.record import Record, encode_meta
from baft.pipeline.record import decode_meta as decode_meta
from baft.pipeline.state import encode_hypers, param_group_hypers
from baft.plan.payload import GRAD_PREFIX, RECORD_META, PayloadLayout


class RecordCapture:
    """Captures the record of each optimizer step (call :meth:`take` just before it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params
        """Group (parameter FQN) -> the parameter."""
        self.last: Record | None = None

    def take(self, step: int) -> None:
        grads = {
            g: (_local(p.grad).detach() if p.grad is not None else None)
            for g, p in self.params.items()
        }
        hypers = encode_hypers(param_group_hypers(self.optimizer))
        scaler = {
            k: t.detach().clone()
            for k in ("grad_scale", "found_inf")
            if isinstance(t := getattr(self.optimizer, k, None), torch.Tensor)
        }
        self.last = Record(step, grads, hypers, scaler or None)

    def for_version(self, version: int) -> Record | None:
        """The record a payload of ``version`` carries: that of step ``version - 1``."""
        return self.last if self.last is not None and self.last.step == version - 1 else None


class PayloadViews:
    """Live tensors of every payload of this rank."""

    def __init__(self, layout: PayloadLayout, named: list[tuple[str, torch.Tensor]]) -> None:
        self.layout = layout
        self.tensors = dict(named)
        missing = [
            s.name
            for s in (*layout.always, *(m for g in layout.groups for m in layout.members[g]))
            if s.name not in self.tensors
        ]
        if missing:
            raise ValueError(f"payload layout names tensors this rank lacks: {missing[:5]}")
        self._zeros = torch.zeros(
            max((s.nbytes for s in layout.grads), default=0), dtype=torch.uint8
        )
        self._pad = torch.zeros(layout.nbytes, dtype=torch.uint8)
        self.meta = torch.zeros(layout.meta_nbytes, dtype=torch.uint8)

    def flat(self, version: int, record: Record | None) -> FlatState:
        """The payload of ``version`` over live tensors (and ``record``'s gradients)."""
        lay = self.layout
        self.meta.copy_(encode_meta(record, lay.meta_nbytes))
        named: list[tuple[str, torch.Tensor]] = [(s.name, self.tensors[s.name]) for s in lay.always]
        named.append((RECORD_META, self.meta))
        for s in lay.grads:
            g = record.grads.get(s.name[len(GRAD_PREFIX) :]) if record is not None else None
            named.append((s.name, g if g is not None else self._zeros[: s.nbytes]))
        named += [(s.name, self.tensors[s.name]) for s in lay.slice_members(version % lay.k)]
        used = sum(t.numel() * t.element_size() for _, t in named)
        if used < lay.nbytes:
            named.append(("pad", self._pad[: lay.nbytes - used]))
        return FlatState(named)
