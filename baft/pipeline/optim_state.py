"""The optimizer's state as baft checkpoints it, and its param groups' hyperparameters.

This module owns which optimizers baft supports (:func:`check_optimizer`), their
per-parameter state created up front (:func:`init_optimizer_state`), the order of that
state in the layout (:func:`optimizer_tensors`), the state a first step creates from
the gradient (:class:`DeferredTensors`), and the param groups' hyperparameters: copied,
encoded, validated and loaded exactly (:func:`param_group_hypers`,
:func:`load_param_group_hypers`).

The optimizer's state is created as its first step would create it
(:func:`init_optimizer_state`) so that the layout does not change at step 0. SGD's
momentum buffer is the exception: its first step *clones* the gradient (zeros then
``mul_``/``add_`` would differ with dampening and in the sign of zero), so its buffer is
allocated for the layout but kept out of the live state, marked "not created" in
``extra.optim.created``, until the first step creates it; a step post-hook then copies it
into the allocated tensor and puts that tensor in the live state (bit-exact).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from baft.errors import refusal
from baft.pipeline.encoding import decode_blob, encode_blob, local
from baft.plan import names

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)


# ---------------------------------------------------------------------- hyperparameters
def _copy_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if type(v) in (list, tuple):
        return type(v)(_copy_value(x) for x in v)
    return copy.deepcopy(v)


def param_group_hypers(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyperparameters (all keys but ``params``), copied exactly:
    floats stay floats, a tensor ``lr`` stays a (cloned) tensor."""
    return [
        {k: _copy_value(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]


def encode_hypers(hypers: Sequence[Mapping[str, Any]]) -> bytes:
    """:func:`param_group_hypers` output as bytes (exact; see
    :func:`baft.pipeline.encoding.encode_value`)."""
    return encode_blob([dict(h) for h in hypers], "param groups")


def decode_hypers(data: bytes, device: torch.device | None = None) -> list[dict[str, Any]]:
    out = decode_blob(data, device)
    if type(out) is not list or not all(type(h) is dict for h in out):
        raise ValueError("encoded hyperparameters are not a list of dicts")
    return out


def _same_kind(live: Any, new: Any) -> bool:
    if isinstance(live, torch.Tensor) or isinstance(new, torch.Tensor):
        return (
            isinstance(live, torch.Tensor)
            and isinstance(new, torch.Tensor)
            and live.shape == new.shape
            and live.dtype == new.dtype
        )
    if type(live) in (list, tuple) and type(new) is type(live):
        return len(live) == len(new) and all(
            _same_kind(a, b) for a, b in zip(live, new, strict=True)
        )
    return True


def check_param_group_hypers(
    optimizer: torch.optim.Optimizer, hypers: Sequence[Mapping[str, Any]]
) -> None:
    """Raise ValueError unless ``hypers`` fits ``optimizer``'s param groups exactly
    (same number of groups, same keys, tensors where the live ones are tensors)."""
    groups = optimizer.param_groups
    if len(hypers) != len(groups):
        raise ValueError(
            f"saved state has {len(hypers)} param groups, the optimizer has {len(groups)}"
        )
    for i, (g, h) in enumerate(zip(groups, hypers, strict=True)):
        live = set(g) - {"params"}
        if set(h) != live:
            raise ValueError(
                f"param group {i}: saved hyperparameters {sorted(h)} differ from the "
                f"optimizer's {sorted(live)} (missing {sorted(live - set(h))}, extra {sorted(set(h) - live)})"
            )
        for k in sorted(live):
            if not _same_kind(g[k], h[k]):
                raise ValueError(
                    f"param group {i}: saved {k!r} ({h[k]!r}) does not fit the live {g[k]!r}"
                )


def _load_value(live: Any, new: Any) -> Any:
    if isinstance(live, torch.Tensor):  # in place: LR schedulers fill_ a tensor lr
        with torch.no_grad():
            live.copy_(new)
        return live
    if type(live) in (list, tuple):
        return type(live)(_load_value(a, b) for a, b in zip(live, new, strict=True))
    return new


def load_param_group_hypers(
    optimizer: torch.optim.Optimizer, hypers: Sequence[Mapping[str, Any]]
) -> None:
    """Set every param group's hyperparameters to ``hypers`` (validated first; tensor
    values are copied into the live tensors)."""
    check_param_group_hypers(optimizer, hypers)
    for g, h in zip(optimizer.param_groups, hypers, strict=True):
        for k, v in h.items():
            g[k] = _load_value(g[k], v)


# ---------------------------------------------------------------------- optimizer state
def check_optimizer(optimizer: Any) -> None:
    """Raise ValueError unless baft can checkpoint and replay this optimizer."""
    supported = ", ".join(c.__name__ for c in SUPPORTED_OPTIMIZERS)
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"baft checkpoints the state of {supported} (torch.optim, per-tensor steps); got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
    for i, g in enumerate(optimizer.param_groups):
        if g.get("differentiable"):
            raise ValueError(f"param group {i}: differentiable=True optimizers are not supported")


def _scalar_dtype(fused: Any = None) -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype (private), restated; the state layout test
    # compares what this module creates with what a real first step creates.
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _first_step_state(
    opt: torch.optim.Optimizer, g: dict[str, Any], p: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The state ``opt``'s first step creates for ``p`` (copied from torch's _init_group)."""
    zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
    if isinstance(opt, torch.optim.Adam):  # AdamW is an Adam
        on_device = g["capturable"] or g["fused"]
        step = (
            torch.zeros((), dtype=_scalar_dtype(g["fused"]), device=p.device)
            if on_device
            else torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
        )
        out = {"step": step, "exp_avg": zeros(), "exp_avg_sq": zeros()}
        if g["amsgrad"]:
            out["max_exp_avg_sq"] = zeros()
        return out
    if isinstance(opt, torch.optim.RMSprop):
        out = {
            "step": torch.zeros(
                (), dtype=_scalar_dtype(), device=p.device if g["capturable"] else None
            ),
            "square_avg": zeros(),
        }
        if g["momentum"] > 0:
            out["momentum_buffer"] = zeros()
        if g["centered"]:
            out["grad_avg"] = zeros()
        return out
    if isinstance(opt, torch.optim.Adagrad):  # normally done by its constructor
        init = g["initial_accumulator_value"]
        init = complex(init, init) if torch.is_complex(p) else init
        step = (
            torch.zeros((), dtype=_scalar_dtype(True), device=p.device)
            if g["fused"]
            else torch.tensor(0.0, dtype=_scalar_dtype())
        )
        return {"step": step, "sum": torch.full_like(p, init, memory_format=torch.preserve_format)}
    return {}  # SGD: momentum buffers are deferred (see deferred_state)


def deferred_state(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str]]:
    """(param, key) of state that the first step creates from the gradient, so it cannot
    be pre-created exactly: SGD's ``momentum_buffer`` (a clone of the first gradient)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [
        (p, "momentum_buffer")
        for g in optimizer.param_groups
        if g["momentum"] != 0
        for p in g["params"]
    ]


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state now, exactly as its first step would, for every param
    that has none yet; the trajectory stays bit-identical (see :func:`deferred_state` for
    what cannot be created before the first step)."""
    check_optimizer(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            if not optimizer.state.get(p):
                fresh = _first_step_state(optimizer, g, p)
                if fresh:
                    optimizer.state[p].update(fresh)


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]
) -> tuple[list[tuple[str, str, torch.Tensor]], DeferredTensors]:
    """``(param FQN, key, tensor)`` of every per-parameter state tensor, in the order of
    ``param_names`` (``id(param)`` -> FQN) and then of the keys, with a tensor allocated
    for each deferred state not created yet; and those deferred states."""
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = in_optimizer - set(param_names)
    if missing:
        raise ValueError(
            f"the optimizer holds {len(missing)} parameters that are in none of the stage modules"
        )
    order = deferred_state(optimizer)
    deferred = {id(p): key for p, key in order}
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    out: list[tuple[str, str, torch.Tensor]] = []
    held: list[tuple[torch.Tensor, str, torch.Tensor]] = []
    for pid, fqn in param_names.items():
        if pid not in in_optimizer:
            continue
        p = params[pid]
        state = optimizer.state.get(p, {})
        keys = set(state) | ({deferred[pid]} if pid in deferred else set())
        for key in sorted(keys):
            value = state.get(key)
            if value is None:  # deferred and not yet created: allocate for the layout
                value = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"optimizer state {fqn}.{key} is a {type(value).__name__}, not a tensor"
                )
            if pid in deferred and key == deferred[pid]:
                held.append((p, key, value))
            out.append((fqn, key, value))
    return out, DeferredTensors(optimizer, held, order)


class DeferredTensors:
    """The state a first step creates (see :func:`deferred_state`), each with the tensor
    the layout allocated for it (its *holder*) and a created flag: one byte per state in
    :attr:`created`, the ``extra.optim.created`` tensor."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        held: Sequence[tuple[torch.Tensor, str, torch.Tensor]],
        order: Sequence[tuple[torch.Tensor, str]],
    ) -> None:
        self.optimizer = optimizer
        # In param-group order: the order a first step inserts state (state_dict() order).
        rank = {id(p): i for i, (p, _) in enumerate(order)}
        self.held = sorted(held, key=lambda d: rank[id(d[0])])
        """(param, state key, holder) per deferred state."""
        self.created = torch.zeros(len(self.held), dtype=torch.uint8)
        for i, (p, key, holder) in enumerate(self.held):
            self.created[i] = int(optimizer.state.get(p, {}).get(key) is holder)

    def __bool__(self) -> bool:
        return bool(self.held)

    def holder_ids(self) -> set[int]:
        return {id(h) for _, _, h in self.held}

    @torch.no_grad()
    def after_step(self) -> None:
        """Adopt state the step just created: copy it into its holder and make the holder
        the live state."""
        for i, (p, key, holder) in enumerate(self.held):
            if self.created[i]:
                continue
            live = self.optimizer.state.get(p, {}).get(key)
            if live is None:
                continue
            if live is not holder:
                local(holder).copy_(local(live))
                self.optimizer.state[p][key] = holder
            self.created[i] = 1

    def flags(self, param_names: Mapping[int, str]) -> tuple[str, list[str]] | None:
        """``(extra.optim.created, the parameter FQN of each byte)``; None without
        deferred state."""
        if not self.held:
            return None
        return names.OPTIM_CREATED, [param_names[id(p)] for p, _, _ in self.held]

    def place(self, created: Sequence[bool]) -> None:
        """Make each holder the live state where ``created`` says so, and take the state
        out elsewhere."""
        for (p, key, holder), made in zip(self.held, created, strict=True):
            if made:
                self.optimizer.state[p][key] = holder
            elif p in self.optimizer.state:
                self.optimizer.state[p].pop(key, None)

    @torch.no_grad()
    def adopt(self) -> None:
        """State created meanwhile (by a replay's steps) goes into its holder."""
        for p, key, holder in self.held:
            live = self.optimizer.state.get(p, {}).get(key)
            if live is not None and live is not holder:
                local(holder).copy_(local(live))
                self.optimizer.state[p][key] = holder

    def read_flags(self, read: Callable[[str], torch.Tensor]) -> list[bool]:
        """The restored created flags (``read(name)``: the restored tensor), validated."""
        created = [int(x) for x in read(names.OPTIM_CREATED).tolist()] if self.held else []
        if any(x not in (0, 1) for x in created):
            raise refusal(ValueError("restored extra.optim.created holds values other than 0/1"))
        return [bool(x) for x in created]

    def load(self, created: Sequence[bool]) -> None:
        """Place the state by restored flags and make them the live flags."""
        self.place(created)
        self.created.copy_(torch.tensor([int(x) for x in created], dtype=torch.uint8))
