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
import mmap
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from baft.config import TrainConfig
from baft.engine.engine import CheckpointEngine
from baft.engine.persister import list_versions, load_version, persist_name
from baft.engine.watchdog import read_hangs
from baft.pipeline.mesh import Mesh
from baft.pipeline.step import StepRunner
from baft.recover.coordinator import RecoveryPlan, coordinate
from baft.store.manifest import RankInventory


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
            print(
                f"[baft] recovered v{r['restored_version']} from {r['source']} "
                f"(lost {r['lost_iterations']} iteration(s)): {secs}",
                flush=True,
            )


def _completed_iterations(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    progress = run_dir / "progress.json"  # written by baft.api users' loops
    if not path.exists() and progress.exists():
        try:
            return int(json.loads(progress.read_text())["iteration"]) + 1
        except (json.JSONDecodeError, KeyError, ValueError):
            return 0
    if not path.exists():
        return 0
    done = -1
    for line in path.read_text().splitlines():
        try:
            done = max(done, int(json.loads(line)["iteration"]))
        except (json.JSONDecodeError, KeyError):
            continue
    return done + 1


def _make_injector(cfg: TrainConfig, mesh: Mesh) -> Any:
    ck = cfg.checkpoint
    assert ck is not None
    if not ck.inject:
        return None
    from baft.faults.injector import FaultInjector
    from baft.faults.spec import FaultSpec

    injector = FaultInjector(
        [FaultSpec.parse(s) for s in ck.inject],
        run_dir=Path(cfg.out_dir),
        rank=mesh.rank,
        topology=mesh.topology,
        store_root=Path(ck.store_root),
        job_id=ck.job_id,
    )
    injector.load()
    return injector


def recover_and_start(
    cfg: TrainConfig, mesh: Mesh, trainer: StepRunner, *, t_launch: float, t_rdzv: float
) -> tuple[CheckpointEngine, int]:
    """Build the engine, restore the newest recoverable version, return (engine, resume)."""
    ck = cfg.checkpoint
    assert ck is not None
    run_dir = Path(cfg.out_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    injector = _make_injector(cfg, mesh)
    engine = CheckpointEngine(cfg, mesh, trainer, injector=injector)
    t0 = time.time()
    persist_dir = ck.persist_dir
    persisted = (
        tuple(list_versions(persist_dir)) if persist_dir and Path(persist_dir).exists() else ()
    )
    plan, reason, invs = _agree(engine, mesh, persisted)
    t_inventory = time.time() - t0
    engine.recovery = None
    if (
        plan.source == "fresh"
        and attempt == 0
        and all(i is None or not i.versions for i in invs.values())
    ):
        engine.start(0)
        return engine, 0
    report = RecoveryReport(run_dir, attempt)
    if injector is not None:
        injector.fire("recovery", plan.version or 0)
    t1 = time.time()
    if plan.source == "memory":
        shard = _rebuild_shard(engine, plan, invs)
        t_transfer = time.time() - t1
        t2 = time.time()
        _load_from_shards(engine, plan, invs, shard)
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
    if mesh.rank == 0:
        print(f"[baft] recovery: {reason}", flush=True)
    _MAPS.clear()
    engine.recovery = report
    if plan.source == "memory":
        engine.skip_version = plan.version
        engine.committed = plan.version
    engine.start(resume)
    report.first_iteration_started()
    return engine, resume


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
    engine: CheckpointEngine, mesh: Mesh, persisted: tuple[int, ...]
) -> tuple[RecoveryPlan, str, dict[int, RankInventory | None]]:
    """Agree on a RecoveryPlan, checksumming only the bytes the plan will read.

    Round 1 trusts every complete manifest, plans, and each rank verifies just what the
    plan reads from its store (its shard if local, the ranges and regions it sends).
    If all of that is clean the plan stands; otherwise round 2 verifies everything and
    plans again. A rank crash thus checks one shard per rank instead of both slots of
    data and redundancy (4x fewer bytes), and a bad byte still never gets through.
    """
    store = engine.store
    exists = store.path.exists()
    light = store.inventory(verify=False) if exists else None
    claimed = dict(enumerate(engine.transport.all_gather_object(_claim(light))))
    plan, reason = coordinate(mesh.topology, engine.redundancy, claimed, persisted)
    problems = _verify_reads(engine, plan) if plan.source == "memory" else []
    if not any(engine.transport.all_gather_object(problems)):
        return plan, reason, claimed
    full = store.inventory(verify=True) if exists else None
    invs = dict(enumerate(engine.transport.all_gather_object(full)))
    plan, reason = coordinate(mesh.topology, engine.redundancy, invs, persisted)
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


def _verify_reads(engine: CheckpointEngine, plan: RecoveryPlan) -> list[str]:
    """Checksum the store bytes this rank contributes to ``plan``; returns the problems."""
    from baft.store.manifest import checksum

    rank, path = engine.rank, engine.store.path
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
        m = engine.store.read_manifest(slot)
        if m is None or m.version != plan.version:
            problems.append(f"rank {rank} slot {slot}: v{plan.version} is not there")
            continue
        if slot in data_slots:
            data = _read_file(path / f"slot{slot}.data", 0, m.data_nbytes)
            problems += [
                f"rank {rank} v{m.version} chunk {c.chunk_id}: checksum mismatch"
                for c in m.chunks
                if checksum(data[c.offset : c.offset + c.nbytes]) != c.xxh3
            ]
        wanted = region_ids.get(slot, set())
        if wanted:
            red = _read_file(path / f"slot{slot}.red", 0, m.red_nbytes)
            problems += [
                f"rank {rank} v{m.version} region {r.region_id}: checksum mismatch"
                for r in m.regions
                if r.region_id in wanted and checksum(red[r.offset : r.offset + r.nbytes]) != r.xxh3
            ]
    return problems


_MAPS: dict[Path, np.ndarray] = {}
"""Store files mapped during one restore: verification and loading share one mapping."""


def _read_file(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """Bytes of a store file from a private (copy-on-write) mapping: no copy.

    The mapping is reused by every later read of the same file in this restore, so
    verifying and loading fault the pages in once. (``MAP_POPULATE`` on a private
    writable mapping copies every page: 4x slower here, so it is not used.)
    """
    if path not in _MAPS:
        size = path.stat().st_size if path.exists() else 0
        if size == 0:
            _MAPS[path] = np.zeros(0, np.uint8)
        else:
            flags = mmap.MAP_PRIVATE
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _MAPS[path] = np.frombuffer(mm, dtype=np.uint8)
    data = _MAPS[path]
    if data.size < offset + nbytes:
        raise RestoreError(f"{path}: expected {nbytes} bytes at {offset}, file has {data.size}")
    return data[offset : offset + nbytes]


def _rebuild_shard(
    engine: CheckpointEngine, plan: RecoveryPlan, invs: dict[int, RankInventory | None]
) -> np.ndarray:
    """This rank's shard of ``plan.version``: local read, or peer pieces + decode."""
    rank = engine.rank
    path = engine.store.path
    handles = []
    received: dict[int, np.ndarray] = {}
    for tag, t in enumerate(plan.transfers):
        if t.src_rank == rank:
            kind = "data" if t.kind == "shard" else "red"
            buf = torch.from_numpy(
                _read_file(path / f"slot{t.src_slot}.{kind}", t.offset, t.nbytes)
            )
            handles.append((engine.transport.isend(buf, t.dst_rank, tag), buf))
        if t.dst_rank == rank:
            buf = torch.empty(t.nbytes, dtype=torch.uint8)
            handles.append((engine.transport.irecv(buf, t.src_rank, tag), buf))
            received[tag] = buf.numpy()
    for h, _ in handles:
        h.wait()
    source = plan.shards[rank]
    n = plan.shard_nbytes[rank]
    if source.kind == "local":
        assert source.slot is not None
        return _read_file(path / f"slot{source.slot}.data", 0, n)
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
            rbuf = regions.setdefault(t.region_id, np.zeros(region.nbytes, np.uint8))
            start = t.offset - region.offset
            rbuf[start : start + t.nbytes] = received[tag]
    try:
        return decode.layout.rebuild(rank, shards, regions, recipe=decode.recipe)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise RestoreError(f"rank {rank}: cannot rebuild shard of v{plan.version}: {e}") from e


def _load_from_shards(
    engine: CheckpointEngine,
    plan: RecoveryPlan,
    invs: dict[int, RankInventory | None],
    shard: np.ndarray,
) -> None:
    """Assemble the full flat state from the DP replicas' shards and load it."""
    replicas = engine.topology.replicas(engine.rank)
    total = sum(plan.shard_nbytes[r] for r in replicas)
    if total != engine.flat.nbytes:
        raise RestoreError(
            f"rank {engine.rank}: shards of v{plan.version} cover {total} bytes, "
            f"state has {engine.flat.nbytes}"
        )
    pos = 0
    with torch.no_grad():
        for r in replicas:  # owned ranges are contiguous in dp order
            n = plan.shard_nbytes[r]
            piece = (
                torch.from_numpy(shard) if r == engine.rank else torch.empty(n, dtype=torch.uint8)
            )
            if len(replicas) > 1:
                dist.broadcast(piece, r, group=engine.mesh.dp_group)
            engine.flat.write_from(pos, piece)  # straight into the live tensors
            pos += n
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
