"""Replay logged optimizer steps onto restored full copies (differential recovery).

Recovery under differential checkpoints (``baft/plan/rotation.py``) restores each tensor
group (a parameter and its optimizer state) from its newest full copy, taken at some
version ``b``, then applies the gradient records of steps ``b .. v - 1`` with the same
optimizer, so the same kernels run on the same inputs and the result is bit-identical to
the failure-free run at version ``v``. Groups restored from different versions join the
replay at their own step: a param whose base is newer than a record keeps ``grad=None``
for it, and every optimizer listed in ``REPLAY_SAFE`` skips such params untouched.

Why this is exact: for the optimizers in ``REPLAY_SAFE`` one step is a per-tensor
function of (param, grad, that param's state, the group's hyperparameters), and the
kernels are elementwise, so stepping a subset of params gives each of them the same bits
as stepping all (tests/unit/test_replay.py proves it per optimizer, foreach and fused
included). What the step reads and a record must carry: the grads as the optimizer saw
them (after DP averaging, clipping, unscaling) and every param group's hyperparameters.

No torch.distributed here: the caller fetches copies and records (store, peers, parity).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["REPLAY_SAFE", "StepRecord", "record_step", "replay", "replay_safe"]

log = logging.getLogger("baft")

_SCALER_ATTRS = ("grad_scale", "found_inf")
"""Attributes ``torch.amp.GradScaler.step`` sets on a fused optimizer for one step."""

REPLAY_SAFE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""Optimizer classes (exactly these, not subclasses: a subclass may override ``step``)
whose replay tests/unit/test_replay.py proves bit-exact, with foreach on and off (and
fused where torch has it)."""

_NOT_SAFE: dict[type, str] = {
    torch.optim.LBFGS: "LBFGS re-evaluates a closure and keeps one state for all params "
    "(line search over the whole model): a step is not a per-tensor function of its grad",
    torch.optim.SparseAdam: "SparseAdam consumes sparse gradients; records hold dense "
    "tensors and its replay is not tested",
}


@dataclass(slots=True)
class StepRecord:
    """What optimizer step ``step`` consumed: the gradient record of that step."""

    step: int
    """Index of the optimizer step (it turns version ``step`` into ``step + 1``)."""
    grads: dict[str, torch.Tensor]
    """Gradient of each param that had one at the step, by param name, exactly as the
    optimizer read it (same dtype and shape as the param; any device)."""
    groups: list[dict[str, Any]]
    """Every param group's entries except ``"params"`` (lr, betas, weight_decay,
    foreach, ...) as plain Python values or tensors, in ``optimizer.param_groups`` order."""
    scaler: dict[str, torch.Tensor] = field(default_factory=dict)
    """``grad_scale`` and ``found_inf`` when ``torch.amp.GradScaler`` set them on the
    optimizer for this step (fused optimizers unscale inside the step and skip it on inf,
    so ``grads`` are then still scaled); empty otherwise."""


