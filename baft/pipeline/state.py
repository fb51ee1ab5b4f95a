"""All of a rank's training state as a fixed list of named tensors.

:class:`TrainingState` names every tensor a restore needs, in a canonical order that is
fixed from iteration 0: parameters (``model.<fqn>``) and persistent buffers
(``buffer.<fqn>``, a copy taken by :meth:`TrainingState.capture`: unlike parameters,
buffers such as BatchNorm statistics change during the forward passes of an iteration)
of every stage module, the optimizer's per-parameter state
(``optim.<fqn>.<key>``), and fixed-capacity uint8 tensors (``extra.*``) holding the small
non-tensor state: RNG states, the param groups' hyperparameters, and the ``state_dict()``
of every registered :class:`Stateful` (LR schedulers, samplers, counters); the names are
spelled by :mod:`baft.plan.names`. The engine
snapshots those tensors like any other; :meth:`TrainingState.capture` refreshes the small
ones from the live objects and :meth:`TrainingState.apply` loads them back, validating
everything before it loads anything.

The optimizer's state is created as its first step would create it
(:func:`init_optimizer_state`) so that the layout does not change at step 0. SGD's
momentum buffer is the exception: its first step *clones* the gradient (zeros then
``mul_``/``add_`` would differ with dampening and in the sign of zero), so its buffer is
allocated for the layout but kept out of the live state, marked "not created" in
``extra.optim.created``, until the first step creates it; a step post-hook then copies it
into the allocated tensor and puts that tensor in the live state (bit-exact).

Small state is encoded as JSON with tagged values (:func:`encode_value`), never pickled:
the bytes may have been written by a peer, and JSON decoding cannot run code. Floats keep
their exact bits (IEEE hex), tuples stay tuples, dict keys keep their types, tensors and
numpy arrays travel as raw bytes with dtype and shape. ``torch.load(weights_only=True)``
would also be safe in principle, but its unpickler is larger to audit (it has had
bypasses) and its zip container adds about a kilobyte per object.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from baft.errors import refusal
from baft.pipeline.encoding import (
    _tensor_bytes,
    decode_blob,
    decode_value,
    encode_blob,
    encode_value,
    local,
)
from baft.pipeline.layout import GlobalLayout, placement_of
from baft.plan import names

log = logging.getLogger("baft")

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)
DEFAULT_EXTRA_CAPACITY = 64 * 1024
"""Bytes reserved for each registered state object's encoded ``state_dict()``."""
META = "meta"
"""Capacity key of the blob holding the optimizer's class and param-group hyperparameters."""
FORMAT = 1
_HEADER = struct.Struct("<4sI")  # magic, payload length
_MAGIC = b"BFTS"
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@runtime_checkable
class Stateful(Protocol):
    """DCP's protocol: anything with ``state_dict()`` and ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


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
    """:func:`param_group_hypers` output as bytes (exact; see :func:`encode_value`)."""
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


# ---------------------------------------------------------------------- blobs
def _write_blob(t: torch.Tensor, payload: bytes, what: str, setting: str) -> int:
    n = _HEADER.size + len(payload)
    if n > t.numel():
        raise ValueError(
            f"{what}: encoded state is {n} bytes, more than its {t.numel()} byte capacity; "
            f"raise {setting}"
        )
    t[:n].copy_(
        torch.frombuffer(bytearray(_HEADER.pack(_MAGIC, len(payload)) + payload), dtype=torch.uint8)
    )
    return n


def decode_record(t: torch.Tensor, device: torch.device | None = None) -> Any:
    """The value held by one ``extra.*`` record tensor (e.g. loaded from a persisted
    checkpoint with plain DCP): ``extra.meta.<optimizer class>`` gives the optimizer's class and param-group
    hyperparameters, ``extra.state.<key>`` ``{"class": ..., "state": state_dict}``."""
    return decode_blob(_read_blob(t, "record"), device)


def _read_blob(t: torch.Tensor, what: str) -> bytes:
    raw = t.detach().cpu().numpy().tobytes()
    if len(raw) < _HEADER.size:
        raise ValueError(f"{what}: restored record is shorter than its header")
    magic, n = _HEADER.unpack_from(raw)
    if magic != _MAGIC or _HEADER.size + n > len(raw):
        raise ValueError(f"{what}: restored bytes are not a baft state record (layout changed?)")
    return raw[_HEADER.size : _HEADER.size + n]


@dataclass(slots=True)
class _Restored:
    """Everything decoded and validated from restored bytes, not yet loaded."""

    hypers: list[dict[str, Any]]
    created: list[bool]
    rng_cpu: torch.Tensor
    rng_device: torch.Tensor | None
    states: dict[str, Any]


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


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class TrainingState:
    """The fixed list of named tensors holding all of one rank's training state.

    ``modules`` are this rank's stage modules, ``stateful`` the objects registered with
    ``state=`` (saved through their ``state_dict()``). Non-persistent buffers (those
    registered with ``persistent=False``, left out of ``state_dict()`` too) are not saved:
    torch treats them as derived (e.g. rotary caches). Creates the optimizer's state
    (:func:`init_optimizer_state`) and, unless ``install_step_hook`` is False, registers
    a step post-hook calling :meth:`after_optimizer_step` (then the engine must call it).
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
        self._capacity = extra_capacity_bytes
        for key, obj in self.stateful.items():
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise ValueError(f"state key {key!r}: use letters, digits, '_', '.', '-'")
            if not isinstance(obj, Stateful):
                raise ValueError(
                    f"state[{key!r}] ({_qualname(obj)}) has no state_dict()/load_state_dict()"
                )
        init_optimizer_state(optimizer)
        self._entries: list[tuple[str, torch.Tensor]] = []
        self._placement: dict[str, tuple[tuple[int, ...], str, tuple[int, ...]]] = {}
        """(global shape, placements, local offset) of the DTensor entries, by name."""
        self._global: dict[str, GlobalLayout] = {}
        """Mesh, placements, global shape and stride of the DTensor entries, by name."""
        self._param_names: dict[int, str] = {}
        self._buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        """(owning module, attribute, snapshot copy) per persistent buffer."""
        self._collect_model()
        self._deferred: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        self._collect_optimizer()
        self._blobs: dict[str, torch.Tensor] = {}
        self._blob_len: dict[str, int] = {}
        # The optimizer's class is in the record's name: the layout alone (checked before
        # a restore writes any byte) tells Adam from AdamW, whose tensors are the same.
        self.meta_name = names.meta(type(optimizer).__name__)
        self._add_blob(self.meta_name, self._cap(META, 4096 + 2048 * len(optimizer.param_groups)))
        for key in sorted(self.stateful):
            self._add_blob(names.state(key), self._cap(key, 0))
        self._created = torch.zeros(len(self._deferred), dtype=torch.uint8)
        for i, (p, key, holder) in enumerate(self._deferred):
            self._created[i] = int(self.optimizer.state.get(p, {}).get(key) is holder)
        if self._deferred:
            self._entries.append((names.OPTIM_CREATED, self._created))
        self._rng_cpu = torch.get_rng_state().clone()
        self._entries.append((names.rng("cpu"), self._rng_cpu))
        self._rng_device: torch.Tensor | None = None
        if self.device.type == "cuda":  # the one device seam for RNG
            self._rng_device = torch.cuda.get_rng_state(self.device).clone()
            self._entries.append((names.rng("cuda"), self._rng_device))
        self._digest = _layout_digest(self.layout())
        self._groups = self._group_structure()
        self._hook = (
            optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())
            if install_step_hook
            else None
        )
        self.capture()

    # ------------------------------------------------------------------ layout
    def _cap(self, key: str, floor: int) -> int:
        """The capacity set for ``key``; ``floor`` raises the default (not an explicit
        per-key setting), e.g. for many param groups. Depends only on the structure, so a
        restarted run gets the same layout."""
        c = self._capacity
        explicit = isinstance(c, Mapping) and key in c
        n = (c[key] if explicit else DEFAULT_EXTRA_CAPACITY) if isinstance(c, Mapping) else c
        if n < _HEADER.size:
            raise ValueError(f"extra_capacity_bytes for {key!r} must be at least {_HEADER.size}")
        return n if explicit else max(n, floor)

    def _add_blob(self, name: str, capacity: int) -> None:
        t = torch.zeros(capacity, dtype=torch.uint8)
        self._blobs[name] = t
        self._blob_len[name] = 0
        self._entries.append((name, t))

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
                    self._entries.append((name, local(p.data)))
                    self._placement[name] = placement_of(p.data)
                    self._note_global(name, p.data)
        for m in self.modules:
            for fqn, b in _persistent_buffers(m):
                name = names.buffer(fqn)
                if add(name, b):
                    owner, _, leaf = fqn.rpartition(".")
                    shadow = local(b).detach().clone(memory_format=torch.contiguous_format)
                    self._buffers.append((m.get_submodule(owner), leaf, shadow))
                    self._entries.append((name, shadow))
                    self._placement[name] = placement_of(b)
                    self._note_global(name, b)

    def _collect_optimizer(self) -> None:
        in_optimizer = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = in_optimizer - set(self._param_names)
        if missing:
            raise ValueError(
                f"the optimizer holds {len(missing)} parameters that are in none of the stage modules"
            )
        order = deferred_state(self.optimizer)
        deferred = {id(p): key for p, key in order}
        params = {id(p): p for g in self.optimizer.param_groups for p in g["params"]}
        for pid, fqn in self._param_names.items():
            if pid not in in_optimizer:
                continue
            p = params[pid]
            state = self.optimizer.state.get(p, {})
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
                    self._deferred.append((p, key, value))
                name = names.optim(fqn, key)
                self._entries.append((name, local(value)))
                self._placement[name] = placement_of(value)
                self._note_global(name, value)
        # In param-group order: the order a first step inserts state (state_dict() order).
        rank = {id(p): i for i, (p, _) in enumerate(order)}
        self._deferred.sort(key=lambda d: rank[id(d[0])])

    def _group_structure(self) -> list[list[Any]]:
        out = []
        for g in self.optimizer.param_groups:
            h = hashlib.sha256()
            for p in g["params"]:
                h.update(f"{self._param_names[id(p)]}|{tuple(local(p).shape)}\n".encode())
            out.append([len(g["params"]), h.hexdigest()[:16]])
        return out

    def _note_global(self, name: str, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            self._global[name] = GlobalLayout(
                t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride())
            )

    def global_layouts(self) -> dict[str, GlobalLayout]:
        """How the rank-local tensor of each DTensor entry (TP shards) sits in its global
        tensor, by name: what a DCP checkpoint needs to save and load it as the DTensor
        (plain tensors are absent)."""
        return dict(self._global)

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

        def pair(x: Any) -> tuple[str, int]:
            return (x.name, x.nbytes) if hasattr(x, "name") else (x[0], x[1])

        old = dict(pair(x) for x in saved)
        new = {i.name: i.nbytes for i in self.layout()}
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
                    "; ".join(
                        [*head, "the model/optimizer state differs from the saved one", *parts]
                    )
                )
            )
        if head:
            raise refusal(ValueError(head[0]))
        if list(old) != list(new):
            raise refusal(
                ValueError("the saved tensors are in a different order (stage modules reordered?)")
            )

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
            with torch.no_grad():
                for mod, leaf, shadow in self._buffers:
                    live = mod._buffers.get(leaf)
                    if (
                        live is None
                        or local(live).shape != shadow.shape
                        or live.dtype != shadow.dtype
                    ):
                        raise ValueError(
                            f"buffer {leaf!r} of {type(mod).__name__} was removed or changed "
                            f"shape/dtype (was {shadow.dtype}{list(shadow.shape)}): the layout is fixed"
                        )
                    shadow.copy_(local(live))
        if rng:
            self._rng_cpu.copy_(torch.get_rng_state())
            if self._rng_device is not None:
                self._rng_device.copy_(torch.cuda.get_rng_state(self.device))
        if optimizer:
            meta = {
                "format": FORMAT,
                "layout": self._digest,
                "optimizer": _qualname(self.optimizer),
                "groups": self._groups,
                "state_keys": sorted(self.stateful),
                "hypers": [  # encoded as they are: no copy needed
                    {k: v for k, v in g.items() if k != "params"}
                    for g in self.optimizer.param_groups
                ],
            }
            self._write(
                self.meta_name,
                encode_blob(meta, "optimizer param groups"),
                "optimizer hyperparameters",
                META,
            )
        keys = sorted(self.stateful) if state is True else ([] if state is False else list(state))
        for key in keys:
            obj = self.stateful[key]
            record = {"class": _qualname(obj), "state": obj.state_dict()}
            self._write(
                names.state(key),
                encode_blob(record, f"state[{key!r}].state_dict()"),
                f"state[{key!r}]",
                key,
            )

    def lr_scheduler_keys(self) -> list[str]:
        """Keys of the registered LR schedulers: in a loop that calls ``scheduler.step()``
        after ``optimizer.step()``, these (and the hyperparameters they set) are captured
        at the next iteration's start, the other objects right after the step."""
        kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        return sorted(k for k, obj in self.stateful.items() if isinstance(obj, kinds))

    def _write(self, name: str, payload: bytes, what: str, key: str) -> None:
        t = self._blobs[name]
        n = _write_blob(t, payload, what, f"extra_capacity_bytes (key {key!r})")
        if n < self._blob_len[name]:  # zero the old tail: the bytes are a function of the state
            t[n : self._blob_len[name]].zero_()
        self._blob_len[name] = n

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Adopt state the step just created (SGD's first momentum buffers): copy it into
        the tensor the layout allocated for it and make that tensor the live state."""
        for i, (p, key, holder) in enumerate(self._deferred):
            if self._created[i]:
                continue
            live = self.optimizer.state.get(p, {}).get(key)
            if live is None:
                continue
            if live is not holder:
                local(holder).copy_(local(live))
                self.optimizer.state[p][key] = holder
            self._created[i] = 1

    def deferred_flags(self) -> tuple[str, list[str]] | None:
        """``("extra.optim.created", groups)``: the always-tensor with one byte per
        deferred state (created or not) and the parameter FQN of each byte; None without
        deferred state. A differential replay reads the bytes of each group's base."""
        if not self._deferred:
            return None
        return names.OPTIM_CREATED, [self._param_names[id(p)] for p, _, _ in self._deferred]

    def place_deferred(self, created: Sequence[bool]) -> None:
        """Put each deferred state in the live optimizer state (its layout tensor) where
        ``created`` says so, and take it out elsewhere: before a replay, as at each group's
        base version, so that a replayed first step creates it as the original one did
        (SGD clones the gradient; a left-out buffer would be cloned at every replay)."""
        for (p, key, holder), made in zip(self._deferred, created, strict=True):
            if made:
                self.optimizer.state[p][key] = holder
            elif p in self.optimizer.state:
                self.optimizer.state[p].pop(key, None)

    @torch.no_grad()
    def adopt_deferred(self) -> None:
        """After a replay: state its steps created goes into its layout tensor (as
        :meth:`after_optimizer_step` does); :meth:`apply` then places it by the restored
        version's flags."""
        for p, key, holder in self._deferred:
            live = self.optimizer.state.get(p, {}).get(key)
            if live is not None and live is not holder:
                local(holder).copy_(local(live))
                self.optimizer.state[p][key] = holder

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
        skip = {id(h) for _, _, h in self._deferred} | {id(b) for _, _, b in self._buffers}
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
        self._decode(read or self._blobs_and_raw)

    def apply(self) -> None:
        """Load the restored small state (the engine has written restored bytes into
        :meth:`tensors`): RNG states, hyperparameters, SGD momentum placement and every
        registered state object. Validates everything first (ValueError naming the
        mismatch); a state object whose load fails is rolled back with the others."""
        restored = self._decode(self._blobs_and_raw)
        self._load(restored)

    def _blobs_and_raw(self, name: str) -> torch.Tensor:
        raw = {names.OPTIM_CREATED: self._created, names.rng("cpu"): self._rng_cpu}
        if self._rng_device is not None:
            raw[names.rng("cuda")] = self._rng_device
        return self._blobs[name] if name in self._blobs else raw[name]

    def _decode(self, read: Callable[[str], torch.Tensor]) -> _Restored:
        try:
            return self._decode_checked(read)
        except (TypeError, KeyError, IndexError, AttributeError) as e:  # a malformed record
            raise ValueError(f"restored small state is malformed: {e!r}") from e

    def _decode_checked(self, read: Callable[[str], torch.Tensor]) -> _Restored:
        meta = decode_blob(
            _read_blob(read(self.meta_name), "optimizer hyperparameters"), self.device
        )
        if type(meta) is not dict or meta.get("format") != FORMAT:
            raise refusal(ValueError("restored optimizer record has an unknown format"))
        saved_keys, keys = list(meta["state_keys"]), sorted(self.stateful)
        if saved_keys != keys:
            raise refusal(
                ValueError(
                    f"state= keys differ from the saved ones: saved {saved_keys}, registered {keys} "
                    f"(missing {sorted(set(saved_keys) - set(keys))}, extra {sorted(set(keys) - set(saved_keys))})"
                )
            )
        if meta["optimizer"] != _qualname(self.optimizer):
            raise refusal(
                ValueError(
                    f"the state was saved with optimizer {meta['optimizer']}, this run uses {_qualname(self.optimizer)}"
                )
            )
        if meta["groups"] != self._groups:
            raise refusal(
                ValueError(
                    f"optimizer param groups differ from the saved ones ([params, digest] per group): "
                    f"saved {meta['groups']}, now {self._groups}"
                )
            )
        if meta["layout"] != self._digest:
            raise refusal(
                ValueError(
                    "the model/optimizer tensor layout differs from the saved one (see check_layout)"
                )
            )
        hypers = meta["hypers"]
        check_param_group_hypers(self.optimizer, hypers)
        for mod, leaf, shadow in self._buffers:
            live = mod._buffers.get(leaf)
            if live is None or local(live).shape != shadow.shape or live.dtype != shadow.dtype:
                raise refusal(
                    ValueError(f"buffer {leaf!r} of {type(mod).__name__} changed since start")
                )
        created = [int(x) for x in read(names.OPTIM_CREATED).tolist()] if self._deferred else []
        if any(x not in (0, 1) for x in created):
            raise refusal(ValueError("restored extra.optim.created holds values other than 0/1"))
        rng_cpu = read(names.rng("cpu")).detach().cpu().clone()
        _check_rng(rng_cpu, torch.device("cpu"))
        rng_device = None
        if self._rng_device is not None:
            rng_device = read(names.rng("cuda")).detach().cpu().clone()
            _check_rng(rng_device, self.device)
        states = {}
        for key in keys:
            rec = decode_blob(_read_blob(read(names.state(key)), f"state[{key!r}]"), self.device)
            now = _qualname(self.stateful[key])
            if type(rec) is not dict or rec.get("class") != now:
                saved = rec.get("class") if type(rec) is dict else "?"
                raise refusal(
                    ValueError(
                        f"state[{key!r}] was saved from a {saved}, this run registers a {now}"
                    )
                )
            states[key] = rec["state"]
        return _Restored(hypers, [bool(x) for x in created], rng_cpu, rng_device, states)

    @torch.no_grad()
    def _load(self, r: _Restored) -> None:
        backups = {k: encode_value(obj.state_dict(), k) for k, obj in self.stateful.items()}
        loaded: list[str] = []
        for key, obj in self.stateful.items():
            loaded.append(key)
            try:
                obj.load_state_dict(r.states[key])
            except Exception as e:
                for k in loaded:  # roll back: nothing is loaded half-way
                    try:
                        self.stateful[k].load_state_dict(decode_value(backups[k], self.device))
                    except Exception:  # noqa: BLE001 - report the original failure
                        log.exception("could not roll back state[%r]", k)
                raise ValueError(
                    f"state[{key!r}].load_state_dict failed on the restored state: {e}"
                ) from e
        load_param_group_hypers(self.optimizer, r.hypers)
        self.place_deferred(r.created)
        self._created.copy_(torch.tensor([int(x) for x in r.created], dtype=torch.uint8))
        for mod, leaf, shadow in self._buffers:  # checked in _decode: same shape and dtype
            local(mod._buffers[leaf]).copy_(shadow)  # type: ignore[arg-type]
        torch.set_rng_state(r.rng_cpu)
        if r.rng_device is not None:
            torch.cuda.set_rng_state(r.rng_device, self.device)


def _check_rng(state: torch.Tensor, device: torch.device) -> None:
    try:  # on a scratch generator: the live one stays untouched
        torch.Generator(device=device).set_state(state.clone())
    except RuntimeError as e:
        raise ValueError(f"restored {device.type} RNG state is invalid: {e}") from e


def _persistent_buffers(m: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """``m``'s buffers that ``state_dict()`` saves (non-persistent ones are derived)."""
    for fqn, b in m.named_buffers():
        owner, _, leaf = fqn.rpartition(".")
        mod = m.get_submodule(owner) if owner else m
        if leaf not in mod._non_persistent_buffers_set:
            yield fqn, b
