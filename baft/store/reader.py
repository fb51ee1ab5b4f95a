"""The read side of one rank's store: range reads, checksum verification, the inventory
of what the store holds, and fault injection into its files.

:class:`StoreReader` owns the store's read cache: one private mapping per slot file,
reused while the file stays the same (see :meth:`StoreReader.read`). Restore,
``baft inspect`` and the fault injector all read through it; nothing outside this
package opens a slot file. Which slot holds which version it asks the version log
(:mod:`baft.store.versions`); the checks of bytes against a manifest are
:func:`baft.store.manifest.mismatches`.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from baft.store.manifest import Manifest, RankInventory, VersionInfo, mismatches
from baft.store.paths import KINDS
from baft.store.slots import MAX_SLOTS, SlotFiles
from baft.store.versions import VersionLog


class StoreReadError(ValueError):
    """A read asked for bytes the store's file does not hold (absent or too short)."""


class StoreReader:
    """Reads and verifies the store of ``files`` (node ``node``) by its ``log``."""

    def __init__(self, files: SlotFiles, log: VersionLog, node: int) -> None:
        self.files = files
        self.log = log
        self.rank = files.rank
        self.node = node
        self._reads: dict[tuple[int, str], tuple[tuple[int, int], np.ndarray]] = {}
        """Read cache: (slot, kind) -> ((inode, size) mapped, private view); see ``read``."""

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
        stay valid until ``drop_cache`` / ``SnapshotStore.close`` / ``allocate``.
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
        path = self.files.file(slot, kind)
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

    def drop_cache(self) -> None:
        """Release the read mappings (views handed out keep theirs alive until dropped)."""
        self._reads.clear()

    def flip_byte(self, slot: int, kind: str, offset: int) -> bool:
        """Fault injection: XOR the byte at ``offset`` of the slot's file with 0xFF in the
        file itself (every mapping sees it) and fsync; False if the file is absent or
        shorter."""
        if kind not in KINDS:
            raise ValueError(f"kind must be data or red, got {kind!r}")
        try:
            fd = os.open(self.files.file(slot, kind), os.O_RDWR)
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

    # ------------------------------------------------------------ verification
    def verify(self, slot: int) -> list[str]:
        """Recompute the slot's checksums; returns problems (empty = clean)."""
        return list(self._check(slot)[0])

    def _check(self, slot: int) -> tuple[list[str], bool, tuple[int, ...]]:
        where = f"rank {self.rank} slot {slot}"
        try:
            rec = self.log.record(slot)
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
        view = self.files.mapped(slot, kind)
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
        for slot in range(self.files.num_slots):
            try:
                rec = self.log.record(slot)
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
            self.rank, self.node, self.log.committed_version(), tuple(versions), tuple(problems)
        )
