"""Canonical names of a rank's checkpointed tensors: the one place that spells them (pure).

Every tensor baft checkpoints has a name ``<kind>.<rest>``:

- ``model.<fqn>``: a parameter (``fqn`` as ``module.named_parameters()`` gives it);
- ``buffer.<fqn>``: a persistent buffer;
- ``optim.<fqn>.<key>``: optimizer state ``key`` (``exp_avg``, ``step``, ...) of the
  parameter ``model.<fqn>``;
- ``extra.<...>``: small state, encoded or raw: the optimizer record
  ``extra.meta.<optimizer class>``, each ``state=`` object ``extra.state.<key>``, the RNG
  states ``extra.rng.cpu`` / ``extra.rng.cuda``, the deferred-state flags
  ``extra.optim.created``. The engine puts a rank's coordinates after the kind
  (``extra.pp<p>.tp<t>.rng.cpu``, :func:`extra_prefix`). With DP replicas the records
  each replica keeps for itself (``state=`` objects and RNG, :func:`is_per_replica`)
  are in the layout once per replica, the replica's index after the record's kind
  (``extra.state.dp<d>.<key>``, ``extra.rng.dp<d>.cpu``, :func:`replica`).

A differential payload adds ``grad.<fqn>``, the gradient record of ``model.<fqn>``.
A parameter and its optimizer state form one tensor group, named by the parameter's FQN
(:func:`group_of`). Only strings here: no torch, no I/O.
"""

from __future__ import annotations

MODEL = "model."
"""Prefix of parameters: ``model.<fqn>``."""
BUFFER = "buffer."
"""Prefix of persistent buffers: ``buffer.<fqn>``."""
OPTIM = "optim."
"""Prefix of optimizer state: ``optim.<fqn>.<key>``."""
EXTRA = "extra."
"""Prefix of small state (records, RNG, ``state=`` objects)."""
GRAD = "grad."
"""Prefix of a differential payload's gradient record: ``grad.<fqn>``."""

EXTRA_META = EXTRA + "meta."
"""The optimizer record is ``extra.meta.<optimizer class>``."""
EXTRA_STATE = EXTRA + "state."
"""A registered ``state=`` object's record: ``extra.state.<key>``."""
EXTRA_RNG = EXTRA + "rng."
"""An RNG state: ``extra.rng.<device type>``."""
OPTIM_CREATED = EXTRA + "optim.created"
"""One byte per deferred optimizer state (SGD's momentum): created yet or not."""

KINDS = ("model", "buffer", "optim", "extra")
"""The kinds of a flat-state tensor name, in canonical order."""


def model(fqn: str) -> str:
    """``model.<fqn>``."""
    return MODEL + fqn


def buffer(fqn: str) -> str:
    """``buffer.<fqn>``."""
    return BUFFER + fqn


def optim(fqn: str, key: str) -> str:
    """``optim.<fqn>.<key>``."""
    return f"{OPTIM}{fqn}.{key}"


def grad(fqn: str) -> str:
    """``grad.<fqn>``."""
    return GRAD + fqn


def meta(optimizer_class: str) -> str:
    """``extra.meta.<optimizer class>``."""
    return EXTRA_META + optimizer_class


def state(key: str) -> str:
    """``extra.state.<key>``."""
    return EXTRA_STATE + key


def rng(device_type: str) -> str:
    """``extra.rng.<device type>`` (``cpu``, ``cuda``)."""
    return EXTRA_RNG + device_type


def is_per_replica(name: str) -> bool:
    """A record each DP replica keeps for itself: a ``state=`` object or an RNG state."""
    return name.startswith(EXTRA_STATE) or name.startswith(EXTRA_RNG)


def replica(name: str, dp: int) -> str:
    """DP replica ``dp``'s copy of a per-replica record: ``extra.state.<key>`` ->
    ``extra.state.dp<dp>.<key>``, ``extra.rng.cpu`` -> ``extra.rng.dp<dp>.cpu``."""
    for prefix in (EXTRA_STATE, EXTRA_RNG):
        if name.startswith(prefix):
            return f"{prefix}dp{dp}.{name[len(prefix) :]}"
    raise ValueError(f"{name!r} is no per-replica record ({EXTRA_STATE}<key>, {EXTRA_RNG}<device>)")


def split(name: str) -> tuple[str, str]:
    """``(kind, rest)``: ``"optim.a.w.exp_avg"`` -> ``("optim", "a.w.exp_avg")``.
    ValueError for a name of no kind in :data:`KINDS`."""
    kind, dot, rest = name.partition(".")
    if not dot or kind not in KINDS:
        raise ValueError(f"{name!r} is no canonical tensor name (kinds: {', '.join(KINDS)})")
    return kind, rest


def is_model(name: str) -> bool:
    return name.startswith(MODEL)


def is_optim(name: str) -> bool:
    return name.startswith(OPTIM)


def is_extra(name: str) -> bool:
    return name.startswith(EXTRA)


def is_meta(name: str) -> bool:
    return name.startswith(EXTRA_META)


def param_of_optim(name: str) -> str:
    """The parameter FQN of ``optim.<fqn>.<key>`` (the key has no dot)."""
    if not is_optim(name):
        raise ValueError(f"{name!r} is no optimizer state name ({OPTIM}<fqn>.<key>)")
    return name[len(OPTIM) :].rsplit(".", 1)[0]


def group_of(name: str) -> str | None:
    """The tensor group (parameter FQN) of a flat-state tensor name, None for the rest.

    ``model.<fqn>`` is the parameter itself, ``optim.<fqn>.<key>`` its optimizer state.
    """
    if is_model(name):
        return name[len(MODEL) :]
    if is_optim(name):
        return param_of_optim(name)
    return None


def plain_fqn(name: str) -> str:
    """``model.<fqn>`` and ``buffer.<fqn>`` -> ``<fqn>`` (the keys of
    ``module.state_dict()``); every other name unchanged."""
    for prefix in (MODEL, BUFFER):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def extra_prefix(pp: int, tp: int) -> str:
    """``extra.pp<pp>.tp<tp>.``: where a rank's coordinates go in its ``extra.*`` names."""
    return f"{EXTRA}pp{pp}.tp{tp}."


def with_coords(name: str, prefix: str) -> str:
    """``extra.<rest>`` -> ``<prefix><rest>`` (``prefix`` from :func:`extra_prefix`);
    every other name unchanged."""
    return prefix + name[len(EXTRA) :] if is_extra(name) else name


def without_coords(name: str, prefix: str) -> str:
    """The inverse of :func:`with_coords`."""
    return EXTRA + name[len(prefix) :] if name.startswith(prefix) else name
