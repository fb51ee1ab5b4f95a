"""What a restore needs of one rank's engine: the :class:`Restorable` Protocol.

:func:`baft.recover.runtime.recover_and_start` runs against this interface, not against
:class:`~baft.engine.engine.CheckpointEngine`: the engine implements it, and so can a
test fake (``tests/unit/test_restore_fake.py``). It names everything recovery reads
(the rank's place in the job, its own snapshot store, the DCP tier's settings and keys)
and everything it does to the rank (write restored bytes, apply the small state, forget
the store's versions, start). The live state behind the flat bytes is
:class:`baft.pipeline.live.LiveState`, the Protocol the engine snapshots too. Nothing
here imports the engine; the transport seam (:mod:`baft.engine.transport`) is the one
engine module recovery uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from baft.engine.transport import Transport
from baft.faults.spec import FaultRecord
from baft.pipeline.live import LiveState
from baft.plan.types import TensorSpec
from baft.store.coding import Redundancy
from baft.store.disk import PersistKeys, ShardLayout
from baft.store.shm import SnapshotStore
from baft.topology import Topology

__all__ = ["FaultHook", "FlatBytes", "Restorable"]


class FlatBytes(Protocol):
    """The rank's checkpointed tensors laid end to end as one byte range
    (:class:`~baft.engine.flat.FlatState`): the layout restored bytes are written in."""

    @property
    def names(self) -> Sequence[str]:
        """Flat-state names, canonical order."""
        ...

    @property
    def tensors(self) -> Sequence[torch.Tensor]:
        """The live tensors, in the order of :attr:`names`."""
        ...

    @property
    def nbytes(self) -> int: ...

    def specs(self) -> tuple[TensorSpec, ...]:
        """(name, bytes) of every tensor, canonical order."""
        ...

    def write_from(self, start: int, data: torch.Tensor) -> None:
        """Overwrite flat bytes ``[start, start + len(data))`` of the live tensors."""
        ...


class FaultHook(Protocol):
    """The fault injector's side recovery sees (:class:`baft.faults.injector.FaultInjector`)."""

    def fire(self, point: str, iteration: int) -> None:
        """Fire the faults planned at ``point`` (``"recovery"``: before restored bytes load)."""
        ...

    def fired_records(self) -> Sequence[FaultRecord]:
        """Every fault fired in this job so far (their times: detection to restart)."""
        ...


class Restorable(Protocol):
    """One rank's engine as a restore needs it (see the module docstring)."""

    @property
    def rank(self) -> int: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def redundancy(self) -> Redundancy: ...

    @property
    def transport(self) -> Transport:
        """The checkpoint group: inventories, plan agreement, shard transfers."""
        ...

    @property
    def store(self) -> SnapshotStore:
        """This rank's own snapshot store (its inventory; other stores of the job on this
        host are opened beside it)."""
        ...

    @property
    def location(self) -> str | None:
        """The memory holding the store (ranks with equal locations read each other's
        stores); None: the detected host (:func:`baft.store.paths.host_id`)."""
        ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def flat(self) -> FlatBytes: ...

    @property
    def state(self) -> LiveState: ...

    @property
    def layout_digests(self) -> Mapping[str, str]:
        """Layout digest of every ``(pp, tp)`` by ``"pp{p}.tp{t}"``, checked against the
        digests recorded with what is restored (empty: not checked)."""
        ...

    @property
    def injector(self) -> FaultHook | None: ...

    @property
    def persist_dir(self) -> str | None:
        """The DCP tier's directory (None: no disk tier)."""
        ...

    @property
    def persist_keys(self) -> PersistKeys:
        """DCP keys of this rank's flat-state tensors."""
        ...

    @property
    def persist_layouts(self) -> Mapping[str, ShardLayout]:
        """DCP key -> the DTensor (TP shard) its rank-local tensor belongs to."""
        ...

    @property
    def allow_fresh_start(self) -> bool:
        """A job that made progress may start over when nothing can be restored."""
        ...

    @property
    def first_checkpoint_by(self) -> int:
        """The iteration by which the job's first checkpoint was due (profiling plus one
        interval): a job that ended before it had nothing to restore."""
        ...

    def apply_small_state(self) -> None:
        """Load the restored small state (RNG, hyperparameters, ``state=`` objects) from
        the flat state into the live objects."""
        ...

    def forget_versions(self) -> None:
        """Drop every version and the commit record of the own store (after a restore
        from DCP, or a fresh start: no version of before may mix in later)."""
        ...

    def start(
        self,
        resume_iteration: int,
        restored_version: int | None = None,
        first_version: int | None = None,
        rotation_k: int | None = None,
    ) -> None:
        """Train from ``resume_iteration``; ``restored_version``: what a restore from
        memory brought back (committed already); ``first_version``, ``rotation_k``: its
        differential rotation, which goes on. Collective."""
        ...
