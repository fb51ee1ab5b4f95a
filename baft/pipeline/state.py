"""All of a rank's training state as a fixed list of named tensors.

:class:`TrainingState` names every tensor a restore needs, in a canonical order that is
fixed from iteration 0: parameters (``model.<fqn>``) and persistent buffers
(``buffer.<fqn>``, a copy taken by :meth:`TrainingState.capture`: unlike parameters,
buffers such as BatchNorm statistics change during the forward passes of an iteration)
of every stage module, the optimizer's per-parameter state
(``optim.<fqn>.<key>``, :mod:`baft.pipeline.optim_state`), and fixed-capacity uint8
tensors (``extra.*``, :mod:`baft.pipeline.small_state`) holding the small non-tensor
state: RNG states, the param groups' hyperparameters, and the ``state_dict()`` of every
registered :class:`~baft.pipeline.small_state.Stateful` (LR schedulers, samplers,
counters); the names are spelled by :mod:`baft.plan.names`. The engine snapshots those
tensors like any other; :meth:`TrainingState.capture` refreshes the small ones from the
live objects and :meth:`TrainingState.apply` loads them back, validating everything
before it loads anything. This module owns the list, its layout (:class:`TensorInfo`,
the layout digest, :meth:`TrainingState.check_layout`) and the buffers' copies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from baft.errors import refusal
from baft.pipeline.encoding import _tensor_bytes, local
from baft.pipeline.layout import GlobalLayout, placement_of
from baft.pipeline.optim_state import (
    check_optimizer,
    check_param_group_hypers,
    decode_hypers,
    encode_hypers,
    init_optimizer_state,
    load_param_group_hypers,
    optimizer_tensors,
    param_group_hypers,
)
from baft.pipeline.small_state import (
    DEFAULT_EXTRA_CAPACITY,
    Restored,
    SmallState,
    Stateful,
    check_stateful,
    decode_record,
)
from baft.plan import names

__all__ = [  # and what callers import from here since before the split
    "DEFAULT_EXTRA_CAPACITY",
    "Stateful",
    "TensorInfo",
    "TrainingState",
    "check_optimizer",
    "check_param_group_hypers",
    "decode_hypers",
    "decode_record",
    "encode_hypers",
    "load_param_group_hypers",
    "local",
    "param_group_hypers",
]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One checkpointed tensor: what a saved layout must match."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    """The rank-local shape."""
    nbytes: int
    global_shape: tuple[int, ...] = ()
    """The DTensor's global shape (a plain tensor's own shape)."""
    placements: str = ""
    """Placements over named mesh dims (``"tp:Shard(dim=0)"``; empty: a plain tensor)."""
    offset: tuple[int, ...] = ()
    """Where the local shard starts in the global tensor, per tensor dim."""


def _layout_digest(infos: Iterable[TensorInfo]) -> str:
    """sha256 over every tensor's identity: name, dtype, local shape and bytes, global
    shape, placements and local offset (two ranks with equal digests hold the same
    pieces of the same tensors)."""
    h = hashlib.sha256()
    for i in infos:
        h.update(
            f"{i.name}|{i.dtype}|{i.shape}|{i.nbytes}|{i.global_shape}|{i.placements}|"
            f"{i.offset}\n".encode()
        )
    return h.hexdigest()


def check_saved_layout(saved: Iterable[Any], layout: Iterable[TensorInfo]) -> None:
    """Raise ValueError (a refusal) naming the missing, extra and resized tensors unless
    ``saved`` (``(name, nbytes)`` pairs or objects with ``name`` and ``nbytes``) matches
    ``layout``, in the same order."""

    def pair(x: Any) -> tuple[str, int]:
        return (x.name, x.nbytes) if hasattr(x, "name") else (x[0], x[1])

    old = dict(pair(x) for x in saved)
    new = {i.name: i.nbytes for i in layout}
    missing = sorted(set(old) - set(new))
    extra = sorted(set(new) - set(old))
    was = [n[len(names.EXTRA_META) :] for n in missing if names.is_meta(n)]
    now = [n[len(names.EXTRA_META) :] for n in extra if names.is_meta(n)]
    head = []
    if was and now:
        head = [f"the state was saved with optimizer {was[0]}, this run uses {now[0]}"]
        missing = [n for n in missing if not names.is_meta(n)]
        extra = [n for n in extra if not names.is_meta(n)]
    resized = sorted(
        f"{n} ({old[n]} -> {new[n]} bytes)" for n in set(old) & set(new) if old[n] != new[n]
    )
    if missing or extra or resized:
        parts = [
            f"{what}: {', '.join(v[:5])}{' ...' if len(v) > 5 else ''}"
            for what, v in (
                ("saved but absent now", missing),
                ("new", extra),
                ("resized", resized),
            )
            if v
        ]
        raise refusal(
            ValueError(
                "; ".join([*head, "the model/optimizer state differs from the saved one", *parts])
            )
        )
    if head:
        raise refusal(ValueError(head[0]))
    if list(old) != list(new):
        raise refusal(
            ValueError("the saved tensors are in a different order (stage modules reordered?)")
        )


def _persistent_buffers(m: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """``m``'s buffers that ``state_dict()`` saves (non-persistent ones are derived)."""
    for fqn, b in m.named_buffers():
        owner, _, leaf = fqn.rpartition(".")
        mod = m.get_submodule(owner) if owner else m
        if leaf not in mod._non_persistent_buffers_set:
            yield fqn, b


