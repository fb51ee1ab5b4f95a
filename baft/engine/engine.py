"""The checkpoint engine of one rank: plan, snapshot in bubbles, protect, commit, persist.

Lifecycle (all ranks in lock-step, driven by the trainer's :class:`StepHooks`):

1. **Profile.** The first ``profile_iters`` iterations run unprotected; their timelines
   give this rank's :class:`BubbleMap`. After them every rank gathers all BubbleMaps and
   state layouts on the checkpoint group and runs the pure planner: identical inputs,
   identical :class:`CheckpointPlan` everywhere, no coordinator. The planner's inputs are
   saved in the run directory, so a restarted job re-plans at once without profiling.
2. **Snapshot (iteration v, version v).** At each slot the rank copies the chunks planned
   there from the live tensors into the store slot for v, checksums them and posts the
   redundancy sends those bytes complete. Leftovers run just before ``optimizer.step``
   and count as exposed time, so the snapshot is always a consistent copy of version v.
3. **Protect and commit.** After the step, the rank waits for its redundancy pieces,
   encodes parity, records the manifest, and posts a tiny MIN all-reduce of its newest
   complete version; the answer is read at the next version's start (it arrives while the
   rank computes), and version v is committed only when every rank completed it. The
   store never overwrites the newest committed version.
4. **Persist.** Every ``persist_every`` committed checkpoints the committed slot is
   written as a DCP checkpoint in the background; its slot is not reused until that is
   done.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from baft.config import TrainConfig
from baft.engine.device import (
    ChunkCopy,
    DeviceCopy,
    ThreadCopy,
    device_copy_for,
    pin_host_buffer,
)
from baft.engine.flat import FlatState, Piece
from baft.engine.persister import Persister, SaveHandle, persist_name
from baft.engine.redundancy import RedundancyExchange
from baft.engine.transport import GlooTransport, Transport
from baft.engine.worker import ProtectWorker
from baft.pipeline import IterationTimeline
from baft.pipeline.mesh import Mesh
from baft.pipeline.step import StepRunner
from baft.plan.cost import CostModel
from baft.plan.inputs import (
    PLAN_INPUT_FILE,
    bmap_from_json,
    bmap_to_json,
    layout_from_json,
    layout_to_json,
)
from baft.plan.planner import plan as make_plan
from baft.plan.types import CheckpointPlan, StateLayout, Task, TaskKind
from baft.profile.bubbles import bubble_map
from baft.profile.timeline import parse_record
from baft.store.coding import GroupLayout, Redundancy, coding_groups, group_layouts
from baft.store.manifest import ChunkRecord, Manifest, checksum, region_records
from baft.store.peer import PeerStore
from baft.store.shm import MemoryBudgetError, SnapshotStore

log = logging.getLogger("baft")
SPILL = "__spill__"
"""Pseudo-slot of the snapshot tasks that fit no bubble."""

REPLAN_AFTER_CHECKPOINTS = 3
COMPONENTS = ("copy", "hash", "send", "pull", "recv_wait", "encode", "deadline_wait")
"""Where a version's protect time goes: ``copy`` (snapshot copies, hashing included where
the copier hashes on the way), ``hash`` (a separate checksum pass: CUDA only), ``send``
(network sends), ``pull`` (same-host redundancy copies from a peer's store), ``recv_wait``
(waiting for network receives and peers' progress), ``encode`` (parity), and
``deadline_wait`` (the training thread waiting for copies at the step deadline)."""
"""Checkpoints after which the measured snapshot copy rate is compared with the plan's."""


def host_id() -> str:
    """This machine in this boot: ranks with equal ids share host memory. ``BAFT_HOST_ID``
    overrides it (tests that play several hosts on one machine)."""
    override = os.environ.get("BAFT_HOST_ID")
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Version:
    """Bookkeeping of the version being written."""

    def __init__(self, version: int, slot: int, data: torch.Tensor, red: torch.Tensor) -> None:
        self.version = version
        self.slot = slot
        self.data = data
        self.red = red
        self.done: set[int] = set()
        self.covered = 0
        self.checksums: dict[int, int] = {}
        self.in_bubble_s = 0.0
        self.exposed_s = 0.0
        self.snapshot_bytes = 0
        self.protected: set[int] = set()
        self.snapshot_event: threading.Event | None = None
        self.seconds: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
        """Seconds per protect component (see COMPONENTS), summed over threads."""


class CheckpointEngine:
    """Implements the trainer's StepHooks; see the module docstring."""

    def __init__(
        self,
        cfg: TrainConfig,
        mesh: Mesh,
        trainer: StepRunner,
        *,
        injector: Any = None,
        naive: bool = False,
        transport: Transport | None = None,
    ) -> None:
        ck = cfg.checkpoint
        assert ck is not None, "CheckpointEngine needs cfg.checkpoint"
        self.cfg = cfg
        self.ck = ck
        self.policy = ck.policy()
        self.mesh = mesh
        self.rank = mesh.rank
        self.topology = mesh.topology
        self.trainer = trainer
        self.injector = injector
        self.naive = naive
        self.redundancy = Redundancy.parse(self.policy.redundancy)
        coding_groups(self.topology, self.redundancy)  # validates the layout early
        self.transport: Transport = transport or GlooTransport(ck.timeout_s)
        self.store = SnapshotStore(
            Path(ck.store_root),
            ck.job_id,
            self.topology.node_of(self.rank),
            self.rank,
            ck.budget_bytes,
        )
        trainer.init_optimizer_state()
        c = mesh.coords
        # The CPU RNG state of the version's start travels inside the flat state.
        self._rng = torch.get_rng_state().clone()
        rng_name = f"extra.pp{c.pp}.tp{c.tp}.rng"
        self.flat = FlatState([*trainer.named_state(), (rng_name, self._rng)])
        self.recovery: Any = None
        self.peers: dict[int, PeerStore] = {}
        """Other ranks on this host -> their stores (see _find_same_host_peers)."""
        self.skip_version: int | None = None
        self.copier = device_copy_for(mesh.device, emulated=cfg.compute == "emulated")
        # Copies that fit no bubble never stall the host either: with a synchronous copier
        # (CPU training) they go to a copy thread started at the iteration's start, where
        # they overlap compute as naive-async's would (bubble-aware is never worse).
        self.spill_copier = self.copier if self.copier.asynchronous else ThreadCopy()
        # Host-side protect work waits for bubbles only when the host also computes.
        gated = mesh.device.type == "cpu" and cfg.compute == "real" and not naive
        self.worker = ProtectWorker(
            gated=gated if ck.host_work == "auto" else ck.host_work == "bubbles"
        )
        self.worker_thread: threading.Thread | None = None
        self.run_dir = Path(cfg.out_dir)
        self.enabled = True
        self.plan: CheckpointPlan | None = None
        self.group_layout: GroupLayout | None = None
        self.exchange: RedundancyExchange | None = None
        self._slot_tasks: dict[str, list[tuple[Task, tuple[Piece, ...]]]] = {}
        self._all_tasks: list[tuple[Task, tuple[Piece, ...]]] = []
        self._chunk_by_offset: dict[int, tuple[int, int]] = {}
        """Shard offset of a chunk -> (chunk id, end offset)."""
        self._owned_start = 0
        self._profile: list[dict[str, Any]] = []
        self._cur: _Version | None = None
        self._pending_commit: tuple[int, Any, torch.Tensor] | None = None
        self.committed: int | None = None
        self.persister: Persister | None = None
        self._persist: tuple[int, SaveHandle] | None = None
        self._checkpoints_committed = 0
        self.last_metrics: dict[str, Any] = {}
        self.plan_iteration = ck.profile_iters
        self._plan_input: dict[str, Any] | None = None
        self._checkpoints_since_plan = 0
        self._observed: tuple[int, float] = (0, 0.0)
        trainer.hooks = self

    # ------------------------------------------------------------------ set-up
    def layout(self) -> StateLayout:
        return StateLayout(
            rank=self.rank, tensors=self.flat.specs(), replicas=self.topology.replicas(self.rank)
        )

    def start(self, resume_iteration: int) -> None:
        """Prepare for training from ``resume_iteration`` (re-plans at once after a restart).
        Collective: every rank calls it once."""
        self._find_same_host_peers()
        self.plan_iteration = max(resume_iteration, 0) + self.ck.profile_iters
        saved = self.run_dir / PLAN_INPUT_FILE
        if saved.exists():
            self._plan_from(json.loads(saved.read_text()), source="saved profile")
        if self.ck.persist_dir and self.policy.persist_every:
            group = dist.new_group(backend="gloo")
            self.persister = Persister(
                self.ck.persist_dir,
                keep_latest=self.policy.keep_latest,
                process_group=group,
                rank=self.rank,
                timeout_s=self.ck.timeout_s * 10,
            )

    def _find_same_host_peers(self) -> None:
        """Ranks whose stores live in this host's memory (same boot of the same machine and
        a store directory visible here): redundancy between them moves through the store,
        not the network (``exchange=auto``). Collective."""
        me = {"host": host_id(), "store": str(self.store.path)}
        everyone = self.transport.all_gather_object(me)
        self.peers = {}
        if self.ck.exchange != "auto":
            return
        for r, info in enumerate(everyone):
            if r != self.rank and info["host"] == me["host"]:
                self.peers[r] = PeerStore(info["store"], r)

    def _gather_and_plan(self) -> None:
        records = [parse_record(d) for d in self._profile]
        bmap = bubble_map(self.rank, records, skip=0)
        cost = self._calibrate() if self.rank == 0 else None
        gathered = self.transport.all_gather_object(
            {"bubbles": bmap_to_json(bmap), "layout": layout_to_json(self.layout()), "cost": cost}
        )
        plan_input = {
            "ranks": [{k: v for k, v in g.items() if k != "cost"} for g in gathered],
            "cost": gathered[0]["cost"],
            "world_size": self.topology.world_size,
        }
        self._save_plan_input(plan_input)
        self._plan_from(plan_input, source="profile")

    def _save_plan_input(self, plan_input: dict[str, Any]) -> None:
        if self.rank == 0:
            tmp = self.run_dir / (PLAN_INPUT_FILE + ".tmp")
            tmp.write_text(json.dumps(plan_input))
            tmp.replace(self.run_dir / PLAN_INPUT_FILE)

    def _maybe_replan(self) -> None:
        """Once, after a few checkpoints: re-plan if snapshots copy at another rate than
        the plan assumed (the start-up micro-benchmark copies one hot buffer; real
        snapshots gather many tensors next to a computing neighbour, 2-4x slower here).

        Collective: every rank reaches it at the same iteration. The measured rate is the
        slowest rank's. If the new plan moves a shard boundary (the same decision on every
        rank: the plan is deterministic), every store forgets its versions and the next
        checkpoint commits under the new layout; otherwise the stored versions stay valid.
        """
        if self._plan_input is None or self._plan_input.get("replanned"):
            return
        if self._checkpoints_since_plan < REPLAN_AFTER_CHECKPOINTS:
            return
        nbytes, seconds = self._observed
        rates = self.transport.all_gather_object(nbytes / seconds if seconds > 0 else None)
        measured = [r for r in rates if r]
        self._plan_input["replanned"] = True
        if not measured:
            return
        rate = min(measured)
        assumed = float(self._plan_input["cost"].get("copy_Bps", CostModel().copy_Bps))
        if 0.8 <= rate / assumed <= 1.25:
            return
        self._resolve_commit()
        self._quiesce()
        self._plan_input["cost"]["copy_Bps"] = rate
        self._save_plan_input(self._plan_input)
        assert self.plan is not None
        before = {r: (p.owned_start, p.owned_stop) for r, p in self.plan.ranks.items()}
        self._plan_from(
            self._plan_input,
            source=f"re-plan: snapshots copy at {rate / 1e9:.2f} GB/s, assumed {assumed / 1e9:.2f}",
        )
        after = {r: (p.owned_start, p.owned_stop) for r, p in self.plan.ranks.items()}
        if after != before:  # shard layout moved: old versions must not mix with new ones
            self.store.clear_versions()
            self.committed = None

    def _calibrate(self) -> dict[str, float]:
        """The cost model: configured values, else a ~1 s micro-benchmark on this machine."""
        if self.ck.cost:
            return dict(self.ck.cost)
        from baft.profile.calibrate import measure_cost_model

        return measure_cost_model(8 << 20, repeats=2)

    def _plan_from(self, plan_input: dict[str, Any], source: str) -> None:
        ranks = plan_input["ranks"]
        if plan_input.get("world_size") != self.topology.world_size:
            return
        self._plan_input = plan_input
        self._checkpoints_since_plan = 0
        self._observed = (0, 0.0)
        bubbles = {r: bmap_from_json(d["bubbles"]) for r, d in enumerate(ranks)}
        layouts = {r: layout_from_json(d["layout"]) for r, d in enumerate(ranks)}
        if layouts[self.rank] != self.layout():
            raise RuntimeError(f"rank {self.rank}: saved plan input does not match this model")
        plan = make_plan(
            bubbles, layouts, CostModel.from_measurements(plan_input["cost"]), self.policy
        )
        self.plan = plan
        rp = plan.ranks[self.rank]
        shard_sizes = {r: p.owned_stop - p.owned_start for r, p in plan.ranks.items()}
        self.group_layout = group_layouts(self.topology, self.redundancy, shard_sizes)[self.rank]
        red_nbytes = self.group_layout.redundancy_nbytes(self.rank)
        self._allocate_everywhere(rp.owned_stop - rp.owned_start, red_nbytes)
        self.exchange = RedundancyExchange(
            self.group_layout if self.redundancy.kind != "none" else None,
            self.rank,
            self.transport,
            self.policy.max_chunk_bytes,
            peers=self.peers,
            timeout_s=self.ck.timeout_s,
        )
        self._slot_tasks, self._all_tasks = {}, []
        for slot_id, tasks in list(rp.tasks.items()) + [(SPILL, rp.spilled)]:
            for t in tasks:
                if t.kind is TaskKind.SNAPSHOT:
                    entry = (t, self.flat.pieces(t.offset, t.offset + t.nbytes))
                    self._slot_tasks.setdefault(slot_id, []).append(entry)
                    self._all_tasks.append(entry)
        self._all_tasks.sort(key=lambda e: e[0].offset)
        self._owned_start = rp.owned_start
        self._chunk_by_offset = {
            t.offset - rp.owned_start: (t.chunk_id, t.offset - rp.owned_start + t.nbytes)
            for t, _ in self._all_tasks
        }
        self.plan_iteration = -1
        paths = self.exchange.paths()
        via = (
            f"; redundancy into rank {self.rank}: {paths['shm'] / 2**20:.1f} MiB/version from "
            f"same-host stores, {paths['net'] / 2**20:.1f} MiB over the network"
        )
        log.info("checkpoint plan (%s)%s", source, via)
        if self.rank == 0:
            print(f"[baft] checkpoint plan ({source}): {plan.reason}{via}", flush=True)

    def _allocate_everywhere(self, data_nbytes: int, red_nbytes: int) -> None:
        """Allocate the store; collective, so that a rank over its memory budget (or a
        full tmpfs) fails every rank with the same error instead of leaving its peers
        blocked in the next collective until they time out."""
        error: str | None = None
        try:
            self._allocate(data_nbytes, red_nbytes)
        except MemoryBudgetError as e:
            error = str(e)
        errors = [e for e in self.transport.all_gather_object(error) if e]
        if errors:
            raise MemoryBudgetError(errors[0])

    def _allocate(self, data_nbytes: int, red_nbytes: int) -> None:
        """(Re)create the store's slots; on CUDA pin them so device copies are DMA."""
        self.store.allocate(data_nbytes, red_nbytes)
        if self.mesh.device.type == "cuda":
            for slot in (0, 1):
                pin_host_buffer(torch.from_numpy(self.store.data_view(slot)))

    # ------------------------------------------------------------------ hooks
    def apply_rng(self) -> None:
        """Make the restored RNG state (inside the flat state) the live one."""
        torch.set_rng_state(self._rng.clone())

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        self._rng.copy_(torch.get_rng_state())
        self._fire("iteration", iteration)
        if self.naive:  # naive-async: everything starts at once on the (ungated) worker
            v = self._current(iteration)
            if v is not None:
                v.snapshot_event = threading.Event()
                self.worker.submit(lambda: self._run_all(v))
        elif self._slot_tasks.get(SPILL):
            # Copies that fit no bubble start now on an asynchronous copier and finish by
            # the deadline, instead of stalling the host just before the step.
            cur = self._current(iteration)
            if cur is not None:
                for task, pieces in self._slot_tasks[SPILL]:
                    self._snapshot(
                        cur,
                        task,
                        pieces,
                        timeline,
                        "iteration_start",
                        exposed=False,
                        copier=self.spill_copier,
                    )

    def on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        if self.injector is not None:
            delay = self.injector.slot_delay(timeline.iteration)
            if delay:
                time.sleep(delay)
        if self.naive:
            return
        v = self._current(timeline.iteration)
        if v is None:
            return
        for task, pieces in self._slot_tasks.get(slot_id, ()):
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
            if v.snapshot_event is not None:  # naive-async: the snapshot must be done
                start = timeline.now()
                v.snapshot_event.wait()
                v.exposed_s += timeline.now() - start
                timeline.add(
                    "snapshot-join", "ckpt", start, timeline.now(), slot="pre_step", exposed=True
                )
            for task, pieces in self._all_tasks:
                if task.chunk_id not in v.done:
                    self._snapshot(v, task, pieces, timeline, "pre_step", exposed=True)
            start = timeline.now()
            self.copier.synchronize()  # the step deadline: every copy of v is done
            if self.spill_copier is not self.copier:
                self.spill_copier.synchronize()
            waited = timeline.now() - start
            v.seconds["deadline_wait"] += waited
            v.exposed_s += waited
            if waited > 1e-4:
                timeline.add(
                    "snapshot-wait", "ckpt", start, start + waited, slot="pre_step", exposed=True
                )
        self._fire("step", iteration)

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        v = self._cur
        if v is not None and v.version == iteration:
            start = timeline.now()
            self._fire("transfer", iteration)
            self.worker.drain()  # checksums and sends not done in bubbles: exposed
            encoded = self.exchange.finish() if self.exchange is not None else 0
            if self.exchange is not None:
                for name, sec in self.exchange.seconds.items():
                    v.seconds[name] += sec
            complete = self.store.path.exists()  # a store wiped under a live rank loses v
            if complete:
                self._complete(v, iteration)
            end = timeline.now()
            v.exposed_s += end - start
            timeline.add(
                "protect", "ckpt", start, end, slot="after_step", exposed=True, bytes=encoded
            )
            self._post_commit(v.version, complete)
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
    def _current(self, iteration: int) -> _Version | None:
        """The version written in this iteration, begun on first use; None if none is due."""
        if self._cur is not None and self._cur.version == iteration:
            return self._cur
        if not self.enabled or self.plan is None or iteration % self.plan.interval_iters:
            return None
        if iteration == self.skip_version:  # restored from memory: already committed there
            return None
        self._resolve_commit()
        self._protect_persisted_slot()
        if not self.store.path.exists():  # store lost under a live rank: start it afresh
            self._quiesce()
            self._allocate(self.store.data_view(0).size, self.store.red_view(0).size)
        slot = self.store.begin(iteration)
        data = torch.from_numpy(self.store.data_view(slot))
        red = torch.from_numpy(self.store.red_view(slot))
        self._cur = _Version(iteration, slot, data, red)
        if self.exchange is not None:
            self.exchange.begin(data, red, iteration)
        self.store.publish(iteration, slot, 0)
        return self._cur

    def _snapshot(
        self,
        v: _Version,
        task: Task,
        pieces: tuple[Piece, ...],
        timeline: IterationTimeline | None,
        slot_id: str,
        *,
        exposed: bool,
        copier: DeviceCopy | None = None,
    ) -> None:
        start = time.perf_counter()
        lo = task.offset - self._owned_start
        out = v.data[lo : lo + task.nbytes]
        copier = copier or self.copier
        copy = copier.start(self.flat.pairs(pieces, out))  # returns at once if async
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
                "snapshot",
                "ckpt",
                end - elapsed,
                end,
                slot=slot_id,
                bytes=task.nbytes,
                exposed=exposed,
            )

    def _protect(self, v: _Version, chunk_id: int, out: torch.Tensor, copy: ChunkCopy) -> None:
        """Worker: once a chunk's copy is done, record its checksum (hashed during the copy
        by host copiers) and send the redundancy pieces it completes."""
        copy.wait(self.ck.timeout_s)
        v.seconds["copy"] += copy.seconds
        if copy.background:
            v.in_bubble_s += copy.seconds  # background copy time, off the training thread
        if copy.seconds > 0:  # measured copy rate (the re-plan compares it with the plan's)
            self._observed = (self._observed[0] + copy.nbytes, self._observed[1] + copy.seconds)
        if copy.checksum is None:  # CUDA: the host hashes the copied bytes once
            t0 = time.perf_counter()
            copy.checksum = checksum(out.numpy())
            v.seconds["hash"] += time.perf_counter() - t0
        v.checksums[chunk_id] = copy.checksum
        v.protected.add(chunk_id)
        before = v.covered
        while (nxt := self._chunk_by_offset.get(v.covered)) and nxt[0] in v.protected:
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

    def _run_all(self, v: _Version) -> None:
        """naive-async (on the worker): snapshot and protect everything at once."""
        self.worker_thread = threading.current_thread()
        for task, pieces in self._all_tasks:
            if task.chunk_id not in v.done:
                self._snapshot(v, task, pieces, None, "naive", exposed=False)
        assert v.snapshot_event is not None
        v.snapshot_event.set()

    # ------------------------------------------------------------------ commit
    def _complete(self, v: _Version, iteration: int) -> None:
        assert self.plan is not None and self.group_layout is not None
        rp = self.plan.ranks[self.rank]
        chunks = tuple(
            ChunkRecord(t.chunk_id, t.offset - rp.owned_start, t.nbytes, v.checksums[t.chunk_id])
            for t, _ in self._all_tasks
        )
        known = self.exchange.region_checksums if self.exchange is not None else {}
        regions = region_records(v.red.numpy(), self.group_layout.regions(self.rank), known)
        meta = {
            "position": iteration,
            "flat_nbytes": self.flat.nbytes,
        }
        manifest = Manifest.for_layout(
            topology=self.topology,
            layout=self.group_layout,
            rank=self.rank,
            version=v.version,
            iteration=iteration,
            owned_start=rp.owned_start,
            owned_stop=rp.owned_stop,
            chunks=chunks,
            regions=regions,
            meta=meta,
        )
        self.store.complete(v.slot, manifest)

    def _post_commit(self, version: int, complete: bool) -> None:
        """Start the global agreement on ``version``; a rank that could not complete it votes -1."""
        t = torch.tensor([version if complete else -1], dtype=torch.int64)
        group = getattr(self.transport, "group", None)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True)
        self._pending_commit = (version, work, t)

    def _resolve_commit(self) -> None:
        if self._pending_commit is None:
            return
        version, work, t = self._pending_commit
        self._pending_commit = None
        work.wait()
        if int(t.item()) == version:
            self.store.commit(version)
            self.committed = version
            self._checkpoints_committed += 1
            self._maybe_persist(version)

    # ------------------------------------------------------------------ persist
    def _maybe_persist(self, version: int) -> None:
        if self.persister is None or self._checkpoints_committed % self.policy.persist_every:
            return
        self._fire("persist", version)
        self._join_persist()
        slot = next(
            s
            for s in (0, 1)
            if (m := self.store.read_manifest(s)) is not None and m.version == version
        )
        state = self._persist_state(slot)
        meta = {"version": version, "rank_meta": {}, "world_size": self.topology.world_size}
        self._persist = (version, self.persister.save_async(version, state, meta))

    def _persist_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Whole tensors of this rank's shard, as typed views of the committed slot."""
        assert self.plan is not None
        rp = self.plan.ranks[self.rank]
        data = torch.from_numpy(self.store.data_view(slot))
        out: dict[str, torch.Tensor] = {}
        for name, t, off in zip(self.flat.names, self.flat.tensors, self.flat.offsets, strict=True):
            n = t.numel() * t.element_size()
            if rp.owned_start <= off and off + n <= rp.owned_stop:
                raw = data[off - rp.owned_start : off - rp.owned_start + n]
                out[persist_name(name)] = raw.view(t.dtype).view(t.shape)
        return out

    def _quiesce(self) -> None:
        """Nothing may still read the store's mappings: they are about to be replaced
        (a resized file under a live mapping is a SIGBUS for its reader)."""
        self.worker.drain()
        self._join_persist()

    def _join_persist(self) -> None:
        """Wait for the DCP save in flight, if any."""
        if self._persist is not None:
            self._persist[1].wait()
            self._persist = None

    def _protect_persisted_slot(self) -> None:
        """Never overwrite a slot the persister is still reading."""
        if self._persist is not None and self._persist[0] != self.committed:
            self._join_persist()

    # ------------------------------------------------------------------ misc
    def _fire(self, point: str, iteration: int) -> None:
        if self.injector is not None:
            self.injector.fire(point, iteration)

    def _metrics(self, v: _Version | None) -> dict[str, Any]:
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

    def close(self) -> None:
        """Finish pending commit and persist; release the store mappings."""
        self.worker.shutdown()
        self.copier.shutdown()
        if self.spill_copier is not self.copier:
            self.spill_copier.shutdown()
        for peer in self.peers.values():
            peer.close()
        self._resolve_commit()
        self._join_persist()
        if self.persister is not None:
            self.persister.shutdown()
        self.store.close()
