"""A rank's small non-tensor state, held in fixed-capacity uint8 tensors (``extra.*``).

This module owns the records :class:`~baft.pipeline.state.TrainingState` keeps beside
the model and optimizer tensors (:class:`SmallState`): the optimizer's class and its
param groups' hyperparameters (``extra.meta.<optimizer class>``), the ``state_dict()`` of
every object registered with ``state=`` (:class:`Stateful`: LR schedulers, samplers,
counters; ``extra.state.<key>``), and the RNG states (``extra.rng.*``, raw). It captures
them from the live objects, decodes and validates restored ones, and loads them back;
and it owns the records' framing (header, capacity; :func:`decode_record`). The
``state=`` objects and RNG are each replica's own: with DP replicas the engine's layout
holds every replica's copy of them (``extra.state.dp<d>.<key>``, ``extra.rng.dp<d>.*``,
:mod:`baft.pipeline.replicas`), and these records are this replica's copy.

Small state is encoded as JSON with tagged values
(:func:`~baft.pipeline.encoding.encode_value`), never pickled: the bytes may have been
written by a peer, and JSON decoding cannot run code. Floats keep their exact bits (IEEE
hex), tuples stay tuples, dict keys keep their types, tensors and numpy arrays travel as
raw bytes with dtype and shape. ``torch.load(weights_only=True)`` would also be safe in
principle, but its unpickler is larger to audit (it has had bypasses) and its zip
container adds about a kilobyte per object.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from baft.errors import refusal
from baft.pipeline.encoding import decode_blob, decode_value, encode_blob, encode_value
from baft.pipeline.optim_state import check_param_group_hypers, load_param_group_hypers
from baft.plan import names

log = logging.getLogger("baft")

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


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_stateful(stateful: Mapping[str, Any]) -> None:
    """Raise ValueError unless every key is a valid record name and every object is
    :class:`Stateful`."""
    for key, obj in stateful.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"state key {key!r}: use letters, digits, '_', '.', '-'")
        if not isinstance(obj, Stateful):
            raise ValueError(
                f"state[{key!r}] ({_qualname(obj)}) has no state_dict()/load_state_dict()"
            )


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


def _check_rng(state: torch.Tensor, device: torch.device) -> None:
    try:  # on a scratch generator: the live one stays untouched
        torch.Generator(device=device).set_state(state.clone())
    except RuntimeError as e:
        raise ValueError(f"restored {device.type} RNG state is invalid: {e}") from e


@dataclass(slots=True)
class Restored:
    """Everything decoded and validated from restored bytes, not yet loaded."""

    hypers: list[dict[str, Any]]
    created: list[bool]
    rng_cpu: torch.Tensor
    rng_device: torch.Tensor | None
    states: dict[str, Any]


class SmallState:
    """The ``extra.*`` records of one rank, except the created flags of deferred optimizer
    state (see the module docstring): their tensors, capture, validation and load.

    ``capacity``: bytes reserved per state object's encoded ``state_dict()``, one number
    or a mapping from state key (or :data:`META`) to bytes, with
    :data:`DEFAULT_EXTRA_CAPACITY` for keys it lacks. The meta record also carries the
    owner's layout digest and param-group structure (:meth:`set_layout`), checked by a
    restore before anything is loaded.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stateful: Mapping[str, Stateful],
        device: torch.device,
        capacity: int | Mapping[str, int],
    ) -> None:
        self.optimizer = optimizer
        self.stateful = stateful
        self.device = device
        self._capacity = capacity
        self._blobs: dict[str, torch.Tensor] = {}
        self._blob_len: dict[str, int] = {}
        # The optimizer's class is in the record's name: the layout alone (checked before
        # a restore writes any byte) tells Adam from AdamW, whose tensors are the same.
        self.meta_name = names.meta(type(optimizer).__name__)
        self._add_blob(self.meta_name, self._cap(META, 4096 + 2048 * len(optimizer.param_groups)))
        for key in sorted(self.stateful):
            self._add_blob(names.state(key), self._cap(key, 0))
        self.rng_cpu = torch.get_rng_state().clone()
        self.rng_device: torch.Tensor | None = None
        if self.device.type == "cuda":  # the one device seam for RNG
            self.rng_device = torch.cuda.get_rng_state(self.device).clone()
        self._digest = ""
        self._groups: list[list[Any]] = []

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
        self._blobs[name] = torch.zeros(capacity, dtype=torch.uint8)
        self._blob_len[name] = 0

    def blobs(self) -> list[tuple[str, torch.Tensor]]:
        """The encoded records (meta, then the state objects by key), layout order."""
        return list(self._blobs.items())

    def rngs(self) -> list[tuple[str, torch.Tensor]]:
        """The RNG states (CPU, then the device's), layout order."""
        out = [(names.rng("cpu"), self.rng_cpu)]
        if self.rng_device is not None:
            out.append((names.rng("cuda"), self.rng_device))
        return out

    def set_layout(self, digest: str, groups: list[list[Any]]) -> None:
        """The owner's layout digest and ``[params, digest]`` per param group, recorded in
        the meta record."""
        self._digest, self._groups = digest, groups

    def lr_scheduler_keys(self) -> list[str]:
        kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        return sorted(k for k, obj in self.stateful.items() if isinstance(obj, kinds))

    # ------------------------------------------------------------------ capture
    def capture(self, *, rng: bool, optimizer: bool, state: bool | Iterable[str]) -> None:
        """Refresh the RNG states, the meta record and the state objects' records (all,
        or the keys given) from the live objects."""
        if rng:
            self.rng_cpu.copy_(torch.get_rng_state())
            if self.rng_device is not None:
                self.rng_device.copy_(torch.cuda.get_rng_state(self.device))
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

    def _write(self, name: str, payload: bytes, what: str, key: str) -> None:
        t = self._blobs[name]
        n = _write_blob(t, payload, what, f"extra_capacity_bytes (key {key!r})")
        if n < self._blob_len[name]:  # zero the old tail: the bytes are a function of the state
            t[n : self._blob_len[name]].zero_()
        self._blob_len[name] = n

    # ------------------------------------------------------------------ restore
    def decode_meta(self, read: Callable[[str], torch.Tensor]) -> list[dict[str, Any]]:
        """The restored hyperparameters, once the meta record (``read(name)``: its restored
        bytes) matches this run: format, state keys, optimizer, param groups, layout."""
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
        return hypers

    def decode_records(
        self, read: Callable[[str], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """The restored RNG states (CPU, device) and state objects' ``state_dict()`` by
        key, validated."""
        rng_cpu = read(names.rng("cpu")).detach().cpu().clone()
        _check_rng(rng_cpu, torch.device("cpu"))
        rng_device = None
        if self.rng_device is not None:
            rng_device = read(names.rng("cuda")).detach().cpu().clone()
            _check_rng(rng_device, self.device)
        states = {}
        for key in sorted(self.stateful):
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
        return rng_cpu, rng_device, states

    @torch.no_grad()
    def load_objects(self, r: Restored) -> None:
        """Load every state object, then the hyperparameters; a state object whose load
        fails is rolled back with the others (ValueError)."""
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

    def load_replica(self, keys: Iterable[str]) -> None:
        """Load the RNG states and the state objects ``keys`` from their records (another
        virtual replica's, copied in: :mod:`baft.pipeline.elastic`); validated first."""
        rng_cpu = self._blobs_or_rng(names.rng("cpu")).clone()
        _check_rng(rng_cpu, torch.device("cpu"))
        states = {}
        for key in keys:
            t = self._blobs[names.state(key)]
            states[key] = decode_blob(_read_blob(t, f"state[{key!r}]"), self.device)["state"]
        for key, st in states.items():
            self.stateful[key].load_state_dict(st)
        torch.set_rng_state(rng_cpu)
        if self.rng_device is not None:
            torch.cuda.set_rng_state(self.rng_device.clone(), self.device)

    def _blobs_or_rng(self, name: str) -> torch.Tensor:
        return self.rng_cpu if name == names.rng("cpu") else self._blobs[name]

    def load_rng(self, r: Restored) -> None:
        torch.set_rng_state(r.rng_cpu)
        if r.rng_device is not None:
            torch.cuda.set_rng_state(r.rng_device, self.device)
