"""Per-rank snapshot store in shared memory that outlives a crashed trainer.

Layout: ``{root}/{job_id}/node{node}/rank{rank}/`` holding two version slots
(``slot{s}.data`` = the rank's shard, ``slot{s}.red`` = its redundancy area,
``slot{s}.json`` = the slot's manifest; these names are spelled only in this package), ``commit.json`` (newest globally committed
version) and ``progress`` (which version the rank is writing into which slot and how many
of its shard bytes are final: what a same-host peer reads before pulling them, see
:mod:`baft.store.peer`). Files are preallocated, pre-faulted and memory-mapped; the engine writes
through ``data_view`` / ``red_view`` (numpy, wrap with ``torch.from_numpy``).

Version protocol (crash-safe at every point, manifests replaced atomically):
``begin(v)`` picks the slot not holding the committed version and marks it ``writing``;
the engine fills it; ``complete(slot, manifest)`` records checksums; ``commit(v)``
moves the commit record. A SIGKILL anywhere leaves the last committed version intact.

Reading (restore, ``baft inspect``, fault injection) goes through the store too:
``read(slot, kind, offset, nbytes)`` returns a zero-copy view from the store's own read
cache (one private mapping per file, see ``read``), released by ``drop_read_cache`` or
``close``. Nothing outside this package opens a slot file.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from baft.store import progress
from baft.store.manifest import (
    FORMAT,
    Manifest,
    RankInventory,
    VersionInfo,
    dumps,
    mismatches,
)
from baft.store.paths import KINDS, PROGRESS_FILE, SLOT_FILE, rank_path, slot_file_name

DEFAULT_ROOT = Path("/dev/shm/baft")
"""Default store root: tmpfs, survives process crashes, not reboots."""
PAGE = mmap.PAGESIZE
MANIFEST_RESERVE_BYTES = 3 * 64 * 1024
"""Budget set aside for the two slot manifests, the commit record and the progress page."""
NUM_SLOTS = 2
"""Version slots of a store by default (double buffering: the newest committed version
is never the one being written). Differential checkpoints keep a ring of more (see
``allocate``): a version's rebuild needs the payloads of a whole rotation."""
MAX_SLOTS = 64
"""Most slots a store may have."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class MemoryBudgetError(ValueError):
    """The store would need more host memory than allowed or available."""


class StoreReadError(ValueError):
    """A read asked for bytes the store's file does not hold (absent or too short)."""


def _round_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


