"""DCP keys of the disk tier: how a rank names its flat-state tensors in a checkpoint (pure).

A persisted checkpoint must load with plain ``dcp.load`` into the user's own model and
optimizer, so the keys follow torch's (and torchtitan's) conventions. The scheme is
recorded in the checkpoint's ``baft_meta.json`` (:data:`KEYS_META`); baft restores every
scheme it ever wrote:

``"torch"`` (written since issue 30; unique FQNs across pipeline stages)
    parameters and persistent buffers under their plain FQN (the keys of
    ``module.state_dict()``), optimizer state under torch's flattened optimizer
    state-dict convention with torchtitan's ``optimizer`` prefix:
    ``optimizer.state.<fqn>.<key>`` and ``optimizer.param_groups.<fqn>.<hyper>`` (what
    ``get_optimizer_state_dict(..., options=StateDictOptions(
    flatten_optimizer_state_dict=True))`` produces, nested under ``"optimizer"``), so
    ``dcp.load({**model_sd, "optimizer": optim_sd}, checkpoint_id=...)`` reads both.
``"fqn"`` (older checkpoints)
    plain FQNs for the model, ``optim.<fqn>.<key>`` for optimizer state.
``"pp"`` (stages share FQNs, e.g. a fresh ``nn.Sequential`` per stage)
    every key but the ``extra.*`` records gets the rank's pipeline coordinate in front
    (``pp1.0.weight``, ``pp1.optim.0.weight.momentum_buffer``): DCP keeps one writer per
    key, so unprefixed stages would overwrite each other.

``extra.pp<p>.tp<t>.*`` are baft's own per-rank records (RNG, hyperparameters,
``state=`` objects), the same in every scheme.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KEYS_META = "dcp_keys"
"""Entry of a checkpoint's metadata naming its key scheme (absent: ``"fqn"``)."""
SCHEMES = ("torch", "fqn", "pp")
"""Every key scheme baft wrote, newest first."""
UNIQUE_FQN_SCHEMES = ("torch", "fqn")
"""Schemes of jobs whose stages' FQNs are unique (the same model restores from either)."""
OPTIMIZER = "optimizer."
"""Prefix of the optimizer's flattened state dict in a ``"torch"`` checkpoint
(torchtitan's ``OPTIMIZER`` key)."""


def persist_name(flat_name: str) -> str:
    """DCP key of a flat-state tensor in the ``"fqn"`` scheme: model params and persistent
    buffers keep their plain FQN, optimizer state and records keep their names."""
    for prefix in ("model.", "buffer."):
        if flat_name.startswith(prefix):
            return flat_name[len(prefix) :]
    return flat_name


def torch_name(flat_name: str) -> str:
    """DCP key of a flat-state tensor in the ``"torch"`` scheme (see the module docstring)."""
    if flat_name.startswith("optim."):
        return f"{OPTIMIZER}state.{flat_name[len('optim.') :]}"
    return persist_name(flat_name)


@dataclass(frozen=True, slots=True)
class PersistKeys:
    """How one rank names its flat-state tensors in DCP checkpoints (a scheme of
    :data:`SCHEMES`, see the module docstring) and its pipeline coordinate (used by
    ``"pp"``). The same on every rank and launch: :func:`choose_persist_keys` decides
    it from every stage's names."""

    scheme: str = "torch"
    """One of :data:`SCHEMES`."""
    pp: int = 0
    """This rank's pipeline coordinate (used by "pp")."""

    def __post_init__(self) -> None:
        assert self.scheme in SCHEMES, self.scheme

    def __call__(self, flat_name: str) -> str:
        """DCP key of ``flat_name`` (``model.<fqn>``, ``buffer.<fqn>``, ``optim.*``, ``extra.*``)."""
        if self.scheme == "torch":
            return torch_name(flat_name)
        key = persist_name(flat_name)
        if self.scheme == "pp" and not flat_name.startswith("extra."):
            return f"pp{self.pp}.{key}"
        return key

    @property
    def writes_param_groups(self) -> bool:
        """Whether checkpoints of this scheme carry ``optimizer.param_groups.*``."""
        return self.scheme == "torch"

    def param_groups(
        self, groups: Sequence[Sequence[str]], hypers: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]:
        """torch's flattened ``param_groups`` entries: ``optimizer.param_groups.<fqn>.<k>``
        for every parameter FQN of every group (``groups``) and every hyperparameter of
        that group (``hypers``, all keys but ``params``); {} for the older schemes."""
        if not self.writes_param_groups:
            return {}
        if len(groups) != len(hypers):
            raise ValueError(f"{len(groups)} param groups but {len(hypers)} hyperparameter sets")
        return {
            f"{OPTIMIZER}param_groups.{fqn}.{k}": v
            for fqns, hyper in zip(groups, hypers, strict=True)
            for fqn in fqns
            for k, v in hyper.items()
            if k != "params"
        }


def choose_persist_keys(stage_names: Iterable[tuple[int, Iterable[str]]]) -> tuple[str, str]:
    """The key scheme of a job (pure): ``("torch", reason)`` when no DCP key of a
    flat-state name repeats across pipeline coordinates, else ``("pp", reason)`` naming
    one that does.

    ``stage_names``: (pp coordinate, flat-state names) of one rank per pipeline
    coordinate, or of more (TP and DP peers of a stage share names; that is no clash)."""
    owner: dict[str, int] = {}
    for pp, names in sorted(stage_names, key=lambda s: s[0]):
        for name in names:
            if name.startswith("extra."):
                continue
            key = torch_name(name)
            first = owner.setdefault(key, pp)
            if first != pp:
                return "pp", (
                    f"DCP keys carry the pipeline stage (pp<i>.<fqn>): {key!r} is on "
                    f"pp{first} and pp{pp}"
                )
    return "torch", (
        "DCP keys are the plain FQNs, optimizer state as torch's flattened optimizer "
        "state dict under 'optimizer.' (unique across pipeline stages)"
    )


def loading_keys(meta: Mapping[str, Any], keys: PersistKeys, where: str) -> PersistKeys:
    """The keys to read checkpoint ``where`` (metadata ``meta``) with, for a job whose own
    keys are ``keys``: its recorded scheme when it fits the job (a ``"fqn"`` checkpoint
    restores into a ``"torch"`` job: the same model, older names). Raise ValueError when
    it cannot; call it before loading a byte."""
    saved = meta.get(KEYS_META, "fqn")
    if saved == keys.scheme:
        return keys
    unique = UNIQUE_FQN_SCHEMES
    if saved in unique and keys.scheme in unique:
        return PersistKeys(scheme=saved, pp=keys.pp)
    if keys.scheme == "pp":
        raise ValueError(
            f"{where} keys tensors by their plain FQNs, but this job's pipeline stages share "
            f"FQNs: its stages overwrote each other's tensors in it, so it cannot be restored "
            f"(written by a baft without stage-unique keys). Delete it, or pick another "
            f"CheckpointConfig.persist.dir, and start over (allow_fresh_start=True)"
        )
    raise ValueError(
        f"{where} keys tensors as {saved!r} (pp<i>.<fqn>: its stages shared FQNs), but "
        f"this job's FQNs are unique across stages, so its model differs from the saved "
        f"one; restore it with the model it was written with"
    )


def check_persist_keys(meta: dict[str, Any], keys: PersistKeys, where: str) -> None:
    """Raise ValueError unless checkpoint metadata ``meta`` (of ``where``) can be read
    with ``keys``' job (see :func:`loading_keys`)."""
    loading_keys(meta, keys, where)
