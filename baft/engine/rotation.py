"""The rotation: which plan, which full_every (k), which payload layout, since which version.

One owner for what used to be a dozen engine fields kept in step by hand. It turns the
planner's inputs (:class:`~baft.store.records.PlanInput`) into an immutable
:class:`Layout` (the plan, k, the payload views, this rank's snapshot schedule, the
redundancy group and the store sizes), tracks where the current differential rotation
began, counts checkpoints and copy rates for the one re-plan, and says which versions'
payloads a new version must keep. It allocates nothing and does no collective: the
engine does those with what it hands out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from baft.config import CheckpointConfig
from baft.engine.differential import PayloadViews, Record, RecordCapture
from baft.engine.flat import FlatState
from baft.engine.planning import (
    REPLAN_AFTER_CHECKPOINTS,
    SnapshotSchedule,
    auto_k,
    plan_of,
    replan_rate,
)
from baft.plan.cost import CostModel
from baft.plan.payload import PayloadLayout
from baft.plan.types import CheckpointPlan
from baft.store.coding import GroupLayout, Redundancy, group_layouts
from baft.store.records import DiffMeta, PlanInput
from baft.topology import Topology

log = logging.getLogger("baft")


@dataclass(frozen=True)
class Layout:
    """What every version of one plan writes; a re-plan or a new rotation makes a new one."""

    plan: CheckpointPlan
    k: int
    """full_every (1: the whole state every version)."""
    k_reason: str
    payload: PayloadViews | None
    """Differential (k > 1): the payload of each version over the live tensors."""
    schedule: SnapshotSchedule
    """This rank's snapshot tasks over the flat state, or over version 0's payload."""
    group: GroupLayout
    data_nbytes: int
    red_nbytes: int
    num_slots: int

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Store allocation: shard bytes, redundancy bytes, slots."""
        return self.data_nbytes, self.red_nbytes, self.num_slots

    def shards(self) -> dict[int, tuple[int, int]]:
        """Rank -> its owned byte range of the (payload) state."""
        return {r: (p.owned_start, p.owned_stop) for r, p in self.plan.ranks.items()}


