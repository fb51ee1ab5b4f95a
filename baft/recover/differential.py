"""Rebuild a version from differential payloads: newest full slices + replayed records.

Under ``full_every = k > 1`` (see :mod:`baft.plan.payload`) version ``v`` is rebuilt from
the payloads of ``v - k + 1 .. v`` of a stage (every DP replica's share assembled):

1. each tensor group (a parameter and its optimizer state) is loaded from the newest
   payload of the window that carries its slice (its *base* version ``b``);
2. the always-tensors (RNG, buffers, small state) come from payload ``v`` itself;
3. the gradient records of steps ``v - k + 1 .. v - 1`` (in payloads ``v - k + 2 .. v``)
   are replayed with the live optimizer (:func:`baft.pipeline.replay.replay`), each group
   from its own base on, which gives version ``v`` bit-exactly. Optimizer state that a
   first step creates (SGD's momentum buffer, see :class:`DeferredState`) is live during
   the replay exactly where it existed at the group's base: a replayed step that finds no
   buffer clones the gradient, as a first step does, and would do so at every step.

A window with a missing payload, or a record that is not the step it should be, makes
the version unrecoverable (``RestoreError``), never wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from baft.pipeline.encoding import local, typed_view
from baft.pipeline.record import decode_meta
from baft.pipeline.replay import StepRecord, replay
from baft.plan.payload import GRAD_PREFIX, RECORD_META, PayloadLayout
from baft.plan.types import TensorSpec
from baft.store.records import window_of


class RestoreError(RuntimeError):
    """A rank cannot be restored; the message names the shard, version and cause."""


@runtime_checkable
class DeferredState(Protocol):
    """Optimizer state a first step creates, kept out of the live optimizer until then
    (:class:`~baft.pipeline.state.TrainingState`: SGD's momentum buffer)."""

    def deferred_flags(self) -> tuple[str, list[str]] | None:
        """The always-tensor holding a created byte per deferred state, and the group
        of each byte; None without deferred state."""
        ...

    def place_deferred(self, created: Sequence[bool]) -> None:
        """Make each deferred state live (its restored tensor) or absent."""
        ...

    def adopt_deferred(self) -> None:
        """Move state the replay created into its layout tensor."""
        ...


def _offsets(specs: tuple[TensorSpec, ...]) -> dict[str, tuple[int, int]]:
    out, pos = {}, 0
    for s in specs:
        out[s.name] = (pos, s.nbytes)
        pos += s.nbytes
    return out


def _write(dst: torch.Tensor, raw: torch.Tensor) -> None:
    dst.detach().reshape(-1).view(torch.uint8).copy_(raw)


def rebuild_from_payloads(
    layout: PayloadLayout,
    payloads: Mapping[int, torch.Tensor],
    version: int,
    first_version: int,
    tensors: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.Tensor],
    deferred: DeferredState | None = None,
) -> dict[str, Any]:
    """Load version ``version`` into the live ``tensors`` (flat-state name -> live tensor)
    from whole-stage ``payloads`` (version -> uint8 bytes), replaying with ``optimizer``
    over ``params`` (group -> parameter); ``deferred`` places the state a first step
    creates as it was at each group's base (required when the state has any: without it
    a fresh process replays SGD-momentum with no buffers). Returns what was done (bases,
    steps replayed)."""
    k = layout.k
    win = window_of(version, k, first_version)
    if win is None:
        raise RestoreError(
            f"v{version} is not rebuildable: its rotation began at v{first_version}, "
            f"a whole window of {k} payloads is needed"
        )
    missing = [u for u in win if u not in payloads]
    if missing:
        raise RestoreError(f"v{version}: payloads of {missing} are missing")
    bases = {j: max(u for u in win if u % k == j) for j in range(k)}
    with torch.no_grad():
        for j, b in bases.items():
            where = _offsets(layout.order(b % k))
            raw = payloads[b]
            for spec in layout.slice_members(j):
                off, n = where[spec.name]
                _write(tensors[spec.name], raw[off : off + n])
        where = _offsets(layout.order(version % k))
        for spec in layout.always:
            off, n = where[spec.name]
            _write(tensors[spec.name], payloads[version][off : off + n])
    records = []
    for u in win[1:]:
        where = _offsets(layout.order(u % k))
        raw = payloads[u]
        off, n = where[RECORD_META]
        meta = decode_meta(raw[off : off + n])
        if meta.get("step") != u - 1:
            raise RestoreError(
                f"v{version}: payload v{u} holds the record of step {meta.get('step')}, "
                f"not of step {u - 1}"
            )
        grads = {}
        for g in meta["present"]:
            off, n = where[GRAD_PREFIX + g]
            # a TP (DTensor) param's record holds its local shard's gradient
            p = local(params[g])
            grads[g] = typed_view(raw[off : off + n], p.dtype, p.shape)
        scaler = {k: v.to(next(iter(params.values())).device) for k, v in meta["scaler"].items()}
        records.append(StepRecord(step=u - 1, grads=grads, groups=meta["groups"], scaler=scaler))
    base_of = {g: bases[layout.slice_of[g]] for g in layout.groups}
    flags = deferred.deferred_flags() if deferred is not None else None
    if flags is not None:
        assert deferred is not None
        deferred.place_deferred(_created_at_bases(layout, payloads, base_of, *flags))
    # replay leaves the param groups as they are: version v's hyperparameters are the
    # live ones (or were loaded with the small state of payload v)
    # the records' grads are views of payload bytes read for this restore alone (a
    # private read mapping or a receive buffer): the optimizer may take them as they are
    replay(optimizer, dict(params), base_of, records, consume=True)  # type: ignore[arg-type]
    if deferred is not None:
        deferred.adopt_deferred()
    return {"bases": sorted(set(base_of.values())), "replayed_steps": len(records)}


def _created_at_bases(
    layout: PayloadLayout,
    payloads: Mapping[int, torch.Tensor],
    base_of: Mapping[str, int],
    name: str,
    groups: Sequence[str],
) -> list[bool]:
    """Whether each deferred state existed at its group's base version (the created
    flags are an always-tensor: every payload holds its version's)."""
    out = []
    for i, g in enumerate(groups):
        b = base_of[g]
        off, n = _offsets(layout.order(b % layout.k))[name]
        flag = int(payloads[b][off + i]) if i < n else -1
        if flag not in (0, 1):
            raise RestoreError(f"payload v{b}: {name}[{i}] holds {flag}, not a 0/1 flag")
        out.append(bool(flag))
    return out
