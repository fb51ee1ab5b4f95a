"""A checkpoint plan put into effect on one rank: where plan inputs come from, and what
every owner does when the layout changes.

A plan input (every rank's BubbleMap and layout, rank 0's cost model:
:class:`~baft.store.records.PlanInput`) comes from three places: the run directory, when
a restarted job re-plans at once; the profiled iterations, gathered on every rank; and
the one re-plan on measured copy rates. Rank 0 saves each new one in the run directory.
:class:`PlanAdoption` turns it into the :class:`~baft.engine.rotation.Rotation`'s layout
and hands that to the owners that depend on it: the store's slots (allocated on every
rank at once), the writer, the persister's interval and the SIGTERM grace. A new k or a
moved shard boundary makes the older versions unusable under the new layout: the store
forgets them, keeping the committed one where every rank can.

Every method is collective: every rank calls it at the same iteration with the same
inputs, and reaches the same decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from baft.engine.allocation import StoreSlots
from baft.engine.commit import Commit
from baft.engine.persisting import Persisting
from baft.engine.planning import calibrate, gather_plan_input
from baft.engine.rotation import Rotation
from baft.engine.transport import Transport
from baft.engine.writer import VersionWriter
from baft.liveness.termination import Termination
from baft.store.coding import Redundancy
from baft.store.records import PlanInput
from baft.store.shm import SnapshotStore
from baft.topology import Topology

log = logging.getLogger("baft")


class PlanAdoption:
    """Plans from a profile, re-plans once, and adopts plan inputs for one rank's owners."""

    def __init__(
        self,
        *,
        run_dir: Path,
        rank: int,
        topology: Topology,
        device: torch.device,
        cost: dict[str, float] | None,
        redundancy: Redundancy,
        transport: Transport,
        rotation: Rotation,
        commit: Commit,
        store: SnapshotStore,
        slots: StoreSlots,
        writer: VersionWriter,
        persisting: Persisting,
        termination: Termination | None,
    ) -> None:
        self.run_dir, self.rank, self.topology, self.device = run_dir, rank, topology, device
        self.cost = cost
        """Configured cost model (None: rank 0 calibrates one after profiling)."""
        self.redundancy, self.transport = redundancy, transport
        self.rotation, self.commit, self.store, self.slots = rotation, commit, store, slots
        self.writer, self.persisting, self.termination = writer, persisting, termination

    def from_profile(self) -> None:
        """Gather every rank's profiled iterations and layout into a plan input, save it
        (rank 0) and adopt it."""
        hashes = self.device.type != "cuda"
        cost = calibrate(self.cost, hashes_on_copy=hashes) if self.rank == 0 else None
        plan_input = PlanInput.from_json(
            gather_plan_input(
                self.transport,
                self.rank,
                self.rotation.profile,
                self.rotation.flat_layout(),
                cost,
                self.topology.world_size,
            )  # fmt: skip
        )
        if self.rank == 0:
            plan_input.save(self.run_dir)
        self.adopt(plan_input, source="profile")

    def replan(self, settle: Callable[[], None]) -> None:
        """Once, after a few checkpoints: re-plan if snapshots copy at another rate than
        the plan assumed. ``settle`` resolves the commit in flight and stops every reader
        of the store before anything changes. If the new plan moves a shard boundary (the
        same decision on every rank), every store forgets its other versions but keeps
        the committed one restorable (budget permitting), and the next checkpoint commits
        under the new layout."""
        nbytes, seconds = self.writer.observed
        rates = self.transport.all_gather_object(nbytes / seconds if seconds > 0 else None)
        replan = self.rotation.replan_input(rates)
        if replan is None:
            return
        plan_input, reason = replan
        assert self.rotation.layout is not None
        before = self.rotation.layout.shards()
        settle()
        if self.rank == 0:
            plan_input.save(self.run_dir)
        kept = self.adopt(plan_input, source=reason)
        if self.rotation.layout.shards() != before:
            # shard layout moved: old versions must not mix with new ones, except the
            # committed one, kept whole in its slot (its manifests describe its own
            # layout): a crash before the first commit under the new layout restores it
            self.store.clear_versions(keep=kept)
            if kept is None:
                self.commit.adopt(None)

    def adopt(self, plan_input: PlanInput, source: str) -> int | None:
        """Adopt ``plan_input``'s layout and allocate the store for it.
        Returns the committed version if it stayed restorable in every store."""
        new_rotation = self.rotation.adopt(plan_input)
        if new_rotation is None:
            return None
        if new_rotation:  # a new k: old payloads do not mix with the new rotation's
            self.store.clear_versions()
            self.commit.adopt(None)
        lay = self.rotation.layout
        assert lay is not None
        kept = self.slots.allocate_everywhere(lay.sizes, keep=self.commit.committed)
        self.writer.use(lay, redundant=self.redundancy.kind != "none")
        self.persisting.interval = lay.plan.interval_iters
        self.persisting.adopted(differential=lay.payload is not None)
        if self.termination is not None:  # a SIGTERM flush comes within ~2 iterations
            ranks = range(len(plan_input.ranks))
            profiled = max(plan_input.bubbles(r).iteration_s for r in ranks)
            self.termination.pace(profiled, profiled=True)  # until an iteration is timed
        assert self.writer.exchange is not None
        paths = self.writer.exchange.paths()
        via = (
            f"redundancy into rank {self.rank}: {paths['shm'] / 2**20:.1f} MiB/version from "
            f"same-host stores, {paths['net'] / 2**20:.1f} MiB over the network"
        )
        log.info("checkpoint plan (%s): %s; %s; %s", source, lay.plan.reason, lay.k_reason, via)
        return kept
