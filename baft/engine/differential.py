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

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from baft.engine.flat import FlatState
from baft.pipeline.encoding import decode_value, encode_value
from baft.pipeline.state import decode_hypers, encode_hypers, param_group_hypers
from baft.plan.payload import GRAD_PREFIX, RECORD_META, PayloadLayout


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Record:
    """The record of optimizer step ``step`` as captured (references, not copies)."""

    step: int
    grads: dict[str, torch.Tensor | None]
    """Group (parameter FQN) -> its gradient as the optimizer read it, None if it had none."""
    hypers: bytes
    """Every param group's hyperparameters at the step (``encode_hypers``)."""
    scaler: dict[str, torch.Tensor] | None = None
    """``grad_scale``/``found_inf`` a ``torch.amp.GradScaler`` set on a fused optimizer
    for the step (the grads are then still scaled and the step unscales them)."""


def encode_meta(record: Record | None, capacity: int) -> torch.Tensor:
    """The record meta blob: length-prefixed JSON in ``capacity`` bytes."""
    if record is None:
        body = b'{"step": null}'
    else:
        present = [g for g, t in record.grads.items() if t is not None]
        scaler = {k: encode_value(t.detach().cpu(), k) for k, t in (record.scaler or {}).items()}
        body = json.dumps(
            {
                "step": record.step,
                "present": present,
                "hypers": record.hypers.decode(),
                "scaler": scaler,
            }
        ).encode()
    if len(body) + 8 > capacity:
        raise ValueError(
            f"gradient record metadata needs {len(body) + 8} bytes, capacity {capacity}: "
            "too many param groups or hyperparameters for the record blob"
        )
    out = torch.zeros(capacity, dtype=torch.uint8)
    out[:8] = torch.tensor([len(body)], dtype=torch.int64).view(torch.uint8)
    out[8 : 8 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return out


def decode_meta(blob: torch.Tensor) -> dict[str, Any]:
    """Inverse of :func:`encode_meta`: ``{"step": int | None, "present": [...], "groups": [...]}``."""
    n = int(blob[:8].clone().view(torch.int64).item())
    if not 0 <= n <= blob.numel() - 8:
        raise ValueError(f"record meta length {n} outside its blob of {blob.numel()} bytes")
    meta = json.loads(bytes(blob[8 : 8 + n].numpy()).decode())
    if meta.get("step") is not None:
        meta["groups"] = decode_hypers(meta.pop("hypers").encode())
        meta["scaler"] = {k: decode_value(v) for k, v in (meta.get("scaler") or {}).items()}
    return meta


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