def record_step(
    optimizer: torch.optim.Optimizer,
    names: Mapping[torch.nn.Parameter, str] | Mapping[torch.Tensor, str],
    step: int,
    *,
    clone: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StepRecord:
    """The record of the step ``optimizer`` is about to take (call from a step pre-hook).

    ``names`` maps each param to its name. ``clone`` copies a grad (default:
    ``Tensor.clone``); the engine passes its own copy (into a spare or pinned buffer)
    or an identity when it captures by reference and copies later. Hyperparameter tensors
    are cloned so that a later in-place change cannot alter the record. Register the hook
    last: pre-hooks that run after it and change grads or hyperparameters are not seen.
    An iteration whose ``optimizer.step()`` never ran (``GradScaler`` found an inf with a
    non-fused optimizer) needs an empty record, ``StepRecord(step, {}, groups)``: its
    replay steps nothing, as the original iteration did.
    """
    copy = clone or torch.Tensor.clone
    grads: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                grads[names[p]] = copy(p.grad.detach())
    groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    scaler = {
        k: getattr(optimizer, k).detach().clone()
        for k in _SCALER_ATTRS
        if isinstance(getattr(optimizer, k, None), torch.Tensor)
    }
    return StepRecord(step=step, grads=grads, groups=groups, scaler=scaler)


def _plain(value: Any) -> Any:
    # betas is a tuple (may hold tensors); lists are copied so that a later in-place edit
    # of the live group cannot reach into the record
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def replay_safe(optimizer: torch.optim.Optimizer) -> str | None:
    """``None`` when ``replay`` is proven bit-exact for ``optimizer``, else why not.

    The engine falls back to full snapshots (``full_every=1``) on a reason and logs it.
    """
    cls = type(optimizer)
    if cls in _NOT_SAFE:
        return _NOT_SAFE[cls]
    if cls not in REPLAY_SAFE:
        return (
            f"{cls.__module__}.{cls.__qualname__} is not one of the optimizers whose replay "
            "baft proves bit-exact (torch.optim SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, "
            "NAdam, RAdam, Adadelta, ASGD, Rprop; subclasses may change step())"
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            return f"param group {i} has differentiable=True (replay runs without autograd)"
        if group.get("foreach") is None and not group.get("fused"):
            # torch picks foreach per step from the devices of the params that have
            # grads; with params on several device types a subset could pick another
            # kernel than the full step did
            kinds = {p.device.type for p in group["params"]}
            if len(kinds) > 1:
                return (
                    f"param group {i} has params on {sorted(kinds)} and foreach=None: "
                    "torch chooses the kernel per step from the params stepped; "
                    "set foreach explicitly"
                )
        if any(p.is_sparse for p in group["params"]):
            return f"param group {i} has sparse params"
    return None


def replay(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.nn.Parameter],
    base_version: Mapping[str, int],
    records: Sequence[StepRecord],
    *,
    consume: bool = False,
) -> None:
    """Apply ``records`` in order to params restored from their full copies.

    On entry, for each name, ``params[name]`` and ``optimizer.state[params[name]]`` hold
    the full copy of that tensor group taken at version ``base_version[name]`` (the
    state before step ``base_version[name]``; a param never stepped has no state, or the
    state its optimizer creates in ``__init__``, e.g. Adagrad's). ``records`` are the
    consecutive steps ``s0 .. v - 1``; the record of step ``s`` is applied to the params
    whose base is ``<= s`` (the others keep ``grad=None``, so the optimizer skips them),
    with each param group's hyperparameters set from the record. Params of the optimizer
    missing from ``params`` are not stepped. On return every param
    and its state are at version ``v`` (bit-identical to the failure-free run).

    The optimizer's step hooks are not run (they ran in the original step; baft's own
    recording hook must not record a replayed step), nor an LR scheduler's step counter.
    Afterwards the param groups hold exactly the entries they held on entry: the caller
    restores the hyperparameters of version ``v`` itself (from the optimizer's
    ``param_groups`` saved with version ``v``; the scheduler sets them after step
    ``v - 1``, so no record holds them). Each param's ``.grad`` is put back to the tensor
    (or ``None``) it held on entry, and GradScaler's attributes (``grad_scale``,
    ``found_inf``) to what they were. Raises ``ValueError`` (nothing stepped) when the
    optimizer is not replay-safe, names or steps do not line up (a record with a grad for
    a name not in ``params`` too: filter records for a partial replay), or a recorded grad does
    not match its param's shape or dtype.

    ``consume``: the records are used once and may be written to: a recorded grad that
    could be the param's grad as it is (a plain tensor of the param's device, dtype and
    strides) is handed to the optimizer without a copy (some steps write into their
    grads: SGD's foreach Nesterov step adds the momentum in place). A restore whose
    records are views of bytes read for it alone passes True; by default every grad is
    copied into a spare buffer first.
    """
    why = replay_safe(optimizer)
    if why is not None:
        raise ValueError(f"cannot replay {type(optimizer).__name__}: {why}")
    by_param = _check_inputs(optimizer, params, base_version, records)
    step_fn = _unhooked_step(optimizer)
    saved_grads = {name: p.grad for name, p in params.items()}
    # params of the optimizer that the caller did not name are not replayed: no grad
    others = [p for g in optimizer.param_groups for p in g["params"] if p not in by_param]
    others_grads = [p.grad for p in others]
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    saved_scaler = {k: getattr(optimizer, k) for k in _SCALER_ATTRS if hasattr(optimizer, k)}
    spare: dict[str, torch.Tensor] = {}  # one grad buffer per param, reused every step
    try:
        for p in others:
            p.grad = None
        for rec in records:
            for name, p in params.items():
                g = rec.grads.get(name) if base_version[name] <= rec.step else None
                if g is None:
                    p.grad = None
                    continue
                if consume and _usable_as_grad(g, p):
                    p.grad = g
                    continue
                buf = spare.get(name)
                if buf is None:
                    buf = spare[name] = torch.empty_like(p, memory_format=torch.preserve_format)
                # a DTensor (TP) param's record is its local shard's gradient: it goes into
                # the local part of a grad with the param's placements
                (buf if isinstance(g, DTensor) else _local(buf)).copy_(g)
                p.grad = buf
            for group, hyper in zip(optimizer.param_groups, rec.groups, strict=True):
                _set_entries(group, hyper)
            _set_scaler(optimizer, rec.scaler)
            with torch.no_grad():
                step_fn(optimizer)
        log.debug(
            "replayed %d optimizer steps (%s) onto %d params from %d base versions",
            len(records),
            f"{records[0].step}..{records[-1].step}" if records else "none",
            len(by_param),
            len(set(base_version.values())),
        )
    finally:
        for group, hyper in zip(optimizer.param_groups, saved_groups, strict=True):
            _set_entries(group, hyper)
        for name, p in params.items():
            p.grad = saved_grads[name]
        for p, grad in zip(others, others_grads, strict=True):
            p.grad = grad
        _set_scaler(optimizer, saved_scaler)


def _usable_as_grad(g: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``g`` can be ``p``'s grad as it is: plain tensors (no DTensor on either
    side) of one device, dtype, shape and strides (the copy into a spare buffer would
    give exactly these bytes and strides)."""
    if isinstance(g, DTensor) or isinstance(p, DTensor):
        return False
    return (
        g.device == p.device
        and g.dtype == p.dtype
        and g.shape == p.shape
        and g.stride() == p.stride()
        and g.layout == p.layout
        and not g.requires_grad
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _set_scaler(optimizer: torch.optim.Optimizer, attrs: Mapping[str, Any]) -> None:
    for key in _SCALER_ATTRS:
        if key in attrs:
            setattr(optimizer, key, attrs[key])
        elif hasattr(optimizer, key):
            delattr(optimizer, key)


def _set_entries(group: dict[str, Any], entries: Mapping[str, Any]) -> None:
    """Make ``group``'s entries (all but "params") exactly ``entries``."""
    for key in [k for k in group if k != "params" and k not in entries]:
        del group[key]
    for key, value in entries.items():
        if key != "params":
            group[key] = value


def _check_inputs(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.nn.Parameter],
    base_version: Mapping[str, int],
    records: Sequence[StepRecord],
) -> dict[torch.Tensor, str]:
    """Validate before anything is stepped (a half-replayed state is worse than none)."""
    if set(params) != set(base_version):
        missing = sorted(set(params) ^ set(base_version))[:5]
        raise ValueError(f"params and base_version name different params: {missing}")
    in_optimizer = {p for g in optimizer.param_groups for p in g["params"]}
    by_param: dict[torch.Tensor, str] = {}
    for name, p in params.items():
        if p not in in_optimizer:
            raise ValueError(f"param {name!r} is not in the optimizer's param groups")
        if p in by_param:
            raise ValueError(f"params {by_param[p]!r} and {name!r} are the same tensor")
        by_param[p] = name
    steps = [r.step for r in records]
    if any(b != a + 1 for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError(f"records must be consecutive steps, got {steps}")
    target = steps[-1] + 1 if steps else None
    for name, b in base_version.items():
        if target is None:
            continue
        if b > target:
            raise ValueError(f"{name!r} is at version {b}, newer than the replay target {target}")
        if b < steps[0]:
            raise ValueError(
                f"{name!r} needs steps from {b} but the records start at step {steps[0]}"
            )
    for rec in records:
        if len(rec.groups) != len(optimizer.param_groups):
            raise ValueError(
                f"record of step {rec.step} has {len(rec.groups)} param groups, the "
                f"optimizer {len(optimizer.param_groups)}"
            )
        for name, g in rec.grads.items():
            if name not in params:
                raise ValueError(f"record of step {rec.step} has a grad for unknown {name!r}")
            # a local shard's record (a plain tensor for a DTensor param): compare with the shard
            t: torch.Tensor = params[name] if isinstance(g, DTensor) else _local(params[name])
            if g.shape != t.shape or g.dtype != t.dtype or g.is_sparse:
                raise ValueError(
                    f"record of step {rec.step}: grad of {name!r} is {g.dtype} "
                    f"{tuple(g.shape)}, the param {t.dtype} {tuple(t.shape)} (dense)"
                )
    return by_param


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """``type(optimizer).step`` without the hook wrapper torch installs on the class.

    ``Optimizer._patch_step_function`` wraps the class's ``step`` (``functools.wraps``,
    marked ``hooked``) to run the global and per-instance step hooks; an LR scheduler
    wraps the instance's ``step`` to count calls. The replay calls the function below
    both: the record already holds what the hooks did before the original step.
    """
    fn: Any = type(optimizer).step
    if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn
