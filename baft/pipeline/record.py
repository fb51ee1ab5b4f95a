"""The gradient record of one optimizer step, as a differential payload carries it.

:class:`Record` is the record as captured at the step (references, see
:class:`baft.engine.differential.RecordCapture`); :func:`encode_meta` writes its meta
blob (step, groups with a gradient, every param group's hyperparameters, the scaler)
into a payload and :func:`decode_meta` reads it back at a restore
(:mod:`baft.recover.differential`). One spelling of the blob for both sides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from baft.pipeline.encoding import decode_value, encode_value
from baft.pipeline.state import decode_hypers


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
