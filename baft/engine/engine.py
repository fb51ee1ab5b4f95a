"""The checkpoint engine of one rank: the step runner's hooks, routed to the owners.

Lifecycle (all ranks in lock-step, driven by the step runner's :class:`StepHooks`):

1. **Profile.** The first ``profile_iters`` iterations run unprotected; their timelines
   give this rank's BubbleMap. Then every rank gathers all BubbleMaps and layouts and the
   :class:`~baft.engine.rotation.Rotation` turns them into an immutable layout (plan, k,
   payload, schedule) that :class:`~baft.engine.adoption.PlanAdoption` puts into effect
   (store slots, writer, persist interval); a restarted job re-plans at once from the
   saved inputs. After a few checkpoints it re-plans once if snapshots copy at another
   rate than the plan assumed.
2. **Snapshot (iteration v, version v).** Version v opens at the first hook of iteration
   v with snapshot work (the spill start, else the first slot, else the deadline): there
   the vote on v-1 resolves (:class:`~baft.engine.commit.Commit`), inside a bubble where
   the plan has one. The :class:`~baft.engine.writer.VersionWriter` copies the chunks at
   the slots its :class:`~baft.engine.writer.Scheduling` picks and meets the deadline
   before ``optimizer.step``, so the snapshot is always a consistent copy of version v.
3. **Protect and commit.** After the step the writer waits for v's redundancy and
   records its manifest; the rank posts its vote; v commits when the next version opens.
4. **Persist.** :class:`~baft.engine.persisting.Persisting` saves every
   ``persist_every``-th checkpoint to DCP in the background, and flushes on SIGTERM.

The engine does no set-up I/O of its own: :func:`baft.engine.build.build_engine` makes
its store, transport, copiers, worker and persister and hands them in.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from baft.config import CheckpointConfig
from baft.engine.adoption import PlanAdoption
from baft.engine.allocation import StoreSlots
from baft.engine.closing import end_of_job
from baft.engine.commit import Commit
from baft.engine.differential import RecordCapture
from baft.engine.flat import FlatState
from baft.engine.parts import EngineParts
from baft.engine.persisting import Persisting
from baft.engine.planning import SPILL
from baft.engine.rotation import Rotation
from baft.engine.versions import COMPONENTS, Version
from baft.engine.writer import VersionWriter
from baft.pipeline import IterationTimeline
from baft.pipeline.layout import GlobalLayout
from baft.pipeline.live import LiveState
from baft.store.coding import Redundancy, coding_groups
from baft.store.records import DIFF_KEY, PlanInput
from baft.topology import Topology

__all__ = ["COMPONENTS", "SPILL", "CheckpointEngine", "EngineParts"]

log = logging.getLogger("baft")


class CheckpointEngine:
    """Implements the step runner's StepHooks; see the module docstring."""

    def __init__(
        self,
        ck: CheckpointConfig,
        run_dir: Path,
        *,
        topology: Topology,
        rank: int,
        device: torch.device,
        state: LiveState,
        parts: EngineParts,
    ) -> None:
        self.ck, self.policy, self.run_dir = ck, ck.policy, Path(run_dir)
        self.topology, self.rank, self.device, self.state = topology, rank, device, state
        self.flat = FlatState(state.named_tensors())
        self.layout_digests: dict[str, str] = dict(getattr(state, "layout_digests", {}))
        """Layout digest per ``"pp{p}.tp{t}"``: the shard's identity, checked on restore."""
        self.store, self.transport, self.peers = parts.store, parts.transport, parts.peers
        self.location, self.injector, self.termination = (
            parts.location, parts.injector, parts.termination
        )  # fmt: skip
        self.persist_keys = parts.keys
        layouts: dict[str, GlobalLayout] = getattr(state, "global_layouts", dict)()
        self.persist_layouts = {self.persist_keys(n): g for n, g in layouts.items()}
        """DCP key -> the DTensor (TP shard) its rank-local tensor belongs to."""
        if parts.persister is not None:
            parts.persister.layouts = self.persist_layouts
        self.redundancy = Redundancy.parse(self.policy.redundancy)
        coding_groups(self.topology, self.redundancy)  # validates the layout early
        self.commit = Commit(self.transport, self.store)
        self.rotation = Rotation(
            ck, rank=rank, topology=topology, redundancy=self.redundancy, flat=self.flat,
            named=state.named_tensors(),
        )  # fmt: skip
        self.writer = VersionWriter(
            rank=rank, topology=topology, store=self.store, transport=self.transport,
            copier=parts.copier, spill_copier=parts.spill_copier, worker=parts.worker,
            peers=self.peers, scheduling=parts.scheduling,
            max_chunk_bytes=self.policy.max_chunk_bytes, timeout_s=ck.timeouts.collective_s,
            injector=self.injector,
        )  # fmt: skip
        self.slots = StoreSlots(
            self.store, self.transport, device, (parts.copier, parts.spill_copier)
        )
        self.persisting = Persisting(
            parts.persister, every=self.policy.persist_every, interval=self.policy.every,
            keys=self.persist_keys, topology=topology, rank=rank, flat=self.flat,
            device=device, layout_digests=self.layout_digests, fire=self._fire,
            sharded=self.persist_layouts, param_groups=_param_groups(state),
        )  # fmt: skip
        self.adoption = PlanAdoption(
            run_dir=self.run_dir, rank=rank, topology=topology, device=device, cost=ck.cost,
            redundancy=self.redundancy, transport=self.transport, rotation=self.rotation,
            commit=self.commit, store=self.store, slots=self.slots, writer=self.writer,
            persisting=self.persisting, termination=self.termination,
        )  # fmt: skip
        self.enabled = True
        self.skip_version: int | None = None
        """The version a restore brought back: it is committed already, not rewritten."""
        self.last_metrics: dict[str, Any] = {}
        self._steps_done: int | None = None
        """Steps completed in this process: the live state is that version at close."""

    @property
    def _differential(self) -> bool:
        """The rotation's versions are differential payloads (K > 1), not the state."""
        return self.rotation.layout is not None and self.rotation.layout.payload is not None

    @property
    def committed(self) -> int | None:
        """Newest globally committed version."""
        return self.commit.committed

    @property
    def k(self) -> int:
        """full_every of the current plan (1: the whole state every version)."""
        return self.rotation.k

    # ------------------------------------------------------------------ set-up
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
        self.commit.restored(restored_version)
        records = None
        if self.policy.full_every != 1:
            from baft.pipeline.replay import replay_safe

            why = replay_safe(self.state.optimizer)
            if why is None:
                records = RecordCapture(self.state.optimizer, self.state.named_params())
            else:
                log.warning("differential checkpoints off (full_every=1): %s", why)
        self.rotation.begin(resume_iteration, first_version, rotation_k, records)
        saved = PlanInput.load_for(self.run_dir, self.topology.world_size)
        if saved is not None:
            self.adoption.adopt(saved, source="saved profile")
        elif self.adoption.cost is None and (other := PlanInput.load(self.run_dir)):
            self.adoption.cost = other.cost or None  # the host's rates: no calibration

    # ------------------------------------------ what a restore needs (recover.Restorable)
    @property
    def persist_dir(self) -> str | None:
        return self.ck.persist.dir

    @property
    def elastic_replicas(self) -> int:
        """The job's virtual DP replicas (0: the ranks are the replicas)."""
        return self.ck.elastic.num_replicas

    @property
    def allow_fresh_start(self) -> bool:
        return self.ck.allow_fresh_start

    @property
    def first_checkpoint_by(self) -> int:
        """By this iteration a job has written its first checkpoint (profiling plus one
        interval): progress before it never held a restorable version."""
        return self.ck.profile_iters + self.policy.every

    def apply_small_state(self) -> None:
        """Load the restored small state (RNG, ``state=`` objects) into the live objects."""
        self.state.apply()

    def forget_versions(self) -> None:
        """Nothing in this rank's store may be restored any more (a restore from DCP, or
        a fresh start, made the job's state something no stored version holds)."""
        self.store.clear_versions()

    # ------------------------------------------------------------------ hooks
    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        self.state.capture()
        if self.termination is not None and self.termination.requested:
            # a stop may be agreed: flush before this iteration's forward moves any
            # buffer (BatchNorm statistics), not at its first slot
            self._current(iteration)
        self._fire("iteration", iteration)
        self.writer.scheduling.iteration_start(
            self.writer, lambda: self._current(iteration), timeline
        )

    def on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        if self.injector is not None:
            delay = self.injector.slot_delay(timeline.iteration)
            if delay:
                time.sleep(delay)
        v = self._current(timeline.iteration)
        if v is not None:
            self.writer.scheduling.slot(self.writer, v, slot_id, timeline)

    def after_slot(self, slot_id: str) -> None:
        self.writer.worker.close()

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        v = self._current(iteration)
        if v is not None:
            self.writer.deadline(v, timeline)
        self.rotation.take_record(iteration)  # what this step consumes: the next record
        self._fire("step", iteration)

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._steps_done = iteration + 1
        if self.termination is not None:
            self.termination.step_done()
        v = self.writer.current
        written = v is not None and v.version == iteration
        if v is not None and written:
            start = timeline.now()
            self._fire("transfer", iteration)
            complete, encoded = self.writer.finish(v, self._version_meta(v))
            end = timeline.now()
            v.exposed_s += end - start
            timeline.add(
                "protect", "ckpt", start, end, slot="after_step", exposed=True, bytes=encoded
            )
            stopping = self.termination is not None and self.termination.requested
            ready = self.persisting.ready(v.version, differential=self._differential)
            self.commit.post(v.version, complete, stopping, ready)
        self.last_metrics = {
            "committed_version": self.committed,
            "persisted": self.persisting.saved,
            "persist_skipped": self.persisting.skipped,
            **self.writer.metrics(v if written else None),
        }
        if self.rotation.layout is None:
            if self.rotation.profiled(iteration, timeline.to_json()):  # unfinished: so far
                self.adoption.from_profile()
        elif written and self.rotation.checkpoint_written():
            self.adoption.replan(settle=self._settle)

    # ------------------------------------------------------------------ versions
    def _current(self, iteration: int) -> Version | None:
        """The version written in this iteration, opened on first use (resolving the vote
        on the one before); None if none is due."""
        cur = self.writer.current
        if cur is not None and cur.version == iteration:
            return cur
        lay = self.rotation.layout
        if not self.enabled or lay is None or iteration % lay.plan.interval_iters:
            return None
        if iteration == self.skip_version:  # restored from memory: already committed there
            return None
        self._resolve_commit()
        if self.commit.stop_agreed:
            self._flush_and_exit(iteration)
        if lay.k == 1 and self.persisting.reading_other_than(self.committed):
            self.persisting.join()  # never overwrite a slot the persister still reads
        if not self.store.path.exists():  # store lost under a live rank: start it afresh
            # the rotation goes on (every rank numbers it alike): this rank's payloads of
            # the versions before are gone, so those are not rebuildable (never wrong)
            self._quiesce()
            self.slots.allocate(self.slots.sizes)
        keep = self.rotation.open_version(iteration)
        source, schedule, has_record = self.rotation.source(iteration)
        v = self.writer.open(iteration, keep, source, schedule)
        v.has_record = has_record
        self.persisting.version_opened(
            iteration, differential=lay.payload is not None, copier=self.writer.spill_copier
        )
        return v

    def _version_meta(self, v: Version) -> dict[str, Any]:
        meta: dict[str, Any] = {"position": v.version, "flat_nbytes": self.flat.nbytes}
        meta["layouts"] = self.layout_digests  # the shard's identity, checked before a restore
        diff = self.rotation.diff_meta(v.version, v.has_record)
        if diff is not None:
            meta[DIFF_KEY] = diff.to_json()
        return meta

    def _resolve_commit(self) -> None:
        version = self.commit.resolve()
        if version is None:
            return
        self.commit.reclaim_foreign(
            version, self.k, rank=self.rank, peers=set(self.peers), topology=self.topology,
            job_id=self.ck.store.job_id,
        )  # fmt: skip
        self.persisting.committed(
            version,
            differential=self._differential,
            slot_data=lambda: self._slot_data(version),
            agreed=self.commit.persist_agreed,
        )

    def _slot_data(self, version: int) -> tuple[torch.Tensor, int, int]:
        """The committed slot holding ``version`` and the flat range it owns."""
        slot = next(
            s for s in range(self.store.num_slots)
            if (m := self.store.read_manifest(s)) is not None and m.version == version
        )  # fmt: skip
        assert self.rotation.layout is not None
        sched = self.rotation.layout.schedule
        return torch.from_numpy(self.store.data_view(slot)), sched.owned_start, sched.owned_stop

    def _flush_and_exit(self, iteration: int) -> None:
        """Every rank agreed to stop (SIGTERM): persist the live state, which is version
        ``iteration`` on every rank (the vote proves step ``iteration - 1`` is done
        everywhere; small state was captured at this iteration's start), as a DCP
        checkpoint within ``TimeoutConfig.flush_s``, then leave the process with status 0."""
        if self.termination is not None:
            self.termination.flushing()
        self._quiesce()
        self.persisting.flush(iteration, self.ck.timeouts.flush_s, self.ck.persist.dir)
        raise SystemExit(0)

    def _settle(self) -> None:
        """Before a re-plan: the version in flight resolved, and nothing reads the store."""
        self._resolve_commit()
        self._quiesce()

    def _quiesce(self) -> None:
        """Nothing may still read the store's mappings: they are about to be replaced
        (a resized file under a live mapping is a SIGBUS for its reader)."""
        self.writer.worker.drain()
        self.persisting.join_store_reads()

    def _fire(self, point: str, iteration: int) -> None:
        if self.injector is not None:
            self.injector.fire(point, iteration)

    def abandon(self) -> None:
        """The job's process groups are gone (an in-process recovery): stop the background
        work and release the store mappings, without any collective and without
        committing the version in flight (the restore that follows agrees on one). Every
        step runs even if one fails: the next generation's engine opens the same stores."""
        for step in (
            self.writer.shutdown, self.persisting.shutdown, self.slots.release,
            self.store.close, self.transport.close,
        ):  # fmt: skip
            try:
                step()
            except Exception as e:  # noqa: BLE001 - broken groups raise; go on releasing
                log.debug("engine abandon: %s: %s", getattr(step, "__name__", step), e)
        if self.termination is not None:
            self.termination.uninstall()

    def close(self, finished: bool | None = None) -> tuple[bool, str]:
        """Finish pending commit and persist; release the store mappings. ``finished``
        (collective when given): whether this rank ended between iterations; the stores
        are then freed or kept at the job's end (see :mod:`baft.engine.closing`).
        Returns whether every rank agreed that the job ended (False without
        ``finished``) and, if not, why."""
        self.writer.shutdown()
        self._resolve_commit()
        if finished is not None:
            self._fire("close", self.committed if self.committed is not None else 0)
        self.persisting.join()
        self.slots.release()
        self.store.close()
        if self.termination is not None:
            self.termination.uninstall()
        ended: tuple[bool, str] = (False, "the job's end was not asked")
        try:
            if finished is not None:
                ended = end_of_job(
                    transport=self.transport, finished=finished, committed=self.committed,
                    store_root=self.ck.store.root, job_id=self.ck.store.job_id,
                    persist_dir=self.ck.persist.dir, keep=self.ck.store.keep_on_close,
                    run_dir=self.run_dir, rank=self.rank, flush_final=self._flush_final,
                )  # fmt: skip
        finally:
            self.persisting.shutdown()
        self.transport.close()
        return ended

    def _flush_final(self) -> None:
        """Every rank ended the job cleanly and the cadence owes a version (the last due
        one was passed over while a save still wrote): persist the final state, version
        ``steps done``, now, so that a job persisting every N ends with its newest state
        on disk, as it did when every save was waited for (a relaunch then resumes from
        it: it is newer than memory's last committed version). Collective (every rank
        agreed)."""
        if self.persisting.owed and self._steps_done is not None:
            # the small state (RNG, state= objects, hyperparameters, buffers) of version
            # ``steps done``, as the next iteration's start would capture it (the
            # SIGTERM flush runs there, after that capture)
            self.state.capture()
            where = self.ck.persist.dir
            self.persisting.flush(self._steps_done, self.ck.timeouts.flush_s, where, "close")


def _param_groups(state: LiveState) -> list[list[str]]:
    """Parameter FQNs of every param group of ``state``'s optimizer (torch's order; none
    for a state source without one, as the engine's test doubles)."""
    optimizer = getattr(state, "optimizer", None)
    if optimizer is None:
        return []
    fqn = {id(p): n for n, p in state.named_params().items()}
    return [[fqn[id(p)] for p in g["params"] if id(p) in fqn] for g in optimizer.param_groups]
