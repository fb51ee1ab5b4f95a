"""Runtime failure injection: fire parsed :class:`FaultSpec` faults inside a training rank.

The engine calls :meth:`FaultInjector.fire` at each point of an iteration (``POINTS``) and
sleeps :meth:`FaultInjector.slot_delay` seconds at every pipeline slot. A fault that fires
is first appended to ``{run_dir}/faults.jsonl`` (one ``os.write`` on an ``O_APPEND`` fd,
then fsync, so concurrent ranks never interleave), logged (``baft`` logger), then carried out:
SIGKILL, deleting store directories, flipping a byte of a committed slot, hanging,
freezing (SIGSTOP: the whole process, its heartbeat thread too).

Each fault fires once per job: :meth:`FaultInjector.load` reads the faults that fired in
earlier attempts (before torchrun restarted the worker group), and those never fire again.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from baft.faults.spec import (
    POINTS,
    SLOT_POINT,
    FaultRecord,
    FaultSpec,
    parse_records,
)
from baft.store import reclaim
from baft.store.shm import SnapshotStore
from baft.topology import Topology

log = logging.getLogger("baft")

RECORDS_FILE = "faults.jsonl"
"""File under the run directory listing every fault that fired in this job."""


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sigstop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def records_path(run_dir: Path) -> Path:
    return Path(run_dir) / RECORDS_FILE


def read_records(run_dir: Path) -> tuple[FaultRecord, ...]:
    """Every fault that fired in the job whose run directory is ``run_dir`` (oldest first)."""
    try:
        text = records_path(run_dir).read_text()
    except FileNotFoundError:
        return ()
    return parse_records(text)


def clear_records(run_dir: Path) -> None:
    """Forget fired faults: call when a fresh job (not a torchrun restart) starts."""
    records_path(run_dir).unlink(missing_ok=True)


def append_record(run_dir: Path, record: FaultRecord) -> None:
    """Append one line atomically (single write on an O_APPEND fd) and fsync it."""
    path = records_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = record.to_json().encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        assert written == len(data), f"short write to {path}: {written} of {len(data)} B"
        os.fsync(fd)
    finally:
        os.close(fd)


class FaultInjector:
    """Fires the faults of ``specs`` that target this rank; does nothing else."""

    def __init__(
        self,
        specs: Sequence[FaultSpec],
        *,
        run_dir: Path,
        rank: int,
        topology: Topology,
        store_root: Path,
        job_id: str,
        clock: Callable[[], float] = time.time,
        kill_self: Callable[[], None] = _sigkill_self,
        stop_self: Callable[[], None] = _sigstop_self,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        unique: dict[str, FaultSpec] = {}
        for spec in specs:
            spec.check(topology)
            unique.setdefault(spec.spec_id, spec)
        topology.node_of(rank)  # ValueError for a rank outside the topology
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.topology = topology
        self.store_root = Path(store_root)
        self.job_id = job_id
        self.clock = clock
        self.kill_self = kill_self
        self.stop_self = stop_self
        self.sleep = sleep
        mine = [s for s in unique.values() if s.targets(rank, topology)]
        # Faults that keep the process alive act before those that end it.
        self._mine = tuple(sorted(mine, key=lambda s: s.terminal))
        self._by_point = {p: tuple(s for s in self._mine if s.point == p) for p in POINTS}
        self._slow = tuple(s for s in self._mine if s.kind == "slow")
        self._loaded = False
        self._earlier: set[str] = set()
        self._fired: set[str] = set()

    # ----------------------------------------------------------------- state
    def load(self) -> tuple[FaultRecord, ...]:
        """Read ``faults.jsonl``: faults fired in earlier attempts never fire again."""
        records = read_records(self.run_dir)
        self._earlier = {r.spec for r in records}
        self._loaded = True
        return records

    def fired_records(self) -> tuple[FaultRecord, ...]:
        """Every fault fired in this job so far, by any rank (re-reads the file)."""
        return read_records(self.run_dir)

    def pending(self) -> tuple[FaultSpec, ...]:
        """Faults of this rank that may still fire."""
        self._ensure_loaded()
        return tuple(s for s in self._mine if not self._done(s))

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self.load()

    def _done(self, spec: FaultSpec) -> bool:
        return spec.spec_id in self._fired or spec.spec_id in self._earlier

    # ----------------------------------------------------------------- firing
    def fire(self, point: str, iteration: int) -> None:
        """Fire every due fault of this rank at ``point`` of ``iteration`` (may not return)."""
        if point not in POINTS:
            raise ValueError(f"point {point!r} is not one of {', '.join(POINTS)}")
        if not self._mine:
            return
        self._ensure_loaded()  # first call of the attempt, before any peer can fire
        candidates = self._by_point[point]
        for spec in candidates:
            if spec.matches(point, iteration) and not self._done(spec):
                self._announce(spec, point, iteration)
                self._act(spec)

    def slot_delay(self, iteration: int) -> float:
        """Seconds this rank should sleep at a slot of ``iteration`` (``slow`` faults)."""
        if not self._slow:
            return 0.0
        self._ensure_loaded()
        total = 0.0
        for spec in self._slow:
            if not spec.slows(iteration) or spec.spec_id in self._earlier:
                continue
            if spec.spec_id not in self._fired:
                self._announce(spec, SLOT_POINT, iteration)
            total += spec.seconds
        return total

    def _announce(self, spec: FaultSpec, point: str, iteration: int) -> None:
        self._fired.add(spec.spec_id)
        record = FaultRecord(
            spec=spec.spec_id, rank=self.rank, time=self.clock(), iteration=iteration, point=point
        )
        append_record(self.run_dir, record)
        log.info("injecting %s at %s (rank %d, iteration %d)", spec, point, self.rank, iteration)

    def _store(self) -> SnapshotStore:
        return SnapshotStore(
            self.store_root, self.job_id, self.topology.node_of(self.rank), self.rank, 0
        )

    def _act(self, spec: FaultSpec) -> None:
        node = self.topology.node_of(self.rank)
        if spec.kind == "kill":
            self.kill_self()
        elif spec.kind == "node":
            reclaim.remove_node(self.store_root, self.job_id, node)
            self.kill_self()
        elif spec.kind == "power":
            reclaim.remove_job(self.store_root, self.job_id)
            self.kill_self()
        elif spec.kind == "delete":
            self._store().destroy()
        elif spec.kind == "corrupt":
            self._corrupt(spec)
        elif spec.kind == "hang":
            while True:
                self.sleep(3600.0)
        elif spec.kind == "freeze":  # what a hung host looks like: no thread runs on
            self.stop_self()
        else:  # pragma: no cover - slow faults act through slot_delay
            raise AssertionError(f"cannot fire {spec.kind} at a point")

    def _corrupt(self, spec: FaultSpec) -> None:
        done = corrupt_committed(self._store(), spec.target)
        if done is None:
            log.info(
                "%s: rank %d holds no committed %s bytes; nothing was changed",
                spec,
                self.rank,
                spec.target,
            )


def corrupt_committed(store: SnapshotStore, target: str) -> tuple[int, str, int] | None:
    """Flip (XOR 0xFF) one byte in the middle of the newest committed slot's ``target``
    (``data`` or ``redundancy``), inside a checksummed range; returns (slot, ``data`` or
    ``red``, offset), or None when the store has no committed version or nothing to damage."""
    try:
        committed = store.committed_version()
    except (ValueError, OSError):
        return None
    for slot in range(store.num_slots):
        try:
            manifest = store.read_manifest(slot)
        except (ValueError, OSError):
            continue
        if manifest is None or manifest.version != committed:
            continue
        if target == "data":
            kind, start, nbytes = "data", 0, manifest.data_nbytes
        else:
            regions = [r for r in manifest.regions if r.nbytes > 0]
            if not regions:
                return None
            big = max(regions, key=lambda r: r.nbytes)
            kind, start, nbytes = "red", big.offset, big.nbytes
        if nbytes <= 0:
            return None
        offset = start + nbytes // 2
        return (slot, kind, offset) if store.flip_byte(slot, kind, offset) else None
    return None