class _BufferCopies:
    """The snapshot copy of every persistent buffer, with the module and attribute that
    hold the live buffer: a buffer may be replaced (not only updated in place) by its
    module, so the live one is looked up each time."""

    def __init__(self) -> None:
        self.items: list[tuple[nn.Module, str, torch.Tensor]] = []
        """(owning module, attribute, snapshot copy) per persistent buffer."""

    def add(self, owner: nn.Module, leaf: str, b: torch.Tensor) -> torch.Tensor:
        copy = local(b).detach().clone(memory_format=torch.contiguous_format)
        self.items.append((owner, leaf, copy))
        return copy

    def ids(self) -> set[int]:
        return {id(c) for _, _, c in self.items}

    def live(self) -> list[torch.Tensor]:
        """Every persistent buffer as its module holds it now (local shard of a DTensor)."""
        return [local(mod._buffers[leaf]) for mod, leaf, _ in self.items]  # type: ignore[arg-type]

    def _changed(self, mod: nn.Module, leaf: str, copy: torch.Tensor) -> bool:
        live = mod._buffers.get(leaf)
        return live is None or local(live).shape != copy.shape or live.dtype != copy.dtype

    @torch.no_grad()
    def refresh(self) -> None:
        for mod, leaf, copy in self.items:
            if self._changed(mod, leaf, copy):
                raise ValueError(
                    f"buffer {leaf!r} of {type(mod).__name__} was removed or changed "
                    f"shape/dtype (was {copy.dtype}{list(copy.shape)}): the layout is fixed"
                )
            copy.copy_(local(mod._buffers[leaf]))  # type: ignore[arg-type]

    def check(self) -> None:
        for mod, leaf, copy in self.items:
            if self._changed(mod, leaf, copy):
                raise refusal(
                    ValueError(f"buffer {leaf!r} of {type(mod).__name__} changed since start")
                )

    @torch.no_grad()
    def restore(self) -> None:
        for mod, leaf, copy in self.items:  # checked before: same shape and dtype
            local(mod._buffers[leaf]).copy_(copy)  # type: ignore[arg-type]


