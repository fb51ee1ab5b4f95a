"""The restore check of ``baft bench overhead``: does a mode's newest checkpoint restore?

Bytes copied are not protection until they come back. After the timed blocks each mode
runs a few more (unmeasured) iterations, enough for a differential arm to hold a whole
window of K consecutive versions (:func:`check_iterations`), while this rank records the
digest of every state tensor at each of the last iteration boundaries
(:class:`LiveHistory`). Then the mode's newest checkpoint is restored into a fresh copy
of the state and each tensor is compared bit for bit (sha256 of its bytes, dtype and
shape) with the live tensor of the same version:

- disk baselines and peers hand their checkpoint back as saved
  (``hooks.checkpoint()``): :func:`canonical` maps it to state names through the live
  object it was saved from (same structure, tensors matched by storage);
- engine modes are restored by a fresh :class:`~baft.train.trainer.Trainer` on the same
  store through ``baft.protect``'s ``restore()`` (the public path), whose new model and
  optimizer are compared.

A tensor missing from the restored state, one of another version, or any byte that
differs makes the verdict "no"; modes without checkpoints are "n/a". The verdict is the
same on every rank (:func:`agree`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

VERDICTS = ("yes", "no", "n/a")
"""``restores`` values: restored bit for bit, not, or not applicable (no checkpoints)."""


def check_iterations(cadence: int, k: int) -> int:
    """Unmeasured iterations a mode runs before its check: K + 2 checkpoints (a whole
    window of K consecutive versions and a committed newest one), at least 2."""
    return cadence * (max(k, 1) + 2)


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, dtype and shape (its local shard for a DTensor)."""
    local = getattr(t, "to_local", None)
    t = local() if callable(local) else t
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{name: digest}`` of named tensors."""
    return {n: digest(t) for n, t in named}


class LiveHistory:
    """Digests of the live state at iteration boundaries: ``versions[v]`` is the state at
    the start of iteration ``v`` (after ``v - 1``'s optimizer step), which is version v."""

    def __init__(self) -> None:
        self.versions: dict[int, dict[str, str]] = {}

    def record(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.versions[version] = digests(named)


def _flatten(obj: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor of a nested dict/list/tuple by its path of keys."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    out: dict[tuple[Any, ...], torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, (*path, k)))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(_flatten(v, (*path, i)))
    return out


def _key(t: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    local = getattr(t, "to_local", None)
    t = local() if callable(local) else t
    return t.data_ptr(), tuple(t.shape), t.dtype


def canonical(
    saved: Any, live: Any, named: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The tensors of checkpoint ``saved`` by state name: ``live`` is the live object of
    the same structure it was saved from (e.g. ``{"model": ..., "optim": ...}`` of state
    dicts), whose tensors share storage with the named state tensors ``named``; a path
    of ``live`` missing from ``saved`` leaves its name out."""
    name_of = {_key(t): n for n, t in named}
    saved_flat = _flatten(saved)
    out: dict[str, torch.Tensor] = {}
    for path, t in _flatten(live).items():
        name = name_of.get(_key(t))
        if name is not None and path in saved_flat:
            out[name] = saved_flat[path]
    return out


def compare(
    expected: dict[str, str] | None, restored: dict[str, torch.Tensor], version: int | None
) -> tuple[str, str]:
    """``("yes" | "no", detail)``: the restored tensors against the digests of the live
    state of ``version`` (None: that version's state was not recorded)."""
    if expected is None:
        return "no", f"version {version} is not among the recorded live versions"
    missing = sorted(set(expected) - set(restored))
    extra = sorted(set(restored) - set(expected))
    differ = sorted(n for n in set(expected) & set(restored) if digest(restored[n]) != expected[n])
    if not (missing or extra or differ):
        return "yes", f"v{version}: {len(expected)} tensors bit for bit"
    parts = [
        f"{what} {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        for what, names in (("missing", missing), ("unexpected", extra), ("differ", differ))
        if names
    ]
    return "no", f"v{version}: " + "; ".join(parts)


def check_saved(
    history: LiveHistory,
    version: int | None,
    checkpoint: tuple[Any, Any] | None,
    named: Iterable[tuple[str, torch.Tensor]],
) -> tuple[str, str]:
    """The verdict on a checkpoint handed back as saved (``hooks.checkpoint()``)."""
    if checkpoint is None or version is None:
        return "no", "no checkpoint to restore"
    saved, live = checkpoint
    return compare(history.versions.get(version), canonical(saved, live, named), version)


def agree(verdict: tuple[str, str], rank: int) -> tuple[str, str]:
    """The verdict of every rank as one: "yes" only if every rank says so, "n/a" if
    every rank does, else "no" with the failing ranks' details. Collective."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return verdict
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rank, *verdict))
    return combine([(int(r), str(v), str(d)) for r, v, d in gathered])


def combine(per_rank: list[tuple[int, str, str]]) -> tuple[str, str]:
    """One verdict from ``(rank, verdict, detail)`` of every rank (see :func:`agree`)."""
    verdicts = {v for _, v, _ in per_rank}
    if verdicts == {"n/a"}:
        return "n/a", per_rank[0][2]
    if verdicts == {"yes"}:
        return "yes", "; ".join(f"rank {r}: {d}" for r, _, d in per_rank)
    bad = [f"rank {r}: {d}" for r, v, d in per_rank if v != "yes"]
    return "no", "; ".join(bad)