class Rotation:
    """Plan, k, first version of the rotation, payload layout and the one re-plan."""

    def __init__(
        self,
        ck: CheckpointConfig,
        *,
        rank: int,
        topology: Topology,
        redundancy: Redundancy,
        flat: FlatState,
        named: list[tuple[str, Any]],
    ) -> None:
        self.ck = ck
        self.rank = rank
        self.topology = topology
        self.redundancy = redundancy
        self.flat = flat
        self._named = named
        self.layout: Layout | None = None
        self.records: RecordCapture | None = None
        """Differential: captures each step's record (None with full_every=1)."""
        self.first_version: int | None = None
        """First version of the current rotation (differential: versions before
        ``first_version + k - 1`` are not rebuildable)."""
        self.plan_input: PlanInput | None = None
        self.plan_iteration = ck.profile_iters
        """The iteration after which the profile is planned (-1 once planned)."""
        self.profile: list[dict[str, Any]] = []
        self._restored_k: int | None = None
        self._checkpoints = 0
        """Checkpoints written under the current plan (the re-plan waits for a few)."""

    @property
    def k(self) -> int:
        return self.layout.k if self.layout is not None else 1

    def begin(
        self,
        resume_iteration: int,
        first_version: int | None,
        rotation_k: int | None,
        records: RecordCapture | None,
    ) -> None:
        """Where a (restored) job starts: the restored rotation goes on with its k."""
        self.first_version = first_version
        self._restored_k = rotation_k
        self.records = records
        self.plan_iteration = max(resume_iteration, 0) + self.ck.profile_iters

    # ------------------------------------------------------------------ planning
    def profiled(self, iteration: int, timeline: dict[str, Any]) -> bool:
        """Add an unplanned iteration's timeline; whether the profile is complete."""
        self.profile.append(timeline)
        return iteration + 1 >= self.plan_iteration >= 0

    def adopt(self, plan_input: PlanInput) -> bool | None:
        """Make the layout of ``plan_input``; returns whether a new rotation begins (its
        k differs from the last plan's: old payloads must not mix with the new ones), or
        None when the input is of another world size (ignored). The same on every rank."""
        if plan_input.world_size != self.topology.world_size:
            return None
        if plan_input.layout(self.rank) != self.flat_layout():
            raise RuntimeError(f"rank {self.rank}: saved plan input does not match this model")
        self.plan_input = plan_input
        self._checkpoints = 0
        k, reason = self._choose_k(plan_input)
        new_rotation = self.layout is not None and k != self.layout.k
        if new_rotation:
            self.first_version = None
        if k == 1:
            # Full snapshots every version: no payload carries a record, and holding the
            # last step's gradients would keep a second gradient set alive (device memory
            # on an accelerator) and encode the hyperparameters every step, for nothing.
            # A re-plan keeps k, so the record is never needed again in this run.
            self.records = None
        self.layout = self._layout_of(plan_input, k, reason)
        self.plan_iteration = -1
        return new_rotation

    def flat_layout(self) -> Any:
        from baft.plan.types import StateLayout

        return StateLayout(
            rank=self.rank, tensors=self.flat.specs(), replicas=self.topology.replicas(self.rank)
        )

    def _layout_of(self, plan_input: PlanInput, k: int, reason: str) -> Layout:
        payload = (
            PayloadViews(PayloadLayout.of(self.flat.specs(), k), self._named) if k > 1 else None
        )
        plan = plan_of(plan_input.to_json(), k, self.ck.policy)
        source = payload.flat(0, None) if payload is not None else self.flat
        schedule = SnapshotSchedule.of(plan, self.rank, source)
        shards = {r: p.owned_stop - p.owned_start for r, p in plan.ranks.items()}
        group = group_layouts(self.topology, self.redundancy, shards)[self.rank]
        return Layout(
            plan=plan, k=k, k_reason=reason, payload=payload, schedule=schedule, group=group,
            data_nbytes=schedule.nbytes, red_nbytes=group.redundancy_nbytes(self.rank),
            num_slots=max(2, k + 1),
        )  # fmt: skip

    def _choose_k(self, plan_input: PlanInput) -> tuple[int, str]:
        """full_every of a plan: kept by a re-plan or a restored rotation, else the
        policy's, or with ``auto`` what the bubbles and the memory budget allow (see
        :func:`baft.engine.planning.auto_k`; the same on every rank)."""
        if self.layout is not None:  # a re-plan keeps k: a new rotation would open a gap
            return self.layout.k, self.layout.k_reason
        if self.records is None:
            return 1, "full_every=1"
        if self._restored_k is not None:  # the restored rotation goes on
            return self._restored_k, f"full_every={self._restored_k} (the restored rotation's)"
        policy = self.ck.policy
        if policy.full_every >= 1:
            return policy.full_every, f"full_every={policy.full_every} (configured)"
        budget = self.ck.store.budget_bytes  # agreed by build_engine; None: no budget known
        return auto_k(
            plan_input.to_json(), policy, self.topology, self.redundancy, budget or 1 << 62
        )

    # ------------------------------------------------------------------ re-plan
    def checkpoint_written(self) -> bool:
        """Count a checkpoint of the current plan; whether the one re-plan is due now."""
        self._checkpoints += 1
        p = self.plan_input
        return p is not None and not p.replanned and self._checkpoints >= REPLAN_AFTER_CHECKPOINTS

    def replan_input(self, rates: list[float | None]) -> tuple[PlanInput, str] | None:
        """The re-plan's input (this rotation's, with the slowest measured copy rate) and
        its reason, or None to keep the plan. Marks the re-plan done either way. The same
        on every rank (``rates``: every rank's measured rate)."""
        assert self.plan_input is not None and self.layout is not None
        self.plan_input.replanned = True
        rate = replan_rate(self.plan_input.to_json(), rates)
        if rate is None:
            return None
        assumed = float(self.plan_input.cost.get("copy_Bps", CostModel().copy_Bps))
        trial = self.plan_input.with_copy_rate(rate)
        if self.layout.k > 1:
            moved = plan_of(trial.to_json(), self.layout.k, self.ck.policy).ranks
            before = self.layout.shards()
            if any((p.owned_start, p.owned_stop) != before[r] for r, p in moved.items()):
                # Differential versions rebuild from a whole window of payloads of one
                # layout: moving the shard boundaries would forget the rotation and leave
                # the next k-1 versions unrebuildable (a crash there could only start
                # over). Keeping a plan that misjudges the copy rate costs some overlap;
                # that gap would cost the job. Same decision on every rank.
                if self.rank == 0:
                    log.warning(
                        "not re-planning: snapshots copy at %.2f GB/s (assumed %.2f), but a "
                        "new plan would move the shard boundaries, and a differential "
                        "rotation (full_every=%d) cannot carry over to a new layout",
                        rate / 1e9, assumed / 1e9, self.layout.k,
                    )  # fmt: skip
                return None
        reason = f"re-plan: snapshots copy at {rate / 1e9:.2f} GB/s, assumed {assumed / 1e9:.2f}"
        return trial, reason

    # ------------------------------------------------------------------ versions
    def open_version(self, version: int) -> range:
        """``version`` is written now: the versions whose payloads it must keep (the ones
        that rebuild the newest version written, also when its vote failed: parity may
        still rebuild it; the store lets this window win over an older commit record)."""
        if self.first_version is None:
            self.first_version = version
        k = self.k
        return range(max(self.first_version, version - k), version) if k > 1 else range(0)

    def source(self, version: int) -> tuple[FlatState, SnapshotSchedule, bool]:
        """What ``version``'s snapshot tasks copy: the flat state, or (differential) its
        payload over the live tensors and the record it carries; with the schedule over
        it and whether it carries a record."""
        lay = self.layout
        assert lay is not None
        if lay.payload is None or self.records is None:
            return self.flat, lay.schedule, False
        record: Record | None = self.records.for_version(version)
        source = lay.payload.flat(version, record)
        return source, SnapshotSchedule.of(lay.plan, self.rank, source), record is not None

    def take_record(self, step: int) -> None:
        """Just before ``optimizer.step``: what it consumes is the next payload's record."""
        if self.records is not None:
            self.records.take(step)

    def diff_meta(self, version: int, has_record: bool) -> DiffMeta | None:
        lay = self.layout
        if lay is None or lay.payload is None:
            return None
        assert self.first_version is not None
        return DiffMeta(
            k=lay.k,
            slice=version % lay.k,
            first_version=self.first_version,
            has_record=has_record,
            payload_nbytes=lay.payload.layout.nbytes,
        )