class TrainingState:
    """The fixed list of named tensors holding all of one rank's training state.

    ``modules`` are this rank's stage modules, ``stateful`` the objects registered with
    ``state=`` (saved through their ``state_dict()``). Non-persistent buffers (those
    registered with ``persistent=False``, left out of ``state_dict()`` too) are not saved:
    torch treats them as derived (e.g. rotary caches). Creates the optimizer's state
    (:func:`~baft.pipeline.optim_state.init_optimizer_state`) and, unless
    ``install_step_hook`` is False, registers a step post-hook calling
    :meth:`after_optimizer_step` (then the engine must call it).
    ``extra_capacity_bytes``: bytes reserved per state object's encoded ``state_dict()``,
    either one number or a mapping from state key (or ``"meta"`` for the optimizer's
    hyperparameters) to bytes, with :data:`DEFAULT_EXTRA_CAPACITY` for keys it lacks.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        stateful: Mapping[str, Stateful] | None = None,
        device: torch.device | str = "cpu",
        *,
        extra_capacity_bytes: int | Mapping[str, int] = DEFAULT_EXTRA_CAPACITY,
        install_step_hook: bool = True,
    ) -> None:
        check_optimizer(optimizer)
        self.modules = list(modules)
        self.optimizer = optimizer
        self.stateful = dict(stateful or {})
        self.device = torch.device(device)
        check_stateful(self.stateful)
        init_optimizer_state(optimizer)
        self._entries: list[tuple[str, torch.Tensor]] = []
        self._placement: dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]] = {}
        """(global shape, placements, local offset) of the DTensor entries, by name."""
        self._global: dict[str, GlobalLayout] = {}
        """Mesh, placements, global shape and stride of the DTensor entries, by name."""
        self._param_names: dict[int, str] = {}
        self._buffers = _BufferCopies()
        self._collect_model()
        optim, self._deferred = optimizer_tensors(optimizer, self._param_names)
        for fqn, key, value in optim:
            self._add(names.optim(fqn, key), value)
        self._small = SmallState(optimizer, self.stateful, self.device, extra_capacity_bytes)
        self.meta_name = self._small.meta_name
        self._entries += self._small.blobs()
        if self._deferred:
            self._entries.append((names.OPTIM_CREATED, self._deferred.created))
        self._entries += self._small.rngs()
        self._extras = dict(self._small.blobs() + self._small.rngs())
        """Every ``extra.*`` tensor by name (what :meth:`apply` reads)."""
        self._extras[names.OPTIM_CREATED] = self._deferred.created
        self._digest = _layout_digest(self.layout())
        self._small.set_layout(self._digest, self._group_structure())
        self._hook = (
            optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())
            if install_step_hook
            else None
        )
        self.capture()

    # ------------------------------------------------------------------ layout
    def _add(self, name: str, source: torch.Tensor, held: torch.Tensor | None = None) -> None:
        """Append entry ``name``: ``held`` (default: the rank-local tensor of ``source``),
        placed as ``source`` is in its global tensor."""
        self._entries.append((name, local(source) if held is None else held))
        self._placement[name] = placement_of(source)
        if isinstance(source, DTensor):
            self._global[name] = GlobalLayout(
                source.device_mesh, tuple(source.placements), source.shape, tuple(source.stride())
            )

    def _collect_model(self) -> None:
        seen: set[int] = set()
        taken: set[str] = set()

        def add(name: str, t: torch.Tensor) -> bool:
            if id(t) in seen:  # shared between stage modules: saved once
                return False
            if name in taken:
                raise ValueError(
                    f"two stage modules both have {name!r}: give stage modules their "
                    "original (distinct) fully qualified names"
                )
            seen.add(id(t))
            taken.add(name)
            return True

        for m in self.modules:
            for fqn, p in m.named_parameters():
                name = names.model(fqn)
                if add(name, p):
                    self._param_names[id(p)] = fqn
                    self._add(name, p.data)
        for m in self.modules:
            for fqn, b in _persistent_buffers(m):
                name = names.buffer(fqn)
                if add(name, b):
                    owner, _, leaf = fqn.rpartition(".")
                    self._add(name, b, self._buffers.add(m.get_submodule(owner), leaf, b))

    def _group_structure(self) -> list[list[Any]]:
        out = []
        for g in self.optimizer.param_groups:
            h = hashlib.sha256()
            for p in g["params"]:
                h.update(f"{self._param_names[id(p)]}|{tuple(local(p).shape)}\n".encode())
            out.append([len(g["params"]), h.hexdigest()[:16]])
        return out

    def global_layouts(self) -> dict[str, GlobalLayout]:
        """How the rank-local tensor of each DTensor entry (TP shards) sits in its global
        tensor, by name: what a DCP checkpoint needs to save and load it as the DTensor
        (plain tensors are absent)."""
        return dict(self._global)

    def live_buffers(self) -> list[torch.Tensor]:
        """The stage modules' persistent buffers as the modules hold them now (each
        once, in layout order)."""
        return self._buffers.live()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every checkpointed tensor (rank-local, contiguous), by canonical name, in
        canonical order; the same list, tensors and sizes for the whole run."""
        return list(self._entries)

    def layout(self) -> list[TensorInfo]:
        """Every checkpointed tensor's identity (see :class:`TensorInfo`), canonical order."""
        out = []
        for n, t in self._entries:
            shape = tuple(t.shape)
            glob, placements, offset = self._placement.get(n, (shape, "", (0,) * t.dim()))
            dtype = str(t.dtype).removeprefix("torch.")
            nbytes = t.numel() * t.element_size()
            out.append(TensorInfo(n, dtype, shape, nbytes, glob, placements, offset))
        return out

    @property
    def layout_digest(self) -> str:
        """sha256 of :meth:`layout`: what a restored shard of this rank must have been
        saved with (names, dtypes, global and local shapes, placements, offsets)."""
        return self._digest

    def check_layout(self, saved: Iterable[Any]) -> None:
        """Raise ValueError naming the missing, extra and resized tensors unless ``saved``
        (``(name, nbytes)`` pairs or objects with ``name`` and ``nbytes``) matches
        :meth:`layout`. Call it before writing restored bytes into the tensors."""
        check_saved_layout(saved, self.layout())

    def digests(self) -> dict[str, str]:
        """sha256 of every checkpointed tensor's bytes (params, buffers, optimizer state,
        small state), by name."""
        return {n: hashlib.sha256(_tensor_bytes(t)).hexdigest() for n, t in self._entries}

    # ------------------------------------------------------------------ capture
    def capture(
        self,
        *,
        buffers: bool = True,
        rng: bool = True,
        optimizer: bool = True,
        state: bool | Iterable[str] = True,
    ) -> None:
        """Refresh the copied tensors from the live objects: module buffers, RNG states,
        the optimizer's hyperparameters, and the registered state objects (all, or the
        keys given). Call at a version's start, before any forward pass and before any
        snapshot copy of that version."""
        if buffers:
            self._buffers.refresh()
        self._small.capture(rng=rng, optimizer=optimizer, state=state)

    def lr_scheduler_keys(self) -> list[str]:
        """Keys of the registered LR schedulers: in a loop that calls ``scheduler.step()``
        after ``optimizer.step()``, these (and the hyperparameters they set) are captured
        at the next iteration's start, the other objects right after the step."""
        return self._small.lr_scheduler_keys()

    def replica_records(self, keys: Iterable[str]) -> list[torch.Tensor]:
        """The live record tensors of a virtual replica's own state (the RNG states and
        the state objects ``keys``), layout order (:mod:`baft.pipeline.elastic`)."""
        wanted = {names.state(k) for k in keys} | {n for n, _ in self._small.rngs()}
        return [t for n, t in self._extras.items() if n in wanted]

    def load_replica_records(self, keys: Iterable[str]) -> None:
        """Load the RNG and the state objects ``keys`` from their live records."""
        self._small.load_replica(keys)

    def after_optimizer_step(self) -> None:
        """Adopt state the step just created (SGD's first momentum buffers): copy it into
        the tensor the layout allocated for it and make that tensor the live state."""
        self._deferred.after_step()

    def deferred_flags(self) -> tuple[str, list[str]] | None:
        """``("extra.optim.created", groups)``: the always-tensor with one byte per
        deferred state (created or not) and the parameter FQN of each byte; None without
        deferred state. A differential replay reads the bytes of each group's base."""
        return self._deferred.flags(self._param_names)

    def place_deferred(self, created: Sequence[bool]) -> None:
        """Put each deferred state in the live optimizer state (its layout tensor) where
        ``created`` says so, and take it out elsewhere: before a replay, as at each group's
        base version, so that a replayed first step creates it as the original one did
        (SGD clones the gradient; a left-out buffer would be cloned at every replay)."""
        self._deferred.place(created)

    def adopt_deferred(self) -> None:
        """After a replay: state its steps created goes into its layout tensor (as
        :meth:`after_optimizer_step` does); :meth:`apply` then places it by the restored
        version's flags."""
        self._deferred.adopt()

    def close(self) -> None:
        """Remove the step hook (if installed)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def check_live(self) -> None:
        """Raise RuntimeError if the live objects no longer hold the checkpointed tensors
        (a parameter or optimizer state replaced, e.g. by
        ``optimizer.load_state_dict`` after protect): they would be saved stale."""
        live: list[torch.Tensor] = []
        for m in self.modules:
            live += [local(p.data) for _, p in m.named_parameters()]
        ptrs = {t.data_ptr() for t in live}
        skip = self._deferred.holder_ids() | self._buffers.ids()
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                for v in self.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        ptrs.add(local(v).data_ptr())
        for name, t in self._entries:
            if names.is_extra(name) or id(t) in skip:
                continue
            if t.numel() and t.data_ptr() not in ptrs:
                raise RuntimeError(
                    f"{name} is no longer the live tensor (replaced after baft.protect?)"
                )

    # ------------------------------------------------------------------ restore
    def check_restored(self, read: Callable[[str], torch.Tensor] | None = None) -> None:
        """Validate restored small state without loading anything: ``read(name)`` gives
        the restored bytes of an ``extra.*`` tensor (default: the tensors themselves)."""
        self._decode(read or self._extras.__getitem__)

    def apply(self) -> None:
        """Load the restored small state (the engine has written restored bytes into
        :meth:`tensors`): RNG states, hyperparameters, SGD momentum placement and every
        registered state object. Validates everything first (ValueError naming the
        mismatch); a state object whose load fails is rolled back with the others."""
        restored = self._decode(self._extras.__getitem__)
        self._small.load_objects(restored)
        self._deferred.load(restored.created)
        self._buffers.restore()
        self._small.load_rng(restored)

    def _decode(self, read: Callable[[str], torch.Tensor]) -> Restored:
        try:
            hypers = self._small.decode_meta(read)
            self._buffers.check()
            created = self._deferred.read_flags(read)
            rng_cpu, rng_device, states = self._small.decode_records(read)
        except (TypeError, KeyError, IndexError, AttributeError) as e:  # a malformed record
            raise ValueError(f"restored small state is malformed: {e!r}") from e
        return Restored(hypers, created, rng_cpu, rng_device, states)
