"""The checkpoint engine of one rank: plan, snapshot in bubbles, protect, commit, persist.

Lifecycle (all ranks in lock-step, driven by the step runner's :class:`StepHooks`):

1. **Profile.** The first ``profile_iters`` iterations run unprotected; their timelines
   give this rank's BubbleMap. After them every rank gathers all BubbleMaps and state
   layouts and runs the pure planner (:mod:`baft.engine.planning`): identical inputs,
   identical :class:`CheckpointPlan` everywhere. A restarted job re-plans at once from
   the saved inputs.
2. **Snapshot (iteration v, version v).** At each slot the rank starts the copies of the
   chunks planned there from the live tensors into the store slot for v (hashing on the
   way) and the worker posts the redundancy those bytes complete. Leftovers run just
   before ``optimizer.step`` and count as exposed time, so the snapshot is always a
   consistent copy of version v.
3. **Protect and commit.** After the step the rank waits for its redundancy pieces,
   encodes parity, records the manifest and posts its vote (:mod:`baft.engine.versions`);
   version v is committed at the next version's start if every rank completed it. The
   store never overwrites the newest committed version.
4. **Persist.** Every ``persist_every`` committed checkpoints the committed slot is
   written as a DCP checkpoint in the background.

The engine does no set-up I/O of its own: :func:`baft.engine.build.build_engine` makes
its store, transport, copiers, worker and persister and hands them in.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from baft.config import CheckpointConfig
from baft.engine.closing import end_of_job
from baft.engine.device import ChunkCopy, DeviceCopy, HostPins
from baft.engine.differential import PayloadViews, RecordCapture
from baft.engine.flat import FlatState, Piece
from baft.engine.persisting import LiveCopy, flush, replica_share, slot_views
from baft.engine.planning import (
    REPLAN_AFTER_CHECKPOINTS,
    SPILL,
    SnapshotSchedule,
    auto_k,
    calibrate,
    gather_plan_input,
    load_plan_input,
    plan_of,
    replan_rate,
    save_plan_input,
)
from baft.engine.redundancy import PeerStoreGone, RedundancyExchange
from baft.engine.termination import Termination
from baft.engine.transport import Transport
from baft.engine.versions import COMPONENTS, CommitVote, PersistSchedule, Version
from baft.engine.worker import ProtectWorker
from baft.pipeline import IterationTimeline
from baft.pipeline.layout import GlobalLayout
from baft.plan.cost import CostModel
from baft.plan.inputs import bmap_from_json, layout_from_json
from baft.plan.payload import PayloadLayout
from baft.plan.types import CheckpointPlan, StateLayout, Task
from baft.store import reclaim
from baft.store.coding import GroupLayout, Redundancy, coding_groups, group_layouts
from baft.store.disk import KEYS_META, Persister, PersistKeys
from baft.store.manifest import ChunkRecord, Manifest, checksum, region_records
from baft.store.peer import PeerStore
from baft.store.shm import MemoryBudgetError, SnapshotStore
from baft.topology import Topology

__all__ = ["COMPONENTS", "SPILL", "CheckpointEngine", "EngineParts", "StateSource"]

log = logging.getLogger("baft")


class StateSource(Protocol):
    """What the engine snapshots: a fixed list of named tensors, plus small state (RNG,
    hyperparameters, stateful objects) that lives in some of those tensors."""

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every checkpointed tensor, canonical order; the list never changes."""
        ...

    def capture(self) -> None:
        """Refresh the small-state tensors from the live objects (a version's start)."""
        ...

    def apply(self) -> None:
        """Load the small state from its tensors into the live objects (after a restore)."""
        ...

    def check_layout(self, saved: list[tuple[str, int]]) -> None:
        """Raise ValueError naming the differences unless ``saved`` ((name, bytes) as
        :meth:`named_tensors` names them) is this layout; before restored bytes are written."""
        ...

    def named_params(self) -> dict[str, torch.Tensor]:
        """Parameter FQN -> parameter (the ``model.<fqn>`` tensors' owners)."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


@dataclass
class EngineParts:
    """The engine's collaborators, made by :func:`baft.engine.build.build_engine`."""

    store: SnapshotStore
    transport: Transport
    copier: DeviceCopy
    """Copies live tensors at their slots (synchronous on CPU, asynchronous otherwise)."""
    spill_copier: DeviceCopy
    """Copies that fit no bubble, started at the iteration's start (always asynchronous)."""
    worker: ProtectWorker
    peers: dict[int, PeerStore]
    """Other ranks whose stores share this host's memory."""
    persister: Persister | None
    location: str | None = None
    """The memory holding this rank's store (:func:`baft.topology.memory_domains`): ranks
    with equal locations read each other's stores. None: the detected host id."""
    injector: Any = None
    """A :class:`baft.faults.injector.FaultInjector`, or None."""
    termination: Termination | None = None
    """SIGTERM flag: flush to DCP and exit at the next agreed commit (None: off)."""
    keys: PersistKeys = PersistKeys()
    """DCP keys of this rank's tensors (the job's scheme, agreed by every rank)."""


