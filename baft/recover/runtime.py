"""Restore at start-up: inventory every store, agree on a plan, rebuild, load, resume.

Every process runs :func:`recover_and_start` right after the process group is up (a
fresh job finds empty stores and starts at iteration 0):

1. **Inventory.** Each rank opens its node's store and verifies every checksum.
2. **Agree.** Inventories are all-gathered on the checkpoint group and every rank runs
   the pure coordinator on the same inputs, so all reach the same :class:`RecoveryPlan`.
3. **Rebuild.** Peer pieces (replicas, parity inputs) move on the checkpoint group, in
   plan order, tags = position in the plan; decoding ranks rebuild their shard.
4. **Load.** DP replicas exchange shards (broadcast in dp order) to rebuild the full flat
   state, which is written into the live parameters and optimizer state; the RNG state
   travels inside the flat state; the data position is the version itself.
5. **Report.** Rank 0 appends the recovery (version, lost iterations, source of every
   shard, seconds per phase) to ``RUN_DIR/recoveries.jsonl``. After a hang the record
   also says who hung (``hang``) and splits ``detect`` (freeze to the first rank that
   noticed) from ``restart``, from the watchdog's ``hangs.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from baft.engine.engine import CheckpointEngine
from baft.engine.persister import list_versions, load_version, persist_name
from baft.engine.transport import Handle, Transport
from baft.engine.watchdog import read_hangs
from baft.recover.coordinator import RecoveryPlan, coordinate
from baft.store.coding import Redundancy
from baft.store.manifest import RankInventory, checksum
from baft.store.shm import SnapshotStore, StoreReadError
from baft.topology import Topology

log = logging.getLogger("baft")


class RestoreError(RuntimeError):
    """A rank cannot be restored; the message names the shard, version and cause."""


class RecoveryReport:
    """Timing and provenance of one recovery, written by rank 0."""

    def __init__(self, run_dir: Path, attempt: int) -> None:
        self.run_dir = run_dir
        self.record: dict[str, Any] = {"attempt": attempt, "seconds": {}}
        self._t_start_first = 0.0

    def phase(self, name: str, seconds: float) -> None:
        self.record["seconds"][name] = round(seconds, 6)

    def first_iteration_started(self) -> None:
        self._t_start_first = time.time()

    def first_iteration_done(self, is_main: bool) -> None:
        self.phase("first_iteration", time.time() - self._t_start_first)
        self.record["resumed_at"] = time.time()
        if is_main:
            with open(self.run_dir / "recoveries.jsonl", "a") as f:
                f.write(json.dumps(self.record) + "\n")
            r = self.record
            secs = ", ".join(f"{k} {v:.3f}s" for k, v in r["seconds"].items())
            log.info(
                "recovered v%s from %s (lost %s iteration(s)): %s",
                r["restored_version"],
                r["source"],
                r["lost_iterations"],
                secs,
            )


PROGRESS_FILE = "progress.json"
"""The run's one progress record: the last iteration whose step finished (rank 0 writes it
after every step through ``baft.protect``); a recovery counts the iterations it loses."""


def write_progress(run_dir: Path, iteration: int) -> None:
    """Record that ``iteration`` finished (atomically: a crash leaves the old record)."""
    tmp = run_dir / (PROGRESS_FILE + ".tmp")
    tmp.write_text(json.dumps({"iteration": iteration}))
    tmp.replace(run_dir / PROGRESS_FILE)


def _completed_iterations(run_dir: Path) -> int:
    """Iterations the run finished before this start (0 for a new run)."""
    try:
        return int(json.loads((run_dir / PROGRESS_FILE).read_text())["iteration"]) + 1
    except (OSError, json.JSONDecodeError, KeyError, ValueError, TypeError):
        return 0


def recover_and_start(
    engine: CheckpointEngine, run_dir: Path, *, t_launch: float, t_rdzv: float
) -> tuple[int, RecoveryReport | None]:
    """Restore the newest recoverable version into ``engine``'s state and start it.

    Returns the iteration to resume from and the recovery's report (None on a fresh
    job). Collective: every rank calls it once, right after building its engine.
    """
    ck = engine.ck
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    injector = engine.injector
    t0 = time.time()
    persist_dir = ck.persist_dir
    persisted = (
        tuple(list_versions(persist_dir)) if persist_dir and Path(persist_dir).exists() else ()
    )
    plan, reason, invs = _agree(
        engine.store, engine.transport, engine.topology, engine.redundancy, persisted
    )
    t_inventory = time.time() - t0
    if (
        plan.source == "fresh"
        and attempt == 0
        and all(i is None or not i.versions for i in invs.values())
    ):
        engine.start(0)
        return 0, None
    report = RecoveryReport(run_dir, attempt)
    if injector is not None:
        injector.fire("recovery", plan.version or 0)
    t1 = time.time()
    if plan.source == "memory":
        shard = _rebuild_shard(engine.store, engine.transport, engine.rank, plan)
        t_transfer = time.time() - t1
        t2 = time.time()
        _load_from_shards(engine, plan, shard)
    elif plan.source == "disk":
        t_transfer = 0.0
        t2 = time.time()
        _load_from_disk(engine, plan, persist_dir)
        engine.store.clear_versions()
    else:
        t_transfer = 0.0
        t2 = time.time()
    t_load = time.time() - t2
    resume = plan.version or 0
    completed = _completed_iterations(run_dir)
    fault_times = [r.time for r in injector.fired_records()] if injector is not None else []
    report.record.update(
        restored_version=plan.version,
        resume_iteration=resume,
        lost_iterations=max(0, completed - resume),
        source=plan.source,
        sources={str(r): s.kind for r, s in plan.shards.items()} if plan.source == "memory" else {},
        reason=reason,
    )
    if fault_times:
        report.phase("detect_restart", t_launch - max(fault_times))
    _report_hang(report, run_dir, attempt, t_launch)
    if t_rdzv > t_launch:
        report.phase("rendezvous", t_rdzv - t_launch)
    report.phase("inventory", t_inventory)
    report.phase("transfer_decode", t_transfer)
    report.phase("load", t_load)
    if engine.rank == 0:
        log.info("recovery: %s", reason)
    engine.store.drop_read_cache()
    engine.start(resume, restored_version=plan.version if plan.source == "memory" else None)
    report.first_iteration_started()
    return resume, report


def _report_hang(report: RecoveryReport, run_dir: Path, attempt: int, t_launch: float) -> None:
    """If a watchdog ended the previous attempt: who hung, and detection apart from restart.

    ``detect`` runs from the suspect's last heartbeat (the freeze, to within one beat
    period) to the first rank that noticed; ``restart`` from there to this process's start.
    """
    hangs = read_hangs(run_dir, attempt - 1) if attempt > 0 else []
    if not hangs:
        return
    first = hangs[0]
    report.record["hang"] = {
        k: first.get(k) for k in ("kind", "suspect", "section", "detected_by", "reason")
    }
    report.record["detected_at"] = first["detected_at"]
    report.phase("detect", first["detected_at"] - first["last_seen_at"])
    report.phase("restart", t_launch - first["detected_at"])


def _agree(
    store: SnapshotStore,
    transport: Transport,
    topology: Topology,
    redundancy: Redundancy,
    persisted: tuple[int, ...],
) -> tuple[RecoveryPlan, str, dict[int, RankInventory | None]]:
    """Agree on a RecoveryPlan, checksumming only the bytes the plan will read.

    Round 1 trusts every complete manifest, plans, and each rank verifies just what the
    plan reads from its store (its shard if local, the ranges and regions it sends).
    If all of that is clean the plan stands; otherwise round 2 verifies everything and
    plans again. A rank crash thus checks one shard per rank instead of both slots of
    data and redundancy (4x fewer bytes), and a bad byte still never gets through.
    Collective over ``transport``: every rank calls it with its own store.
    """
    exists = store.path.exists()
    light = store.inventory(verify=False) if exists else None
    claimed = dict(enumerate(transport.all_gather_object(_claim(light))))
    plan, reason = coordinate(topology, redundancy, claimed, persisted)
    problems = _verify_reads(store, transport.rank, plan) if plan.source == "memory" else []
    if not any(transport.all_gather_object(problems)):
        return plan, reason, claimed
    full = store.inventory(verify=True) if exists else None
    invs = dict(enumerate(transport.all_gather_object(full)))
    plan, reason = coordinate(topology, redundancy, invs, persisted)
    return plan, reason, invs


def _claim(inv: RankInventory | None) -> RankInventory | None:
    """An unverified inventory whose complete versions are taken at their word."""
    if inv is None:
        return None
    versions = tuple(
        dataclasses.replace(v, verified=True, data_ok=True, bad_regions=())
        if v.state == "complete" and v.manifest is not None
        else v
        for v in inv.versions
    )
    return dataclasses.replace(inv, versions=versions)


def _verify_reads(store: SnapshotStore, rank: int, plan: RecoveryPlan) -> list[str]:
    """Checksum the store bytes this rank contributes to ``plan``; returns the problems."""
    data_slots: set[int] = set()
    region_ids: dict[int, set[int]] = {}
    src = plan.shards.get(rank)
    if src is not None and src.kind == "local" and src.slot is not None:
        data_slots.add(src.slot)
    for t in plan.transfers:
        if t.src_rank == rank and t.kind == "shard":
            data_slots.add(t.src_slot)
        elif t.src_rank == rank:
            region_ids.setdefault(t.src_slot, set()).add(t.region_id)
    problems: list[str] = []
    for slot in sorted(data_slots | set(region_ids)):
        m = store.read_manifest(slot)
        if m is None or m.version != plan.version:
            problems.append(f"rank {rank} slot {slot}: v{plan.version} is not there")
            continue
        try:
            if slot in data_slots:
                data = store.read(slot, "data", 0, m.data_nbytes)
                problems += [
                    f"rank {rank} v{m.version} chunk {c.chunk_id}: checksum mismatch"
                    for c in m.chunks
                    if checksum(data[c.offset : c.offset + c.nbytes]) != c.xxh3
                ]
            wanted = region_ids.get(slot, set())
            if wanted:
                red = store.read(slot, "red", 0, m.red_nbytes)
                problems += [
                    f"rank {rank} v{m.version} region {r.region_id}: checksum mismatch"
                    for r in m.regions
                    if r.region_id in wanted
                    and checksum(red[r.offset : r.offset + r.nbytes]) != r.xxh3
                ]
        except StoreReadError as err:
            problems.append(f"rank {rank} v{m.version}: {err}")
    return problems


def _read(store: SnapshotStore, slot: int, kind: str, offset: int, nbytes: int) -> np.ndarray:
    try:
        return store.read(slot, kind, offset, nbytes)
    except StoreReadError as err:
        raise RestoreError(str(err)) from err


def _rebuild_shard(
    store: SnapshotStore, transport: Transport, rank: int, plan: RecoveryPlan
) -> np.ndarray:
    """This rank's shard of ``plan.version``: local read, or peer pieces + decode.

    Collective over ``transport`` (tags = position in ``plan.transfers``). A peer that dies
    mid-transfer makes the wait raise (the transport's timeout or its failure signal),
    re-raised as a :class:`RestoreError` naming the transfer."""
    handles = []
    received: dict[int, np.ndarray] = {}
    for tag, t in enumerate(plan.transfers):
        if t.src_rank == rank:
            kind = "data" if t.kind == "shard" else "red"
            buf = torch.from_numpy(_read(store, t.src_slot, kind, t.offset, t.nbytes))
            handles.append((transport.isend(buf, t.dst_rank, tag), t))
        if t.dst_rank == rank:
            rbuf = torch.empty(t.nbytes, dtype=torch.uint8)
            handles.append((transport.irecv(rbuf, t.src_rank, tag), t))
            received[tag] = rbuf.numpy()
    for h, t in handles:
        try:
            h.wait()
        except Exception as e:  # noqa: BLE001 - re-raised with the transfer named
            raise RestoreError(
                f"rank {rank}: {t.kind} transfer of v{plan.version} rank {t.src_rank} -> "
                f"rank {t.dst_rank} ({t.nbytes} B) failed: {e}"
            ) from e
    source = plan.shards[rank]
    n = plan.shard_nbytes[rank]
    if source.kind == "local":
        assert source.slot is not None
        return _read(store, source.slot, "data", 0, n)
    if source.kind == "replica":  # a peer's replica region holds the whole shard
        (rid,) = source.region_ids[:1]
        tag = next(
            tag
            for tag, t in enumerate(plan.transfers)
            if t.dst_rank == rank and t.kind == "region" and t.region_id == rid
        )
        if received[tag].size < n:
            raise RestoreError(
                f"rank {rank}: replica region {rid} of v{plan.version} holds "
                f"{received[tag].size} bytes, shard has {n}"
            )
        return received[tag][:n]
    decode = next((d for d in plan.decodes if d.rank == rank), None)
    if decode is None:
        raise RestoreError(f"rank {rank}: no local shard of v{plan.version} and no decode planned")
    shards: dict[int, np.ndarray] = {}
    regions: dict[int, np.ndarray] = {}
    for tag, t in enumerate(plan.transfers):
        if t.dst_rank != rank:
            continue
        if t.kind == "shard":
            full = shards.setdefault(t.src_rank, np.zeros(plan.shard_nbytes[t.src_rank], np.uint8))
            full[t.offset : t.offset + t.nbytes] = received[tag]
        else:
            region = decode.layout.region(t.region_id)
            part = regions.setdefault(t.region_id, np.zeros(region.nbytes, np.uint8))
            start = t.offset - region.offset
            part[start : start + t.nbytes] = received[tag]
    try:
        return decode.layout.rebuild(rank, shards, regions, recipe=decode.recipe)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise RestoreError(f"rank {rank}: cannot rebuild shard of v{plan.version}: {e}") from e


def _exchange_replicas(
    transport: Transport,
    topology: Topology,
    rank: int,
    plan: RecoveryPlan,
    shard: np.ndarray,
    write: Callable[[int, torch.Tensor], None],
) -> int:
    """Hand every DP replica's shard to the others, point to point on ``transport``, and
    ``write(position, bytes)`` each (own one included) at its place in the full flat state;
    returns the bytes written. Owned ranges are contiguous in dp order. Tags follow the
    plan's transfers, so they never meet a piece of the rebuild."""
    replicas = topology.replicas(rank)
    base = len(plan.transfers)
    mine = torch.from_numpy(shard)
    sends = [
        (transport.isend(mine, peer, base + replicas.index(rank)), peer)
        for peer in replicas
        if peer != rank
    ]
    pos = 0
    for i, r in enumerate(replicas):
        n = plan.shard_nbytes[r]
        if r == rank:
            piece = mine
        else:
            piece = torch.empty(n, dtype=torch.uint8)
            _wait(transport.irecv(piece, r, base + i), rank, f"shard of rank {r}", plan)
        write(pos, piece)
        pos += n
    for h, peer in sends:
        _wait(h, rank, f"shard to rank {peer}", plan)
    return pos


def _wait(handle: Handle, rank: int, what: str, plan: RecoveryPlan) -> None:
    try:
        handle.wait()
    except Exception as e:  # noqa: BLE001 - re-raised with the message named
        raise RestoreError(
            f"rank {rank}: DP exchange ({what}) of v{plan.version} failed: {e}"
        ) from e


def _load_from_shards(engine: CheckpointEngine, plan: RecoveryPlan, shard: np.ndarray) -> None:
    """Assemble the full flat state from the DP replicas' shards and load it."""
    replicas = engine.topology.replicas(engine.rank)
    total = sum(plan.shard_nbytes[r] for r in replicas)
    if total != engine.flat.nbytes:
        raise RestoreError(
            f"rank {engine.rank}: shards of v{plan.version} cover {total} bytes, "
            f"state has {engine.flat.nbytes}"
        )
    with torch.no_grad():  # straight into the live tensors
        _exchange_replicas(
            engine.transport, engine.topology, engine.rank, plan, shard, engine.flat.write_from
        )
    engine.apply_rng()


def _evict_page_cache(path: Path) -> None:
    """Drop a checkpoint's clean pages from the page cache (benchmarks: a cold read)."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _load_from_disk(engine: CheckpointEngine, plan: RecoveryPlan, directory: str) -> None:
    assert plan.version is not None
    if os.environ.get("BAFT_COLD_DISK_RESTORE") == "1":
        from baft.engine.persister import version_dir

        _evict_page_cache(version_dir(directory, plan.version))
    state = {
        persist_name(n): t for n, t in zip(engine.flat.names, engine.flat.tensors, strict=True)
    }
    group = getattr(engine.transport, "group", None)
    with torch.no_grad():
        load_version(directory, plan.version, state, process_group=group)
    engine.apply_rng()
