"""The version writer: open, snapshot at slots, meet the step deadline, finish one version.

It owns the version being written (:class:`~baft.engine.versions.Version`), the copiers,
the protect worker and the redundancy exchange of the current layout. *When* snapshot
tasks start is the :class:`~baft.engine.scheduling.Scheduling` seam it is given.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from baft.engine.device import ChunkCopy, DeviceCopy
from baft.engine.flat import FlatState, Piece
from baft.engine.planning import SnapshotSchedule
from baft.engine.redundancy import PeerStoreGone, RedundancyExchange
from baft.engine.rotation import Layout
from baft.engine.scheduling import Scheduling
from baft.engine.transport import Transport
from baft.engine.versions import Version
from baft.engine.worker import ProtectWorker
from baft.pipeline import IterationTimeline
from baft.plan.types import Task
from baft.store.manifest import ChunkRecord, Manifest, checksum, region_records
from baft.store.peer import PeerStore
from baft.store.shm import SnapshotStore
from baft.topology import Topology

log = logging.getLogger("baft")


class VersionWriter:
    """Writes one version at a time into the store: snapshot copies, checksums,
    redundancy sends and pulls, the deadline, and the manifest of a complete version."""

    def __init__(
        self,
        *,
        rank: int,
        topology: Topology,
        store: SnapshotStore,
        transport: Transport,
        copier: DeviceCopy,
        spill_copier: DeviceCopy,
        worker: ProtectWorker,
        peers: dict[int, PeerStore],
        scheduling: Scheduling,
        max_chunk_bytes: int,
        timeout_s: float,
        injector: Any = None,
    ) -> None:
        self.rank = rank
        self.topology = topology
        self.store = store
        self.transport = transport
        self.copier = copier
        self.spill_copier = spill_copier
        self.worker = worker
        self.peers = peers
        self.scheduling = scheduling
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self.injector = injector
        self.layout: Layout | None = None
        self.exchange: RedundancyExchange | None = None
        self.source: FlatState | None = None
        """The bytes this version's tasks copy: the flat state or the version's payload."""
        self.schedule = SnapshotSchedule()
        self.current: Version | None = None
        self.observed: tuple[int, float] = (0, 0.0)
        """Bytes and seconds of snapshot copies under this layout (the re-plan's input)."""

    def use(self, layout: Layout, *, redundant: bool) -> None:
        """Write the versions of ``layout`` from now on."""
        self.layout = layout
        self.schedule = layout.schedule
        self.observed = (0, 0.0)
        self.exchange = RedundancyExchange(
            layout.group if redundant else None,
            self.rank,
            self.transport,
            self.max_chunk_bytes,
            peers=self.peers,
            timeout_s=self.timeout_s,
            background=self.worker,
        )

    @property
    def base_schedule(self) -> SnapshotSchedule | None:
        return self.layout.schedule if self.layout is not None else None

    @property
    def has_same_host_peers(self) -> bool:
        return self.exchange is not None and bool(self.exchange.peers)

    def fire(self, point: str, iteration: int) -> None:
        if self.injector is not None:
            self.injector.fire(point, iteration)

    # ------------------------------------------------------------------ open
    def open(
        self, version: int, keep: range, source: FlatState, schedule: SnapshotSchedule
    ) -> Version:
        """Begin ``version`` in a free store slot (never the newest committed one, nor
        the payloads in ``keep``); its tasks copy ``source`` along ``schedule``."""
        slot = self.store.begin(version, keep=keep)
        data = torch.from_numpy(self.store.data_view(slot))
        red = torch.from_numpy(self.store.red_view(slot))
        self.current = v = Version(version, slot, data, red)
        self.source, self.schedule = source, schedule
        if self.exchange is not None:
            self.exchange.begin(data, red, version)
        self.store.publish(version, slot, 0)
        return v

    # ------------------------------------------------------------------ snapshot
    def snapshot(
        self,
        v: Version,
        task: Task,
        pieces: tuple[Piece, ...],
        timeline: IterationTimeline | None,
        slot_id: str,
        *,
        exposed: bool = False,
        copier: DeviceCopy | None = None,
        inline: bool = False,
    ) -> None:
        """Start one task's copy; its protect work runs on the worker (``inline``: here,
        when this already is the worker)."""
        assert self.source is not None
        start = time.perf_counter()
        lo = task.offset - self.schedule.owned_start
        out = v.data[lo : lo + task.nbytes]
        copier = copier or self.copier
        copy = copier.start(self.source.pairs(pieces, out))  # returns at once if async
        v.done.add(task.chunk_id)
        v.snapshot_bytes += task.nbytes
        chunk_id = task.chunk_id
        if inline:
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
        copy.wait(self.timeout_s)
        v.seconds["copy"] += copy.seconds
        if copy.background:
            v.in_bubble_s += copy.seconds  # background copy time, off the training thread
        if copy.seconds > 0:  # measured copy rate (the re-plan compares it with the plan's)
            self.observed = (self.observed[0] + copy.nbytes, self.observed[1] + copy.seconds)
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

    def pull(self) -> None:
        """Worker: copy whatever same-host peers have finished of the current version."""
        if self.exchange is not None:
            self.exchange.pull_ready()

    # ------------------------------------------------------------------ deadline, finish
    def deadline(self, v: Version, timeline: IterationTimeline) -> None:
        """The step deadline: copy what no slot took, wait for every copy of ``v``."""
        self.scheduling.deadline(self, v, timeline)
        for task, pieces in self.schedule.all_tasks:
            if task.chunk_id not in v.done:
                self.snapshot(v, task, pieces, timeline, "pre_step", exposed=True)
        start = timeline.now()
        self.synchronize()
        waited = timeline.now() - start
        v.seconds["deadline_wait"] += waited
        v.exposed_s += waited
        if waited > 1e-4:
            timeline.add(
                "snapshot-wait", "ckpt", start, start + waited, slot="pre_step", exposed=True
            )

    def synchronize(self) -> None:
        self.copier.synchronize()
        if self.spill_copier is not self.copier:
            self.spill_copier.synchronize()

    def finish(self, v: Version, meta: dict[str, Any]) -> tuple[bool, int]:
        """After the step: wait for ``v``'s protect work and redundancy, record its
        manifest (``meta`` inside) if complete. Returns (complete, bytes encoded)."""
        peers_intact = True
        with self.transport.waiting():  # the network's threads run at normal priority
            self.worker.drain()  # checksums and sends not done in bubbles: exposed
            try:
                encoded = self.exchange.finish() if self.exchange is not None else 0
            except PeerStoreGone as e:  # its store is gone: v fails the vote, job goes on
                log.warning("v%d is not protected: %s", v.version, e)
                encoded, peers_intact = 0, False
        if self.exchange is not None:
            for name, sec in self.exchange.seconds.items():
                v.seconds[name] += sec
        # a store wiped under a live rank (its own or a same-host sender's) loses v
        complete = peers_intact and self.store.path.exists()
        if complete:
            self.store.complete(v.slot, self._manifest(v, meta))
        self.current = None
        return complete, encoded

    def _manifest(self, v: Version, meta: dict[str, Any]) -> Manifest:
        assert self.layout is not None
        s, group = self.schedule, self.layout.group
        chunks = tuple(
            ChunkRecord(t.chunk_id, t.offset - s.owned_start, t.nbytes, v.checksums[t.chunk_id])
            for t, _ in s.all_tasks
        )
        known = self.exchange.region_checksums if self.exchange is not None else {}
        regions = region_records(v.red.numpy(), group.regions(self.rank), known)
        return Manifest.for_layout(
            topology=self.topology, layout=group, rank=self.rank, version=v.version,
            iteration=v.version, owned_start=s.owned_start, owned_stop=s.owned_stop,
            chunks=chunks, regions=regions, meta=meta,
        )  # fmt: skip

    def metrics(self, v: Version | None) -> dict[str, Any]:
        ex = self.exchange if v is not None else None
        return {
            "ckpt_version": v.version if v else None,
            "in_bubble_s": v.in_bubble_s if v else 0.0,
            "exposed_s": v.exposed_s if v else 0.0,
            "seconds": dict(v.seconds) if v else {},
            "bytes": {
                "snapshot": v.snapshot_bytes if v else 0,
                "send": ex.bytes_sent if ex else 0,
                "recv": ex.bytes_received if ex else 0,
                "pull": ex.bytes_pulled if ex else 0,
            },
        }

    def shutdown(self) -> None:
        getattr(self.scheduling, "shutdown", lambda: None)()
        self.worker.shutdown()
        self.copier.shutdown()
        if self.spill_copier is not self.copier:
            self.spill_copier.shutdown()
        for peer in self.peers.values():
            peer.close()