class CheckpointEngine:
    """Implements the step runner's StepHooks; see the module docstring."""

    bubble_aware = True
    """Runs snapshot work at its planned slots (the naive-async baseline does not)."""

    def __init__(
        self,
        ck: CheckpointConfig,
        run_dir: Path,
        *,
        topology: Topology,
        rank: int,
        device: torch.device,
        state: StateSource,
        parts: EngineParts,
    ) -> None:
        self.ck = ck
        self.policy = ck.policy
        self.run_dir = Path(run_dir)
        self.topology = topology
        self.rank = rank
        self.device = device
        self.state = state
        self.flat = FlatState(state.named_tensors())
        self._layouts: dict[str, str] = dict(getattr(state, "layout_digests", {}))
        """Layout digest per ``"pp{p}.tp{t}"`` (see ``RunnerState.layout_digests``)."""
        self.store = parts.store
        self.transport = parts.transport
        self.copier = parts.copier
        self.spill_copier = parts.spill_copier
        self._pins = HostPins()
        """Store slots page-locked for CUDA copies, unregistered before they go."""
        self.worker = parts.worker
        self.peers = parts.peers
        self.location = parts.location
        self.injector = parts.injector
        self.termination = parts.termination
        self.persist_keys = parts.keys
        layouts: dict[str, GlobalLayout] = getattr(state, "global_layouts", dict)()
        self.persist_layouts = {self.persist_keys(n): g for n, g in layouts.items()}
        """DCP key -> the DTensor (TP shard) its rank-local tensor belongs to."""
        if parts.persister is not None:
            parts.persister.layouts = self.persist_layouts
        self.redundancy = Redundancy.parse(self.policy.redundancy)
        coding_groups(self.topology, self.redundancy)  # validates the layout early
        self.votes = CommitVote(self.transport, self.store)
        self.persists = PersistSchedule(parts.persister, self.policy.persist_every)
        self.enabled = True
        self.plan: CheckpointPlan | None = None
        self.group_layout: GroupLayout | None = None
        self.exchange: RedundancyExchange | None = None
        self.schedule = SnapshotSchedule()
        self.source = self.flat
        """The bytes a version's snapshot tasks copy: the flat state, or (differential)
        that version's payload."""
        self.worker_thread: threading.Thread | None = None
        """Set while snapshots run on the worker itself (naive-async)."""
        self.skip_version: int | None = None
        """The version a restore brought back: it is committed already, not rewritten."""
        self.k = 1
        """full_every of the current plan (1: whole state every version)."""
        self.first_version: int | None = None
        """First version of the current rotation (differential: versions before
        ``first_version + k - 1`` are not rebuildable)."""
        self.payload: PayloadViews | None = None
        self.records: RecordCapture | None = None
        self._k_reason = "full_every=1"
        self._persist_copy = LiveCopy(device, self.persist_keys)
        self._rotation_k: int | None = None
        self._iteration_s = 0.0
        self._last_step_t: float | None = None
        self._reclaim_after: int | None = None
        """Restored from memory at this version: once the own stores hold a whole newer
        window, copies left by an earlier rank numbering are freed."""
        self._sizes = (0, 0, 2)
        """Store allocation of the plan: shard bytes, redundancy bytes, slots."""
        self.plan_iteration = ck.profile_iters
        self.last_metrics: dict[str, Any] = {}
        self._profile: list[dict[str, Any]] = []
        self._cur: Version | None = None
        self._issuer: ThreadPoolExecutor | None = None
        """CUDA: the thread that issues the iteration-start copies (see before_iteration)."""
        if getattr(self.spill_copier, "issues_off_thread", False):
            self._issuer = ThreadPoolExecutor(1, thread_name_prefix="baft-issue")
        self._issuing: Future[None] | None = None
        self._plan_input: dict[str, Any] | None = None
        self._checkpoints_since_plan = 0
        self._observed: tuple[int, float] = (0, 0.0)

    @property
    def committed(self) -> int | None:
        """Newest globally committed version."""
        return self.votes.committed

    # ------------------------------------------------------------------ set-up
    def layout(self) -> StateLayout:
        return StateLayout(
            rank=self.rank, tensors=self.flat.specs(), replicas=self.topology.replicas(self.rank)
        )

    def start(
        self,
        resume_iteration: int,
        restored_version: int | None = None,
        first_version: int | None = None,
        rotation_k: int | None = None,
    ) -> None:
        """Train from ``resume_iteration``; ``restored_version`` is what a restore from
        memory brought back (committed already), ``first_version`` and ``rotation_k`` the
        start and full_every of its differential rotation (its payloads stay in the store
        and the rotation goes on with the same k). Re-plans at once from a saved profile.
        Collective: every rank calls it once."""
        self.skip_version = restored_version
        self.first_version = first_version
        self._rotation_k = rotation_k
        self._reclaim_after = restored_version
        if restored_version is not None:
            self.votes.adopt(restored_version)
        if self.policy.full_every != 1:
            from baft.pipeline.replay import replay_safe

            why = replay_safe(self.state.optimizer)
            if why is None:
                self.records = RecordCapture(self.state.optimizer, self.state.named_params())
            else:
                log.warning("differential checkpoints off (full_every=1): %s", why)
        self.plan_iteration = max(resume_iteration, 0) + self.ck.profile_iters
        saved = load_plan_input(self.run_dir)
        if saved is not None:
            self._plan_from(saved, source="saved profile")

    def _gather_and_plan(self) -> None:
        cost = (
            calibrate(self.ck.cost, hashes_on_copy=self.device.type != "cuda")
            if self.rank == 0
            else None
        )
        plan_input = gather_plan_input(
            self.transport, self.rank, self._profile, self.layout(), cost,
            self.topology.world_size,
        )  # fmt: skip
        if self.rank == 0:
            save_plan_input(self.run_dir, plan_input)
        self._plan_from(plan_input, source="profile")

    def _maybe_replan(self) -> None:
        """Once, after a few checkpoints: re-plan if snapshots copy at another rate than
        the plan assumed (see :func:`baft.engine.planning.replan_rate`).

        Collective: every rank reaches it at the same iteration. If the new plan moves a
        shard boundary (the same decision on every rank: the plan is deterministic), every
        store forgets its other versions but keeps the committed one restorable (budget
        permitting), and the next checkpoint commits under the new layout.
        """
        if self._plan_input is None or self._plan_input.get("replanned"):
            return
        if self._checkpoints_since_plan < REPLAN_AFTER_CHECKPOINTS:
            return
        nbytes, seconds = self._observed
        rates = self.transport.all_gather_object(nbytes / seconds if seconds > 0 else None)
        self._plan_input["replanned"] = True
        rate = replan_rate(self._plan_input, rates)
        if rate is None:
            return
        assumed = float(self._plan_input["cost"].get("copy_Bps", CostModel().copy_Bps))
        assert self.plan is not None
        before = {r: (p.owned_start, p.owned_stop) for r, p in self.plan.ranks.items()}
        if self.k > 1:
            trial = {**self._plan_input, "cost": {**self._plan_input["cost"], "copy_Bps": rate}}
            moved = plan_of(trial, self.k, self.policy).ranks
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
                        rate / 1e9, assumed / 1e9, self.k,
                    )  # fmt: skip
                return
        self._resolve_commit()
        self._quiesce()
        self._plan_input["cost"]["copy_Bps"] = rate
        if self.rank == 0:
            save_plan_input(self.run_dir, self._plan_input)
        kept = self._plan_from(
            self._plan_input,
            source=f"re-plan: snapshots copy at {rate / 1e9:.2f} GB/s, assumed {assumed / 1e9:.2f}",
        )
        after = {r: (p.owned_start, p.owned_stop) for r, p in self.plan.ranks.items()}
        if after != before:  # shard layout moved: old versions must not mix with new ones
            # except the committed one, kept whole in its slot (its manifests describe its
            # own layout): a crash before the first commit under the new layout restores it
            self.store.clear_versions(keep=kept)
            if kept is None:
                self.votes.adopt(None)

    def _plan_from(self, plan_input: dict[str, Any], source: str) -> int | None:
        """Plan from ``plan_input`` and allocate the store for it (collective). Returns the
        committed version if it stayed restorable in every store (see
        :meth:`_allocate_everywhere`)."""
        ranks = plan_input["ranks"]
        if plan_input.get("world_size") != self.topology.world_size:
            return None
        self._plan_input = plan_input
        self._checkpoints_since_plan = 0
        self._observed = (0, 0.0)
        if layout_from_json(ranks[self.rank]["layout"]) != self.layout():
            raise RuntimeError(f"rank {self.rank}: saved plan input does not match this model")
        k = self._choose_k(plan_input)
        if k != self.k and self.plan is not None:  # a new rotation: old payloads do not mix
            self.store.clear_versions()
            self.votes.adopt(None)
            self.first_version = None
        self.k = k
        if k == 1 and self.records is not None:
            # Full snapshots every version: no payload carries a record, and holding the
            # last step's gradients would keep a second gradient set alive (device memory
            # on an accelerator) and encode the hyperparameters every step, for nothing.
            # A re-plan keeps k, so the record is never needed again in this run.
            self.records = None
        if k > 1:
            payload = PayloadLayout.of(self.flat.specs(), k)
            self.payload = PayloadViews(payload, self.state.named_tensors())
        else:
            self.payload = None
        plan = plan_of(plan_input, k, self.policy)
        self.plan = plan
        self.source = self.payload.flat(0, None) if self.payload is not None else self.flat
        self.schedule = SnapshotSchedule.of(plan, self.rank, self.source)
        shard_sizes = {r: p.owned_stop - p.owned_start for r, p in plan.ranks.items()}
        self.group_layout = group_layouts(self.topology, self.redundancy, shard_sizes)[self.rank]
        self._sizes = (
            self.schedule.nbytes,
            self.group_layout.redundancy_nbytes(self.rank),
            max(2, k + 1),
        )
        kept = self._allocate_everywhere(*self._sizes, keep=self.committed)
        self.exchange = RedundancyExchange(
            self.group_layout if self.redundancy.kind != "none" else None,
            self.rank,
            self.transport,
            self.policy.max_chunk_bytes,
            peers=self.peers,
            timeout_s=self.ck.timeout_s,
        )
        self.plan_iteration = -1
        if self.termination is not None:  # a SIGTERM flush comes within ~2 iterations
            self._iteration_s = max(bmap_from_json(d["bubbles"]).iteration_s for d in ranks)
            self._set_grace(self._iteration_s)  # the profiled iteration, until one is timed
        paths = self.exchange.paths()
        via = (
            f"redundancy into rank {self.rank}: {paths['shm'] / 2**20:.1f} MiB/version from "
            f"same-host stores, {paths['net'] / 2**20:.1f} MiB over the network"
        )
        log.info("checkpoint plan (%s): %s; %s; %s", source, plan.reason, self._k_reason, via)
        return kept

    def _choose_k(self, plan_input: dict[str, Any]) -> int:
        """full_every of this plan: kept by a re-plan or a restored rotation, else the
        policy's, or with ``auto`` what the bubbles and the memory budget allow (see
        :func:`baft.engine.planning.auto_k`; the same on every rank)."""
        if self.plan is not None:  # a re-plan keeps k: a new rotation would open a gap
            return self.k
        if self.records is None:
            self._k_reason = "full_every=1"
            return 1
        if self._rotation_k is not None:  # the restored rotation goes on
            self._k_reason = f"full_every={self._rotation_k} (the restored rotation's)"
            return self._rotation_k
        if self.policy.full_every >= 1:
            self._k_reason = f"full_every={self.policy.full_every} (configured)"
            return self.policy.full_every
        k, self._k_reason = auto_k(
            plan_input, self.policy, self.topology, self.redundancy, self.ck.budget_bytes
        )
        return k

    def _allocate_everywhere(
        self, data_nbytes: int, red_nbytes: int, num_slots: int = 2, keep: int | None = None
    ) -> int | None:
        """Allocate the store; collective, so that a rank over its memory budget (or a
        full tmpfs) fails every rank with the same error instead of leaving its peers
        blocked in the next collective until they time out.

        ``keep``: the committed version stays restorable across a new plan's layout (its
        slot keeps its bytes, see :meth:`SnapshotStore.allocate`), so a crash before the
        new plan's first commit still loses one iteration. Returns it if every rank kept
        it (when the larger slots do not fit the budget, none does: the old behaviour)."""
        error: str | None = None
        kept: int | None = None
        try:
            kept = self._allocate(data_nbytes, red_nbytes, num_slots, keep)
        except MemoryBudgetError as e:
            error = str(e)
        gathered = self.transport.all_gather_object((error, kept))
        errors = [e for e, _ in gathered if e]
        if errors and keep is not None:
            log.warning("the committed v%d cannot be kept across the new plan: %s", keep, errors[0])
            return self._allocate_everywhere(data_nbytes, red_nbytes, num_slots)
        if errors:
            raise MemoryBudgetError(errors[0])
        return keep if keep is not None and all(k == keep for _, k in gathered) else None

    def _allocate(
        self, data_nbytes: int, red_nbytes: int, num_slots: int = 2, keep: int | None = None
    ) -> int | None:
        """(Re)create the store's slots; on CUDA pin them so device copies are DMA."""
        self.copier.synchronize()  # no copy may still land in a slot that goes away
        self._pins.release()
        kept = self.store.allocate(data_nbytes, red_nbytes, num_slots, keep_version=keep)
        if self.device.type == "cuda":
            for slot in range(num_slots):
                self._pins.pin(torch.from_numpy(self.store.data_view(slot)))
        return kept

    # ------------------------------------------------------------------ hooks
    def apply_rng(self) -> None:
        """Load the restored small state (RNG, ...) from the flat state into the live objects."""
        self.state.apply()

    # ------------------------------------------ what a restore needs (recover.Restorable)
    @property
    def layout_digests(self) -> dict[str, str]:
        return self._layouts

    @property
    def persist_dir(self) -> str | None:
        return self.ck.persist_dir

    @property
    def allow_fresh_start(self) -> bool:
        return self.ck.allow_fresh_start

    @property
    def first_checkpoint_by(self) -> int:
        return self.ck.profile_iters + self.policy.every

    def apply_small_state(self) -> None:
        self.state.apply()

    def forget_versions(self) -> None:
        self.store.clear_versions()

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        self.state.capture()
        self._fire("iteration", iteration)
        spill = self.schedule.by_slot.get(SPILL)
        if spill:
            # Copies that fit no bubble start now on an asynchronous copier and finish by
            # the deadline, instead of stalling the host just before the step.
            cur = self._current(iteration)  # (differential: resolves this version's pieces)
            if cur is not None and self._issuer is not None:
                # CUDA: issuing a chunk's copies costs the host ~160 us (23 ms per
                # iteration for a 1.1 GiB state, measured on an H200), time the GPU
                # then waited for the forward's launches. Here the training thread only
                # marks where the copies start in its stream; a thread issues them.
                self.spill_copier.mark()  # type: ignore[attr-defined]
                self._issuing = self._issuer.submit(self._issue_spills, cur, timeline)
            elif cur is not None:
                self._issue_spills(cur, timeline)

    def _issue_spills(self, v: Version, timeline: IterationTimeline) -> None:
        for task, pieces in self.schedule.by_slot[SPILL]:
            self._snapshot(
                v, task, pieces, timeline, "iteration_start",
                exposed=False, copier=self.spill_copier,
            )  # fmt: skip

    def on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        if self.injector is not None:
            delay = self.injector.slot_delay(timeline.iteration)
            if delay:
                time.sleep(delay)
        v = self._current(timeline.iteration)
        if v is None:
            return
        for task, pieces in self.schedule.by_slot.get(slot_id, ()):
            self._snapshot(v, task, pieces, timeline, slot_id, exposed=False)
            if len(v.done) == 1:
                self._fire("snapshot", timeline.iteration)
        if self.exchange is not None and self.exchange.peers:
            self.worker.submit(self._pull)  # same-host peers' progress
        self.worker.open()

    def after_slot(self, slot_id: str) -> None:
        self.worker.close()

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        v = self._current(iteration)
        if v is not None:
            self._finish_snapshot(v, timeline)
        if self.records is not None:  # what this step consumes: the next payload's record
            self.records.take(iteration)
        self._fire("step", iteration)

    def _finish_snapshot(self, v: Version, timeline: IterationTimeline) -> None:
        """The step deadline: copy what no slot took, wait for every copy of ``v``."""
        if self._issuing is not None:  # every copy issued before any is waited for
            issuing, self._issuing = self._issuing, None
            issuing.result(self.ck.timeout_s)
        for task, pieces in self.schedule.all_tasks:
            if task.chunk_id not in v.done:
                self._snapshot(v, task, pieces, timeline, "pre_step", exposed=True)
        start = timeline.now()
        self.copier.synchronize()
        if self.spill_copier is not self.copier:
            self.spill_copier.synchronize()
        waited = timeline.now() - start
        v.seconds["deadline_wait"] += waited
        v.exposed_s += waited
        if waited > 1e-4:
            timeline.add(
                "snapshot-wait", "ckpt", start, start + waited, slot="pre_step", exposed=True
            )

    def _set_grace(self, iteration_s: float) -> None:
        """The SIGTERM grace: the agreed flush comes at the latest two votes later, so
        three iterations (of the profiled or the last one, whichever is longer) and at
        least 5 s, at most ``flush_timeout_s``. A crashed peer's group restart waits for it."""
        assert self.termination is not None
        longest = max(iteration_s, self._iteration_s)
        self.termination.grace_s = min(self.ck.flush_timeout_s, max(5.0, 1.0 + 3.0 * longest))

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        if self.termination is not None:
            now = time.perf_counter()
            if self._last_step_t is not None:
                self._set_grace(now - self._last_step_t)
            self._last_step_t = now
        v = self._cur
        if v is not None and v.version == iteration:
            start = timeline.now()
            self._fire("transfer", iteration)
            self.worker.drain()  # checksums and sends not done in bubbles: exposed
            peers_intact = True
            try:
                encoded = self.exchange.finish() if self.exchange is not None else 0
            except PeerStoreGone as e:  # its store is gone: v fails the vote, the job goes on
                log.warning("v%d is not protected: %s", v.version, e)
                encoded, peers_intact = 0, False
            if self.exchange is not None:
                for name, sec in self.exchange.seconds.items():
                    v.seconds[name] += sec
            # a store wiped under a live rank (its own or a same-host sender's) loses v
            complete = peers_intact and self.store.path.exists()
            if complete:
                self._complete(v, iteration)
            end = timeline.now()
            v.exposed_s += end - start
            timeline.add(
                "protect", "ckpt", start, end, slot="after_step", exposed=True, bytes=encoded
            )
            stopping = self.termination is not None and self.termination.requested
            self.votes.post(v.version, complete, stopping)
            self.last_metrics = self._metrics(v)
            self._cur = None
        else:
            self.last_metrics = self._metrics(None)
        if self.plan is None:
            self._profile.append(timeline.to_json())  # unfinished: its length so far
            if iteration + 1 >= self.plan_iteration >= 0:
                self._gather_and_plan()
        elif v is not None and v.version == iteration:
            self._checkpoints_since_plan += 1
            self._maybe_replan()

    # ------------------------------------------------------------------ snapshot
    def _current(self, iteration: int) -> Version | None:
        """The version written in this iteration, begun on first use; None if none is due."""
        if self._cur is not None and self._cur.version == iteration:
            return self._cur
        if not self.enabled or self.plan is None or iteration % self.plan.interval_iters:
            return None
        if iteration == self.skip_version:  # restored from memory: already committed there
            return None
        self._resolve_commit()
        if self.votes.stop_agreed:
            self._flush_and_exit(iteration)
        if self.k == 1 and self.persists.reading_other_than(self.committed):
            self.persists.join()  # never overwrite a slot the persister still reads
        if not self.store.path.exists():  # store lost under a live rank: start it afresh
            self._quiesce()
            self._allocate(self._sizes[0], self._sizes[1], self._sizes[2])
            # the rotation goes on (every rank numbers it alike): this rank's payloads of
            # the versions before are gone, so those are not rebuildable (never wrong)
        if self.first_version is None:
            self.first_version = iteration
        # differential: keep the payloads that rebuild the newest version written, also
        # when its vote failed (a rank lost its store: parity may still rebuild it); the
        # store lets this window win over an older commit record
        keep = range(max(self.first_version, iteration - self.k), iteration) if self.k > 1 else ()
        slot = self.store.begin(iteration, keep=keep)
        data = torch.from_numpy(self.store.data_view(slot))
        red = torch.from_numpy(self.store.red_view(slot))
        self._cur = Version(iteration, slot, data, red)
        if self.payload is not None and self.records is not None:
            record = self.records.for_version(iteration)
            self.source = self.payload.flat(iteration, record)
            assert self.plan is not None
            self.schedule = SnapshotSchedule.of(self.plan, self.rank, self.source)
            self._cur.has_record = record is not None
            self._start_persist_copy(iteration)
        if self.exchange is not None:
            self.exchange.begin(data, red, iteration)
        self.store.publish(iteration, slot, 0)
        return self._cur

    def _snapshot(
        self,
        v: Version,
        task: Task,
        pieces: tuple[Piece, ...],
        timeline: IterationTimeline | None,
        slot_id: str,
        *,
        exposed: bool,
        copier: DeviceCopy | None = None,
    ) -> None:
        start = time.perf_counter()
        lo = task.offset - self.schedule.owned_start
        out = v.data[lo : lo + task.nbytes]
        copier = copier or self.copier
        copy = copier.start(self.source.pairs(pieces, out))  # returns at once if async
        v.done.add(task.chunk_id)
        v.snapshot_bytes += task.nbytes
        chunk_id = task.chunk_id
        if threading.current_thread() is self.worker_thread:
            self._protect(v, chunk_id, out, copy)
        else:
            self.worker.submit(lambda: self._protect(v, chunk_id, out, copy))
        elapsed = time.perf_counter() - start
        if exposed:
            v.exposed_s += elapsed
        elif not copier.asynchronous:
            v.in_bubble_s += elapsed
        if timeline is not None:
            end = timeline.now()
            timeline.add(
                "snapshot", "ckpt", end - elapsed, end,
                slot=slot_id, bytes=task.nbytes, exposed=exposed,
            )  # fmt: skip

    def _protect(self, v: Version, chunk_id: int, out: torch.Tensor, copy: ChunkCopy) -> None:
        """Worker: once a chunk's copy is done, record its checksum (hashed during the copy
        by host copiers) and send the redundancy pieces it completes."""
        copy.wait(self.ck.timeout_s)
        v.seconds["copy"] += copy.seconds
        if copy.background:
            v.in_bubble_s += copy.seconds  # background copy time, off the training thread
        if copy.seconds > 0:  # measured copy rate (the re-plan compares it with the plan's)
            self._observed = (self._observed[0] + copy.nbytes, self._observed[1] + copy.seconds)
        v.seconds["hash"] += copy.hash_seconds  # CUDA: hashed on the copier's threads
        if copy.checksum is None:  # a copier that did not hash: hash the copied bytes once
            t0 = time.perf_counter()
            copy.checksum = checksum(out.numpy())
            v.seconds["hash"] += time.perf_counter() - t0
        v.checksums[chunk_id] = copy.checksum
        v.protected.add(chunk_id)
        before = v.covered
        while (nxt := self.schedule.chunk_at.get(v.covered)) and nxt[0] in v.protected:
            v.covered = nxt[1]
        if v.covered != before:
            self.store.publish(v.version, v.slot, v.covered)
        if self.exchange is not None:
            for piece in self.exchange.take_sends(v.covered):
                self.exchange.send_now(piece)
            self.exchange.pull_ready()

    def _pull(self) -> None:
        """Worker: copy whatever same-host peers have finished of the current version."""
        if self.exchange is not None:
            self.exchange.pull_ready()

    # ------------------------------------------------------------------ commit
    def _complete(self, v: Version, iteration: int) -> None:
        assert self.plan is not None and self.group_layout is not None
        s = self.schedule
        chunks = tuple(
            ChunkRecord(t.chunk_id, t.offset - s.owned_start, t.nbytes, v.checksums[t.chunk_id])
            for t, _ in s.all_tasks
        )
        known = self.exchange.region_checksums if self.exchange is not None else {}
        regions = region_records(v.red.numpy(), self.group_layout.regions(self.rank), known)
        manifest = Manifest.for_layout(
            topology=self.topology,
            layout=self.group_layout,
            rank=self.rank,
            version=v.version,
            iteration=iteration,
            owned_start=s.owned_start,
            owned_stop=s.owned_stop,
            chunks=chunks,
            regions=regions,
            meta=self._version_meta(v),
        )
        self.store.complete(v.slot, manifest)

    def _version_meta(self, v: Version) -> dict[str, Any]:
        meta: dict[str, Any] = {"position": v.version, "flat_nbytes": self.flat.nbytes}
        meta["layouts"] = self._layouts  # the shard's identity, checked before a restore
        if self.payload is not None:
            meta["diff"] = {
                "k": self.k,
                "slice": v.version % self.k,
                "first_version": self.first_version,
                "has_record": v.has_record,
                "payload_nbytes": self.payload.layout.nbytes,
            }
        return meta

    def _start_persist_copy(self, iteration: int) -> None:
        """Differential: every ``persist_every``-th version the live state (this DP
        replica's share) is copied in the background for the persister (see
        :mod:`baft.engine.persisting`)."""
        every = self.policy.persist_every
        if self.persists.persister is None or not every or iteration % every:
            return
        self.persists.join()  # the buffer is reused
        c = self.topology.coords(self.rank)
        share = replica_share(self.state.named_tensors(), c.dp, self.topology.num_dp)
        self._persist_copy.start(iteration, share, self.spill_copier)

    def _reclaim_foreign(self, version: int) -> None:
        """Once the own stores committed a whole window after a restore from memory, free
        this job's store directories that no current rank writes (an earlier numbering):
        the restore was their last use. The lowest rank of this host does it; every current
        rank's directory is spared, wherever it lives."""
        if self._reclaim_after is None or version < self._reclaim_after + self.k:
            return
        self._reclaim_after = None
        if self.rank != min({self.rank, *self.peers}):
            return
        topo = self.topology
        own = {(topo.node_of(r), r) for r in range(topo.world_size)}
        freed = reclaim.reclaim_foreign(self.store.root, self.ck.job_id, own, version)
        if freed:
            log.info("freed %d store(s) of an earlier rank numbering: %s", len(freed), freed)

    def _resolve_commit(self) -> None:
        version = self.votes.resolve()
        if version is not None:
            self._reclaim_foreign(version)
        if version is None:
            return
        meta = self._persist_meta(version)
        if self.k > 1:
            views = self._persist_copy.take(version)
            if views is not None:
                self._fire("persist", version)
                self.persists.start(version, lambda: views, meta)
            return
        if self.persists.due(self.votes.num_committed):
            self._fire("persist", version)
            slot = next(
                s for s in range(self.store.num_slots)
                if (m := self.store.read_manifest(s)) is not None and m.version == version
            )  # fmt: skip
            data = torch.from_numpy(self.store.data_view(slot))
            sched = self.schedule
            self.persists.start(
                version,
                lambda: slot_views(
                    self.flat, data, sched.owned_start, sched.owned_stop, self.persist_keys
                ),
                meta,
            )

    def _flush_and_exit(self, iteration: int) -> None:
        """Every rank agreed to stop (SIGTERM): persist the live state, which is version
        ``iteration`` on every rank (the vote proves step ``iteration - 1`` is done
        everywhere; small state was captured at this iteration's start), as a DCP
        checkpoint within ``flush_timeout_s``, then leave the process with status 0."""
        if self.termination is not None:
            self.termination.flushing()
        self._quiesce()
        persister = self.persists.persister
        if persister is not None:
            c = self.topology.coords(self.rank)
            named = list(zip(self.flat.names, self.flat.tensors, strict=True))
            share = replica_share(named, c.dp, self.topology.num_dp)
            meta = self._persist_meta(iteration)
            state = {self.persist_keys(n): t for n, t in share}
            flush(persister, iteration, state, meta, self.ck.flush_timeout_s, self.ck.persist_dir)
        raise SystemExit(0)

    def _persist_meta(self, version: int) -> dict[str, Any]:
        """What a DCP checkpoint of ``version`` records in its ``baft_meta.json``."""
        return {
            "version": version,
            "rank_meta": {},
            "world_size": self.topology.world_size,
            KEYS_META: self.persist_keys.scheme,
            "layouts": self._layouts,  # checked before a DCP restore writes a byte
        }

    def _quiesce(self) -> None:
        """Nothing may still read the store's mappings: they are about to be replaced
        (a resized file under a live mapping is a SIGBUS for its reader)."""
        self.worker.drain()
        self.persists.join()

    # ------------------------------------------------------------------ misc
    def _fire(self, point: str, iteration: int) -> None:
        if self.injector is not None:
            self.injector.fire(point, iteration)

    def _metrics(self, v: Version | None) -> dict[str, Any]:
        ex = self.exchange
        return {
            "committed_version": self.committed,
            "ckpt_version": v.version if v else None,
            "in_bubble_s": v.in_bubble_s if v else 0.0,
            "exposed_s": v.exposed_s if v else 0.0,
            "seconds": dict(v.seconds) if v else {},
            "bytes": {
                "snapshot": v.snapshot_bytes if v else 0,
                "send": ex.bytes_sent if (v and ex) else 0,
                "recv": ex.bytes_received if (v and ex) else 0,
                "pull": ex.bytes_pulled if (v and ex) else 0,
            },
        }

    def close(self, finished: bool | None = None) -> None:
        """Finish pending commit and persist; release the store mappings. ``finished``
        (collective when given): whether this rank ended between iterations; the stores
        are then freed or kept at the job's end (see :mod:`baft.engine.closing`)."""
        if self._issuer is not None:
            self._issuer.shutdown(wait=True)
        self.worker.shutdown()
        self.copier.shutdown()
        if self.spill_copier is not self.copier:
            self.spill_copier.shutdown()
        for peer in self.peers.values():
            peer.close()
        self._resolve_commit()
        self.persists.shutdown()
        self._pins.release()
        self.store.close()
        if self.termination is not None:
            self.termination.uninstall()
        if finished is not None:
            end_of_job(
                transport=self.transport, finished=finished, committed=self.committed,
                store_root=self.ck.store_root, job_id=self.ck.job_id,
                persist_dir=self.ck.persist_dir, keep=self.ck.keep_stores_on_close,
                run_dir=self.run_dir, rank=self.rank,
            )  # fmt: skip
        self.transport.close()
