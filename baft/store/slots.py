"""The slot files of one rank's store: the ``data`` and ``red`` file of every version slot,
sized, pre-faulted and mapped writable for the engine.

:class:`SlotFiles` owns the rank's directory, the files' names (from
:mod:`baft.store.paths`), their shared mappings and the writable views over them, and
how much host memory they take. It knows nothing of versions: which slot holds what is
the version log's business (:mod:`baft.store.versions`), reading and verifying the
bytes the reader's (:mod:`baft.store.reader`); :class:`baft.store.shm.SnapshotStore`
composes the three.
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from baft.store.paths import KINDS, SLOT_FILE, slot_file_name

PAGE = mmap.PAGESIZE
NUM_SLOTS = 2
"""Version slots of a store by default (double buffering: the newest committed version
is never the one being written). Differential checkpoints keep a ring of more (see
``SnapshotStore.allocate``): a version's rebuild needs the payloads of a whole rotation."""
MAX_SLOTS = 64
"""Most slots a store may have."""


def round_page(n: int) -> int:
    """``n`` rounded up to whole pages."""
    return -(-n // PAGE) * PAGE


class SlotFiles:
    """The slot files of the store in ``path`` (rank ``rank``), mapped on ``map_slots``."""

    def __init__(self, root: Path, job_id: str, path: Path, rank: int) -> None:
        self.root = root
        self.job_id = job_id
        self.path = path
        self.rank = rank
        self._maps: dict[tuple[int, str], mmap.mmap | None] = {}
        self._views: dict[tuple[int, str], np.ndarray] = {}
        self._sizes: tuple[int, int] | None = None
        self._num_slots = 0

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

    @property
    def sizes(self) -> tuple[int, int] | None:
        """``(data, red)`` bytes per slot as mapped, or None before ``map_slots``."""
        return self._sizes

    def file(self, slot: int, kind: str) -> Path:
        """The slot's ``data`` or ``red`` file, or (``kind="json"``) its manifest."""
        return self.path / slot_file_name(slot, kind)

    def make_dirs(self) -> None:
        """Create the store's directories, private to this user."""
        for p in (self.root, self.root / self.job_id, self.path.parent, self.path):
            p.mkdir(mode=0o700, exist_ok=True)
        for p in (self.root / self.job_id, self.path.parent, self.path):
            os.chmod(p, 0o700)

    def reusable_bytes(self, sizes: Mapping[str, int], num_slots: int) -> int:
        """Bytes of the first ``num_slots`` slots' files that already have their size
        (kept as they are: they need no more memory)."""
        return sum(
            round_page(n)
            for slot in range(num_slots)
            for kind, n in sizes.items()
            if self.file(slot, kind).exists() and self.file(slot, kind).stat().st_size == n
        )

    def map_slots(self, sizes: Mapping[str, int], num_slots: int, kept: int | None) -> None:
        """Remove slot files beyond ``num_slots`` (an earlier, longer ring), then size and
        map every slot's files; ``kept``: the slot whose files only grow (a kept version).
        Call after ``close``."""
        for slot in range(num_slots, self.num_slots):
            for kind in (*KINDS, "json"):
                self.file(slot, kind).unlink(missing_ok=True)
        for slot in range(num_slots):
            for kind, n in sizes.items():
                self._map_rw(slot, kind, n, grow=slot == kept)
        self._sizes = (sizes["data"], sizes["red"])
        self._num_slots = num_slots

    def _map_rw(self, slot: int, kind: str, nbytes: int, *, grow: bool = False) -> None:
        path = self.file(slot, kind)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = os.fstat(fd).st_size
            if grow and size < nbytes:  # a kept version: its bytes stay, the file grows
                os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, size, nbytes - size)
            elif size != nbytes:
                if size:  # different shape: old contents are meaningless now
                    self.file(slot, "json").unlink(missing_ok=True)
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

    def view(self, slot: int, kind: str) -> np.ndarray:
        """Writable uint8 view of the slot's ``kind`` file (zero copy)."""
        if slot not in range(self.num_slots):
            raise ValueError(f"slot must be in 0..{self.num_slots - 1}, got {slot}")
        if (slot, kind) not in self._views:
            raise RuntimeError(
                f"rank {self.rank} store: call allocate(data_nbytes, red_nbytes) first"
            )
        return self._views[(slot, kind)]

    def mapped(self, slot: int, kind: str) -> np.ndarray | None:
        """The writable view of the slot's file if this process mapped it, else None."""
        return self._views.get((slot, kind))

    def host_bytes(self) -> int:
        """Bytes of host memory the store's files occupy now (allocated blocks)."""
        if not self.path.is_dir():
            return 0
        return sum(p.stat().st_blocks * 512 for p in self.path.iterdir() if p.is_file())

    def close(self) -> None:
        """Drop the writable mappings (files and contents stay)."""
        self._views.clear()
        for mm in self._maps.values():
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a caller still holds a view; GC closes it later
                    pass
        self._maps.clear()
        self._sizes = None
        self._num_slots = 0

    def remove(self) -> None:
        """Remove the rank's store directory (call after every part of the store closed)."""
        shutil.rmtree(self.path, ignore_errors=True)