class SnapshotStore:
    """Two-slot shared-memory store of one rank's shard and redundancy."""

    def __init__(self, root: Path, job_id: str, node: int, rank: int, budget_bytes: int) -> None:
        if not _NAME.match(job_id):
            raise ValueError(f"job_id {job_id!r} must be a plain name ([A-Za-z0-9._-], no '/')")
        if node < 0 or rank < 0 or budget_bytes < 0:
            raise ValueError(
                f"node, rank and budget_bytes must be >= 0: {node}, {rank}, {budget_bytes}"
            )
        self.root = Path(root)
        self.job_id = job_id
        self.node = node
        self.rank = rank
        self.budget_bytes = budget_bytes
        self.path = rank_path(self.root, job_id, node, rank)
        self._maps: dict[tuple[int, str], mmap.mmap | None] = {}
        self._reads: dict[tuple[int, str], tuple[tuple[int, int], np.ndarray]] = {}
        """Read cache: (slot, kind) -> ((inode, size) mapped, private view); see ``read``."""
        self._views: dict[tuple[int, str], np.ndarray] = {}
        self._sizes: tuple[int, int] | None = None
        self._num_slots = 0
        self._progress: np.ndarray | None = None
        self._progress_map: mmap.mmap | None = None
        self._lock_fd = -1

    # ------------------------------------------------------------- allocation
    @staticmethod
    def required_bytes(data_nbytes: int, red_nbytes: int, num_slots: int = NUM_SLOTS) -> int:
        """Host memory ``allocate`` needs: the slots (page-rounded) plus manifests."""
        return num_slots * (
            _round_page(data_nbytes) + _round_page(red_nbytes)
        ) + MANIFEST_RESERVE_BYTES * max(1, num_slots // 2)

    @property
    def num_slots(self) -> int:
        """Slots of this store: as allocated, else as found on disk (at least two)."""
        if self._num_slots:
            return self._num_slots
        found = [
            int(m.group(1))
            for f in (self.path.iterdir() if self.path.is_dir() else ())
            if (m := SLOT_FILE.match(f.name))
        ]
        return max(NUM_SLOTS, max(found, default=-1) + 1)

    def allocate(
        self,
        data_nbytes: int,
        red_nbytes: int,
        num_slots: int = NUM_SLOTS,
        *,
        keep_version: int | None = None,
    ) -> int | None:
        """Create (or reuse, keeping contents) ``num_slots`` slots' files, pre-faulted and
        mapped; slot files beyond ``num_slots`` (an earlier, longer ring) are removed.

        ``keep_version``: a complete version in a slot below ``num_slots`` (the committed
        one, written under an earlier plan) stays restorable: slots are made at least as
        large as its files, which grow in place. Returns the version kept (None: none
        asked or none found); a slot of another size loses its version, as always."""
        if data_nbytes < 0 or red_nbytes < 0:
            raise ValueError(f"sizes must be >= 0, got data={data_nbytes} red={red_nbytes}")
        if not NUM_SLOTS <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in {NUM_SLOTS}..{MAX_SLOTS}, got {num_slots}")
        kept = self._slot_of(keep_version, num_slots) if keep_version is not None else None
        if kept is not None:
            data_nbytes = max(data_nbytes, self._file(kept, "data").stat().st_size)
            red_nbytes = max(red_nbytes, self._file(kept, "red").stat().st_size)
        needed = self.required_bytes(data_nbytes, red_nbytes, num_slots)
        if needed > self.budget_bytes:
            raise MemoryBudgetError(
                f"rank {self.rank} store needs {needed:,} B ({num_slots} slots x (shard {data_nbytes:,} B + "
                f"redundancy {red_nbytes:,} B) + manifests) but budget_bytes is "
                f"{self.budget_bytes:,} B; raise the host-memory budget, pick a lighter "
                "redundancy policy, or add DP replicas so shards shrink"
            )
        self._make_dirs()
        sizes = {"data": data_nbytes, "red": red_nbytes}
        reusable = sum(
            _round_page(n)
            for slot in range(num_slots)
            for kind, n in sizes.items()
            if self._file(slot, kind).exists() and self._file(slot, kind).stat().st_size == n
        )
        stat = os.statvfs(self.path)
        free = stat.f_bavail * stat.f_frsize
        if needed - MANIFEST_RESERVE_BYTES - reusable > free:
            raise MemoryBudgetError(
                f"rank {self.rank} store needs {needed - reusable:,} B more but only {free:,} B "
                f"are free under {self.root}; free memory there (old jobs: "
                "SnapshotStore.cleanup_stale) or lower the snapshot size"
            )
        self.close()  # also drops read mappings: files may be truncated below
        for slot in range(num_slots, self.num_slots):
            for kind in (*KINDS, "json"):
                self._file(slot, kind).unlink(missing_ok=True)
        for slot in range(num_slots):
            for kind, n in sizes.items():
                self._map_rw(slot, kind, n, grow=slot == kept)
        self._sizes = (data_nbytes, red_nbytes)
        self._num_slots = num_slots
        self._map_progress()
        return keep_version if kept is not None else None

    def _slot_of(self, version: int, num_slots: int) -> int | None:
        """The slot below ``num_slots`` whose complete manifest is ``version``, if its
        files are there."""
        for slot in range(min(num_slots, self.num_slots)):
            rec = _try(self._read_slot, slot)
            if (
                rec
                and rec.get("state") == "complete"
                and rec.get("version") == version
                and all(self._file(slot, kind).exists() for kind in KINDS)
            ):
                return slot
        return None

    def _map_progress(self) -> None:
        fd = os.open(self.path / PROGRESS_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != PAGE:
                os.ftruncate(fd, PAGE)
            progress_map = mmap.mmap(fd, PAGE)
            # A shared lock held while this process has the store allocated: the kernel
            # drops it when the process dies, so ``reclaim_other_jobs`` can tell a live
            # job's store from an abandoned one without a registry.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            self._lock_fd, fd = fd, -1
        except BlockingIOError:
            pass  # someone is reclaiming it right now; the store works without the lock
        finally:
            if fd >= 0:
                os.close(fd)
        self._progress_map = progress_map
        self._progress = progress.fields(progress_map)
        progress.clear(self._progress)

    def publish(self, version: int, slot: int, covered: int) -> None:
        """Tell same-host readers that the first ``covered`` shard bytes of ``version`` in
        ``slot`` are final (the page's layout and protocol: :mod:`baft.store.progress`)."""
        if self._progress is None:
            raise RuntimeError(f"rank {self.rank} store: call allocate() first")
        progress.publish(self._progress, version, slot, covered)

    def _make_dirs(self) -> None:
        for p in (self.root, self.root / self.job_id, self.path.parent, self.path):
            p.mkdir(mode=0o700, exist_ok=True)
        for p in (self.root / self.job_id, self.path.parent, self.path):
            os.chmod(p, 0o700)

    def _file(self, slot: int, kind: str) -> Path:
        return self.path / slot_file_name(slot, kind)

    def _manifest_file(self, slot: int) -> Path:
        return self.path / slot_file_name(slot, "json")

    def _map_rw(self, slot: int, kind: str, nbytes: int, *, grow: bool = False) -> None:
        path = self._file(slot, kind)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = os.fstat(fd).st_size
            if grow and size < nbytes:  # a kept version: its bytes stay, the file grows
                os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, size, nbytes - size)
            elif size != nbytes:
                if size:  # different shape: old contents are meaningless now
                    self._manifest_file(slot).unlink(missing_ok=True)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, nbytes)
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes) if nbytes else None
        finally:
            os.close(fd)
        view = np.frombuffer(mm, np.uint8) if mm is not None else np.zeros(0, np.uint8)
        touch = view[::PAGE]
        np.bitwise_or(touch, 0, out=touch)  # pre-fault every page, keep contents
        self._maps[(slot, kind)] = mm
        self._views[(slot, kind)] = view

    def data_view(self, slot: int) -> np.ndarray:
        """Writable uint8 view of the slot's shard file (zero copy)."""
        return self._view(slot, "data")

    def red_view(self, slot: int) -> np.ndarray:
        """Writable uint8 view of the slot's redundancy file (zero copy)."""
        return self._view(slot, "red")

    def _view(self, slot: int, kind: str) -> np.ndarray:
        if slot not in range(self.num_slots):
            raise ValueError(f"slot must be in 0..{self.num_slots - 1}, got {slot}")
        if (slot, kind) not in self._views:
            raise RuntimeError(
                f"rank {self.rank} store: call allocate(data_nbytes, red_nbytes) first"
            )
        return self._views[(slot, kind)]

    def host_bytes(self) -> int:
        """Bytes of host memory the store's files occupy now (allocated blocks)."""
        if not self.path.is_dir():
            return 0
        return sum(p.stat().st_blocks * 512 for p in self.path.iterdir() if p.is_file())

    # ------------------------------------------------------------------ reading
    def read(self, slot: int, kind: str, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of the slot's ``data`` or ``red`` file
        (``nbytes=None``: to the end), zero copy; ``StoreReadError`` if the file is absent
        or shorter.

        Every file is mapped once into the store's read cache and later reads of it
        (verifying, then sending or loading the same bytes) reuse that mapping, so its pages
        are faulted in once. The mapping is private (copy-on-write) and writable: callers
        may wrap the view with ``torch.from_numpy`` (which wants a writable array) and even
        scribble on it without touching the store. No ``MAP_POPULATE``: on a private
        writable mapping it copies every page, measured 4x slower than faulting on demand.
        A file that was re-created or resized since it was mapped is mapped again. Views
        stay valid until ``drop_read_cache`` / ``close`` / ``allocate``.
        """
        if slot not in range(MAX_SLOTS) or kind not in KINDS:
            raise ValueError(f"slot must be 0 or 1 and kind data or red, got {slot}, {kind!r}")
        if offset < 0 or (nbytes is not None and nbytes < 0):
            raise ValueError(f"offset and nbytes must be >= 0, got {offset}, {nbytes}")
        view = self._read_map(slot, kind)
        size = -1 if view is None else view.size
        stop = size if nbytes is None else offset + nbytes
        if view is None or stop > size or offset > size:
            raise StoreReadError(
                f"rank {self.rank} store: slot {slot} {kind} file has {size} B, "
                f"read needs [{offset}, {stop})" + (" (file absent)" if view is None else "")
            )
        return view[offset:stop]

    def _read_map(self, slot: int, kind: str) -> np.ndarray | None:
        path = self._file(slot, kind)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._reads.pop((slot, kind), None)
            return None
        key = (st.st_ino, st.st_size)
        cached = self._reads.get((slot, kind))
        if cached is not None and cached[0] == key:
            return cached[1]
        if st.st_size == 0:
            view = np.zeros(0, np.uint8)
        else:
            with open(path, "rb") as f:
                mm = mmap.mmap(
                    f.fileno(),
                    st.st_size,
                    flags=mmap.MAP_PRIVATE,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                )
            view = np.frombuffer(mm, np.uint8)
        self._reads[(slot, kind)] = (key, view)
        return view

    def drop_read_cache(self) -> None:
        """Release the read mappings (views handed out keep theirs alive until dropped)."""
        self._reads.clear()

    def flip_byte(self, slot: int, kind: str, offset: int) -> bool:
        """Fault injection: XOR the byte at ``offset`` of the slot's file with 0xFF in the
        file itself (every mapping sees it) and fsync; False if the file is absent or
        shorter."""
        if kind not in KINDS:
            raise ValueError(f"kind must be data or red, got {kind!r}")
        try:
            fd = os.open(self._file(slot, kind), os.O_RDWR)
        except OSError:
            return False
        try:
            old = os.pread(fd, 1, offset)
            if len(old) != 1:
                return False
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), offset)
            os.fsync(fd)
            return True
        finally:
            os.close(fd)

    def close(self) -> None:
        """Drop this process's mappings, read cache included (files and contents stay)."""
        self.drop_read_cache()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the liveness lock
            self._lock_fd = -1
        self._views.clear()
        self._progress = None
        if self._progress_map is not None:
            try:
                self._progress_map.close()
            except BufferError:
                pass
            self._progress_map = None
        for mm in self._maps.values():
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a caller still holds a view; GC closes it later
                    pass
        self._maps.clear()
        self._sizes = None
        self._num_slots = 0

    # ---------------------------------------------------------- version protocol
    def begin(self, version: int, keep: Collection[int] = ()) -> int:
        """Slot to write ``version`` into, marked ``writing``: never the committed one nor
        one holding a complete version in ``keep`` (a differential rotation's window; when
        not both can be kept, ``keep`` wins over a stale commit record); the oldest
        otherwise."""
        records = [_try(self._read_slot, s) for s in range(self.num_slots)]
        committed = _try(self.committed_version)
        protected = {committed, *keep}
        candidates = [
            s
            for s, rec in enumerate(records)
            if not (rec and rec.get("state") == "complete" and rec.get("version") in protected)
        ]
        if not candidates and keep:  # the caller's window wins over a stale commit record
            candidates = [
                s
                for s, rec in enumerate(records)
                if not (rec and rec.get("state") == "complete" and rec.get("version") in keep)
            ]
        if not candidates:
            raise AssertionError(
                f"rank {self.rank}: every one of its {len(records)} slots holds a version "
                f"to keep ({[_version_of(r) for r in records]}; keep {sorted(protected, key=str)})"
            )
        # an older copy of this very version (written before a restart) is the first to go
        slot = min(
            candidates,
            key=lambda s: (
                _version_of(records[s]) != version,
                records[s] is not None,
                _version_of(records[s]),
                s,
            ),
        )
        for other, rec in enumerate(records):  # never two copies of one version
            if other != slot and rec and rec.get("version") == version:
                self._manifest_file(other).unlink(missing_ok=True)
        self._write_json(
            self._manifest_file(slot),
            {"format": FORMAT, "state": "writing", "version": version, "rank": self.rank},
        )
        return slot

    def complete(self, slot: int, manifest: Manifest) -> None:
        """Record ``manifest`` (state complete) for the slot begun with its version."""
        manifest.check()
        rec = self._read_slot(slot)
        if not rec or rec.get("state") != "writing" or rec.get("version") != manifest.version:
            raise ValueError(
                f"rank {self.rank} slot {slot} is not being written for v{manifest.version}; "
                "call begin(version) first and complete the slot it returned"
            )
        if manifest.rank != self.rank or manifest.state != "complete":
            raise ValueError(f"manifest is for rank {manifest.rank} state {manifest.state}")
        if self._sizes and (
            manifest.data_nbytes > self._sizes[0] or manifest.red_nbytes > self._sizes[1]
        ):
            raise ValueError(f"manifest sizes exceed the allocation {self._sizes}")
        self._write_text(self._manifest_file(slot), dumps(manifest))

    def commit(self, version: int) -> None:
        """Record ``version`` as the newest globally committed version."""
        for slot in range(self.num_slots):
            rec = self._read_slot(slot)
            if rec and rec.get("state") == "complete" and rec.get("version") == version:
                self._write_json(
                    self.path / "commit.json", {"format": FORMAT, "version": version, "slot": slot}
                )
                return
        raise ValueError(
            f"rank {self.rank}: no complete v{version} in the store; complete() it first"
        )

    def committed_version(self) -> int | None:
        """Version in the commit record, or None."""
        rec = _load_json(self.path / "commit.json")
        return rec.get("version") if rec else None

    def clear_versions(self, keep: int | None = None) -> None:
        """Forget every version and the commit record (after restoring from disk or fresh);
        ``keep``: except that version (and the commit record, if it names it)."""
        for slot in range(self.num_slots):
            if keep is None or _version_of(_try(self._read_slot, slot)) != keep:
                self._manifest_file(slot).unlink(missing_ok=True)
        if keep is None or _try(self.committed_version) != keep:
            (self.path / "commit.json").unlink(missing_ok=True)

    def read_manifest(self, slot: int) -> Manifest | None:
        """The slot's complete manifest, or None (empty, writing or unreadable)."""
        rec = self._read_slot(slot)
        if not rec or rec.get("state") != "complete":
            return None
        return Manifest.from_dict(rec)

    def _read_slot(self, slot: int) -> dict[str, Any] | None:
        return _load_json(self._manifest_file(slot))

    def _write_json(self, path: Path, obj: dict[str, Any]) -> None:
        self._write_text(path, json.dumps(obj, separators=(",", ":")))

    def _write_text(self, path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    # ------------------------------------------------------------ verification
    def verify(self, slot: int) -> list[str]:
        """Recompute the slot's checksums; returns problems (empty = clean)."""
        return list(self._check(slot)[0])

    def _check(self, slot: int) -> tuple[list[str], bool, tuple[int, ...]]:
        where = f"rank {self.rank} slot {slot}"
        try:
            rec = self._read_slot(slot)
        except ValueError as err:
            return [f"{where}: unreadable manifest ({err})"], False, ()
        if rec is None:
            return [f"{where}: no manifest"], False, ()
        if rec.get("state") != "complete":
            return [f"{where}: v{rec.get('version')} is {rec.get('state')} (incomplete)"], False, ()
        m = Manifest.from_dict(rec)
        where = f"{where} v{m.version}"
        problems: list[str] = []
        data = self._read_view(slot, "data", m.data_nbytes, problems, where)
        red_problems: list[str] = []
        red = self._read_view(slot, "red", m.red_nbytes, red_problems, where)
        found = mismatches(m, data, red)
        problems += [
            f"{where}: data chunk {c.chunk_id} [{c.offset}, +{c.nbytes}) checksum "
            f"{got:016x} != {c.xxh3:016x}"
            for c, got in found.chunks
        ]
        problems += red_problems
        problems += [
            f"{where}: redundancy region {r.region_id} checksum mismatch" for r in found.regions
        ]
        bad = m.regions if red is None else found.regions
        return problems, data is not None and not found.chunks, tuple(r.region_id for r in bad)

    def _read_view(
        self, slot: int, kind: str, nbytes: int, problems: list[str], where: str
    ) -> np.ndarray | None:
        view: np.ndarray | None = self._views.get((slot, kind))
        if view is None:
            view = self._read_map(slot, kind)
        if view is None or view.size < nbytes:
            size = -1 if view is None else view.size
            problems.append(f"{where}: {kind} file has {size} B, manifest needs {nbytes} B")
            return None
        return view[:nbytes]

    def inventory(self, verify: bool = True) -> RankInventory:
        """What this store holds; with ``verify`` every checksum is recomputed."""
        versions = []
        problems = []
        for slot in range(self.num_slots):
            try:
                rec = self._read_slot(slot)
            except ValueError as err:
                problems.append(f"rank {self.rank} slot {slot}: unreadable manifest ({err})")
                continue
            if rec is None:
                continue
            complete = rec.get("state") == "complete"
            found, data_ok, bad = self._check(slot) if verify and complete else ([], complete, ())
            versions.append(
                VersionInfo(
                    version=int(rec["version"]),
                    slot=slot,
                    state=str(rec.get("state")),
                    verified=verify and complete,
                    data_ok=data_ok,
                    bad_regions=bad,
                    problems=tuple(found),
                    manifest=Manifest.from_dict(rec) if complete else None,
                )
            )
        versions.sort(key=lambda v: -v.version)
        return RankInventory(
            self.rank, self.node, self.committed_version(), tuple(versions), tuple(problems)
        )

    # --------------------------------------------------------------- lifecycle
    def destroy(self) -> None:
        """Remove this rank's store directory (simulates losing the node)."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def reclaim_unless_holding(self, version: int | None) -> bool:
        """Free this store unless it holds a complete ``version``; if it does, forget every
        newer version (slot manifests dropped, the commit record names ``version``), so no
        version of the abandoned timeline can mix into a later restore; older ones stay (a
        differential rotation may need them to rebuild ``version``). Returns whether the
        store was removed."""
        keep = self._slot_of(version, self.num_slots) if version is not None else None
        if keep is None:
            self.destroy()
            return True
        for slot in range(self.num_slots):
            rec = _try(self._read_slot, slot)
            if slot != keep and (rec is None or _version_of(rec) > version):  # type: ignore[operator]
                self._manifest_file(slot).unlink(missing_ok=True)
        self.commit(version)  # type: ignore[arg-type]
        return False

    @staticmethod
    def cleanup_stale(root: Path, keep_job_id: str) -> list[Path]:
        """Remove other jobs' store directories under ``root``; returns what was removed.

        Only directories that look like job stores (children all ``node<N>``) are removed.
        """
        removed: list[Path] = []
        root = Path(root)
        if not root.is_dir():
            return removed
        for job in sorted(root.iterdir()):
            if job.name == keep_job_id or not job.is_dir() or job.is_symlink():
                continue
            children = list(job.iterdir())
            if all(c.is_dir() and re.fullmatch(r"node\d+", c.name) for c in children):
                shutil.rmtree(job)
                removed.append(job)
        return removed


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ValueError:
        return None


def _version_of(rec: dict[str, Any] | None) -> int:
    return int(rec["version"]) if rec and "version" in rec else -1


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{path}: not a baft record of format {FORMAT}")
    return obj
