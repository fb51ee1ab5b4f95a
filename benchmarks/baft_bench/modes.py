"""The modes ``baft bench overhead`` compares, by name, and what each engine mode changes.

Every engine mode runs the same :class:`~baft.engine.engine.CheckpointEngine`; an
:class:`EngineArm` says how it differs from the policy ``--checkpoint`` gives:

- ``baft``: differential checkpoints (``full_every`` as the policy says, ``auto`` unless
  set), redundancy over the network transport (gloo), like lm-resiliency's replica: on two
  real hosts every arm would use the network, so the peer comparison does too.
- ``baft-shm``: ``baft`` with the same-host shared-memory path (ranks whose stores share
  this host's memory read each other's committed bytes directly): what one host offers,
  reported as its own row, never as the network number.
- ``baft-noreplica``: ``baft`` with ``redundancy=none``, the arm matched to
  ``dlrover-flash`` (which runs without a replica).
- ``baft-persist``: ``baft`` with ``persist=N`` (``--persist-every N``), the arm matched to
  CheckFreq / DCP / torch-save writing to disk every N-th checkpoint.
- ``baft-persist-proc``: ``baft-persist`` with ``PersistConfig(writer="process")`` (DCP
  saves in a writer process per rank, reading the store's shared memory).
- ``baft-gloo-normal``: ``baft`` with the checkpoint transport's gloo threads at normal
  CPU priority (``BAFT_BACKGROUND_PRIORITY=threads``): what idling them bought.
- ``baft-mem2x`` .. ``baft-mem6x``: ``baft`` with the store budget at that multiple of
  the rank's state (a job whose smallest layout does not fit is refused: its row says so).
- ``baft-full``: the whole state every version (``full_every=1``), network transport.
- ``naive-async``: full snapshots all started at the iteration's start, network transport.

``none`` trains with the instrumented runner and no checkpoints (the reference of every
ratio); ``bare`` runs the bare torch schedule (``TrainConfig(instrument=False)``), pricing
baft's instrumentation against ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass

REFERENCE_MODES = ("none", "bare")
"""Modes without checkpoints: the instrumented runner, the bare torch schedule."""
BASELINE_MODES = ("torch-save", "dcp-async", "checkfreq")
"""Modes implemented in :mod:`baft_bench.baselines` (each writes to disk)."""
ENGINE_MODES = (
    "naive-async", "baft-full", "baft", "baft-shm", "baft-noreplica", "baft-persist",
    "baft-persist-proc", "baft-gloo-normal", "baft-mem2x", "baft-mem3x", "baft-mem4x",
    "baft-mem6x",
)  # fmt: skip
"""Modes provided by ``baft.engine.engine.CheckpointEngine`` (see :data:`ENGINE_ARMS`)."""
PEER_MODES = ("lm-resiliency", "dlrover-flash")
"""Modes backed by published libraries (:mod:`baft_bench.peers`, the ``peers`` extra)."""
ALL_MODES = (*REFERENCE_MODES, *BASELINE_MODES, *ENGINE_MODES, *PEER_MODES)
"""Every mode ``baft bench overhead`` knows, in report order."""
MODE_ALIASES = {"baft-network": "baft", "baft-net": "baft", "baft-nored": "baft-noreplica"}
"""Other spellings ``--modes`` accepts, mapped to the mode they name."""
TRANSPORTS = ("network", "shm", "n/a")
"""How a mode's redundancy moves: over the network transport, through same-host shared
memory, or not applicable (no redundancy: disk only, no replica, no checkpoints)."""


@dataclass(frozen=True, slots=True)
class EngineArm:
    """What an engine mode sets over the ``--checkpoint`` policy."""

    full: bool = False
    """``full_every=1`` (the whole state every version) instead of the policy's value."""
    paths: str = "network"
    """:attr:`baft.config.ExchangeConfig.paths`: "network" or "auto" (same-host shm)."""
    redundancy: str | None = None
    """Redundancy over the policy's (None: the policy's)."""
    persist: bool = False
    """``persist_every`` = ``--persist-every`` (else the policy's)."""
    fixed_paths: bool = False
    """``--engine exchange=`` does not override ``paths`` (the arm is named for it)."""
    writer: str = "thread"
    """:attr:`baft.config.PersistConfig.writer`: who runs ``dcp.save``."""
    priority: str | None = None
    """``BAFT_BACKGROUND_PRIORITY`` while the arm's engine is built (None: as set)."""
    budget_x: float | None = None
    """``StoreConfig.budget_bytes`` as this multiple of the rank's state (None: derived
    from the host): ``full_every=auto`` plans under it, admission refuses below the
    smallest layout."""


ENGINE_ARMS = {
    "naive-async": EngineArm(full=True),
    "baft-full": EngineArm(full=True),
    "baft": EngineArm(),
    "baft-shm": EngineArm(paths="auto", fixed_paths=True),
    "baft-noreplica": EngineArm(redundancy="none"),
    "baft-persist": EngineArm(persist=True),
    "baft-persist-proc": EngineArm(persist=True, writer="process"),
    "baft-gloo-normal": EngineArm(priority="threads"),
    "baft-mem2x": EngineArm(budget_x=2.0),
    "baft-mem3x": EngineArm(budget_x=3.0),
    "baft-mem4x": EngineArm(budget_x=4.0),
    "baft-mem6x": EngineArm(budget_x=6.0),
}
"""Each engine mode's arm (see the module docstring)."""
assert tuple(ENGINE_ARMS) == ENGINE_MODES

DISK_MODES = (*BASELINE_MODES,)
"""Modes whose every checkpoint is a disk write: they checkpoint every ``--persist-every``-th
checkpoint iteration (``--interval`` x ``--persist-every`` iterations), like
``baft-persist``'s disk tier."""


def resolve_modes(names: list[str]) -> list[str]:
    """``names`` with aliases replaced by the modes they name; ValueError names an unknown
    one with every valid name."""
    out = [MODE_ALIASES.get(n, n) for n in names]
    unknown = [n for n, m in zip(names, out, strict=True) if m not in ALL_MODES]
    if unknown:
        raise ValueError(
            f"unknown mode(s) {unknown}: choose from {', '.join(ALL_MODES)} "
            f"(aliases: {', '.join(f'{a}={m}' for a, m in MODE_ALIASES.items())})"
        )
    return out


def engine_transport(paths: str, redundancy: str) -> str:
    """The transport label of an engine mode: "n/a" without redundancy, "shm" for the
    same-host path ("auto": every bench rank is on this host), else "network"."""
    if redundancy.strip() == "none":
        return "n/a"
    return "shm" if paths == "auto" else "network"


def mode_transport(mode: str) -> str:
    """The transport label of a non-engine mode."""
    return "network" if mode == "lm-resiliency" else "n/a"
