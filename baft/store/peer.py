"""Read-only view of another rank's store on the same host: move redundancy bytes once.

Ranks whose stores live in one host's memory (the ranks of one node in production,
simulated failure domains on one machine in tests) do not need a socket to exchange
redundancy: the holder maps the sender's slot file and copies (replicas) or encodes
(parity) straight from it, one pass over the bytes instead of user -> kernel -> user
copies through loopback TCP. The sender publishes how far its snapshot of a version has
got (``SnapshotStore.publish``); a reader only touches bytes the progress record says are
final. Mappings follow the files: a sender that re-allocates (re-plan) or re-creates its
store (wiped under a live rank) gets a new file size or inode; every access re-stats the
file (about a microsecond) and maps the new one (an old, unlinked mapping stays readable
and is simply dropped). An unchanged file keeps its mapping, so its pages are faulted in
once (``MAP_POPULATE``), not per version.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from baft.store import progress
from baft.store.paths import PROGRESS_FILE, slot_file_name
from baft.store.slots import MAX_SLOTS


class PeerStore:
    """Another rank's store directory on this host, mapped read-only on demand."""

    def __init__(self, path: Path | str, rank: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self._maps: dict[str, tuple[tuple[int, int], np.ndarray]] = {}

    def _mapped(self, name: str) -> np.ndarray | None:
        """The file ``name`` mapped read-only, remapped if it changed; None if absent."""
        try:
            st = os.stat(self.path / name)
        except FileNotFoundError:
            self._maps.pop(name, None)
            return None
        key = (st.st_ino, st.st_size)
        cached = self._maps.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        if st.st_size == 0:
            return None
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # shared: no page copies
        with open(self.path / name, "rb") as f:
            mm = mmap.mmap(f.fileno(), st.st_size, flags=flags, prot=mmap.PROT_READ)
        view = np.frombuffer(mm, np.uint8)
        self._maps[name] = (key, view)
        return view

    def covered(self, version: int) -> tuple[int, int] | None:
        """(slot, final shard bytes) of ``version`` as the sender published it, or None
        while the sender is not writing that version (yet)."""
        raw = self._mapped(PROGRESS_FILE)
        if raw is None or raw.nbytes < progress.NBYTES:
            return None
        return progress.covered(progress.fields(raw), version, MAX_SLOTS)

    def gone(self) -> bool:
        """The sender's store was removed under it (wiped, node lost): it publishes nothing
        more of the version it was writing (it starts a fresh store at its next one)."""
        return not (self.path / PROGRESS_FILE).exists()

    def data(self, slot: int) -> np.ndarray | None:
        """The sender's shard file of ``slot`` (read-only), or None if it has none."""
        return self._mapped(slot_file_name(slot, "data"))

    def close(self) -> None:
        self._maps.clear()
