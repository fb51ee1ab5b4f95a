"""Typed records that the engine writes and recovery reads: one definition for both.

- :class:`DiffMeta`: what a differential version's manifest says of its rotation (the
  ``"diff"`` entry of ``Manifest.meta``); its window follows :mod:`baft.plan.rotation`.
- :class:`PlanInput`: the planner's inputs saved in the run directory
  (:data:`~baft.plan.inputs.PLAN_INPUT_FILE`): every rank's BubbleMap and state layout,
  rank 0's cost model, the world size, and whether the one re-plan already ran. Read and
  written only here.
- :data:`CLOSED_FILE`: the run directory's record of a clean end (written by
  ``baft.engine.closing``), read back by :func:`read_closed` when a relaunch finds no
  stores.

Pure data and JSON; ``PlanInput.load``/``save`` and :func:`read_closed` are the only file
I/O.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baft.plan.inputs import PLAN_INPUT_FILE, bmap_from_json, layout_from_json
from baft.plan.rotation import rebuildable, window
from baft.plan.types import BubbleMap, StateLayout

DIFF_KEY = "diff"
"""Key of :class:`DiffMeta` in a manifest's ``meta``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DiffMeta:
    """The rotation a differential version belongs to (full_every > 1)."""

    k: int
    """full_every of the rotation."""
    slice: int
    """Slice whose full copy this version's payload carries (``version % k``)."""
    first_version: int
    """First version of the rotation: versions before ``first_version + k - 1`` are not
    rebuildable from it."""
    has_record: bool
    """Whether the payload carries the gradient record of step ``version - 1``."""
    payload_nbytes: int
    """Bytes of one payload (the stage's whole state: slice + record + small state)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DiffMeta:
        return cls(
            k=int(d["k"]),
            slice=int(d["slice"]),
            first_version=int(d["first_version"]),
            has_record=bool(d["has_record"]),
            payload_nbytes=int(d["payload_nbytes"]),
        )

    @classmethod
    def of_meta(cls, meta: dict[str, Any] | None) -> DiffMeta | None:
        """The record in a manifest's ``meta``, or None for a full snapshot."""
        d = (meta or {}).get(DIFF_KEY)
        return cls.from_json(d) if d else None

    def same_rotation(self, other: DiffMeta | None) -> bool:
        return other is not None and (other.k, other.first_version) == (
            self.k,
            self.first_version,
        )

    def window(self, version: int) -> range | None:
        """Payload versions rebuilding ``version`` needs (:func:`baft.plan.rotation.window`),
        or None while the rotation is not a whole window old at ``version``."""
        return window_of(version, self.k, self.first_version)


def window_of(version: int, k: int, first_version: int) -> range | None:
    """:func:`baft.plan.rotation.window` of ``version``, or None where it is not
    :func:`~baft.plan.rotation.rebuildable` (no anchor: a rotation is rebuildable only
    from a whole window of its own payloads)."""
    if version < first_version or not rebuildable(version, k, first_version):
        return None
    return window(version, k, first_version)


@dataclass(kw_only=True)
class PlanInput:
    """Everything the pure planner needs, gathered once from every rank (see
    :func:`baft.engine.planning.gather_plan_input`), saved so a restart re-plans at once."""

    ranks: list[dict[str, Any]]
    """Per rank (index = rank): ``{"bubbles": BubbleMap JSON, "layout": StateLayout JSON}``."""
    cost: dict[str, float]
    """Rank 0's cost model (configured or calibrated)."""
    world_size: int | None = None
    replanned: bool = False
    """The one re-plan (after measuring the copy rate) already ran in this job."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know, written back unchanged."""

    def layout(self, rank: int) -> StateLayout:
        return layout_from_json(self.ranks[rank]["layout"])

    def bubbles(self, rank: int) -> BubbleMap:
        return bmap_from_json(self.ranks[rank]["bubbles"])

    def saved_tensors(self, rank: int) -> list[tuple[str, int]] | None:
        """(name, bytes) of ``rank``'s tensors at plan time, or None if unknown."""
        if rank >= len(self.ranks):
            return None
        return [(str(n), int(b)) for n, b in self.ranks[rank]["layout"]["tensors"]]

    def with_copy_rate(self, copy_Bps: float) -> PlanInput:  # noqa: N803 - the cost key
        return dataclasses.replace(self, cost={**self.cost, "copy_Bps": copy_Bps})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.extra, "ranks": self.ranks, "cost": self.cost}
        if self.world_size is not None:
            out["world_size"] = self.world_size
        if self.replanned:
            out["replanned"] = True
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PlanInput:
        known = {"ranks", "cost", "world_size", "replanned"}
        return cls(
            ranks=list(d["ranks"]),
            cost=dict(d.get("cost") or {}),
            world_size=d.get("world_size"),
            replanned=bool(d.get("replanned", False)),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def load(cls, run_dir: str | Path) -> PlanInput | None:
        """The run directory's saved inputs, or None when the job never planned."""
        path = Path(run_dir) / PLAN_INPUT_FILE
        return cls.from_json(json.loads(path.read_text())) if path.exists() else None

    @classmethod
    def load_for(cls, run_dir: str | Path, world_size: int) -> PlanInput | None:
        """The saved inputs of a job of ``world_size`` ranks: the newest, or those a job
        of that size saved before it shrank or grew (an elastic job going back to a size
        it ran at re-plans at once); None when no job of that size planned (the job
        profiles: neither the bubbles nor the layout per rank of another size hold)."""
        saved = cls.load(run_dir)
        if saved is not None and saved.world_size in (None, world_size):
            return saved
        path = Path(run_dir) / _sized(world_size)
        return cls.from_json(json.loads(path.read_text())) if path.exists() else None

    def save(self, run_dir: str | Path) -> None:
        """Atomically replace the run directory's saved inputs (call on one rank), and
        those of its world size (:meth:`load_for`)."""
        names = [PLAN_INPUT_FILE]
        if self.world_size is not None:
            names.append(_sized(self.world_size))
        for name in names:
            tmp = Path(run_dir) / (name + ".tmp")
            tmp.write_text(json.dumps(self.to_json()))
            tmp.replace(Path(run_dir) / name)


def _sized(world_size: int) -> str:
    """The file of the saved inputs of a job of ``world_size`` ranks."""
    return PLAN_INPUT_FILE.replace(".json", f".w{world_size}.json")


CLOSED_FILE = "progress/closed.json"
"""Run-directory record of a clean end: version, whether the stores were freed, and the
newest DCP version then."""


def read_closed(run_dir: Path) -> dict[str, Any] | None:
    """The record of the run's clean end, or None (none, or unreadable)."""
    try:
        out = json.loads((Path(run_dir) / CLOSED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None
