"""Per-rank snapshot store in shared memory that outlives a crashed trainer.

Layout: ``{root}/{job_id}/node{node}/rank{rank}/`` holding two version slots
(``slot{s}.data`` = the rank's shard, ``slot{s}.red`` = its redundancy area,
``slot{s}.json`` = the slot's manifest; these names are spelled only in this package), ``commit.json`` (newest globally
committed version) and ``progress`` (which version the rank is writing into which slot and how many
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

:class:`SnapshotStore` is the one object callers use. This module owns its allocation
(the memory budget and free-space checks) and its lifecycle; it composes three parts:
the slot files and their mappings (:mod:`baft.store.slots`), the version log with the
progress page (:mod:`baft.store.versions`) and the reader/verifier
(:mod:`baft.store.reader`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path

import numpy as np

from baft.store.manifest import Manifest, RankInventory
from baft.store.paths import rank_path
from baft.store.reader import StoreReader, StoreReadError
from baft.store.slots import MAX_SLOTS, NUM_SLOTS, PAGE, SlotFiles, round_page
from baft.store.versions import VersionLog

__all__ = [
    "DEFAULT_ROOT",
    "MANIFEST_RESERVE_BYTES",
    "MAX_SLOTS",
    "NUM_SLOTS",
    "PAGE",
    "MemoryBudgetError",
    "SnapshotStore",
    "StoreReadError",
]

DEFAULT_ROOT = Path("/dev/shm/baft")
"""Default store root: tmpfs, survives process crashes, not reboots."""
MANIFEST_RESERVE_BYTES = 3 * 64 * 1024
"""Budget set aside for the two slot manifests, the commit record and the progress page."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class MemoryBudgetError(ValueError):
    """The store would need more host memory than allowed or available."""


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
        self._files = SlotFiles(self.root, job_id, self.path, rank)
        self._log = VersionLog(self._files)
        self._reader = StoreReader(self._files, self._log, node)

    # ------------------------------------------------------------- allocation
    @staticmethod
    def required_bytes(data_nbytes: int, red_nbytes: int, num_slots: int = NUM_SLOTS) -> int:
        """Host memory ``allocate`` needs: the slots (page-rounded) plus manifests."""
        return num_slots * (
            round_page(data_nbytes) + round_page(red_nbytes)
        ) + MANIFEST_RESERVE_BYTES * max(1, num_slots // 2)

    @property
    def num_slots(self) -> int:
        """Slots of this store: as allocated, else as found on disk (at least two)."""
        return self._files.num_slots

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
        kept = self._log.slot_of(keep_version, num_slots) if keep_version is not None else None
        if kept is not None:
            data_nbytes = max(data_nbytes, self._files.file(kept, "data").stat().st_size)
            red_nbytes = max(red_nbytes, self._files.file(kept, "red").stat().st_size)
        needed = self.required_bytes(data_nbytes, red_nbytes, num_slots)
        if needed > self.budget_bytes:
            raise MemoryBudgetError(
                f"rank {self.rank} store needs {needed:,} B ({num_slots} slots x (shard {data_nbytes:,} B + "
                f"redundancy {red_nbytes:,} B) + manifests) but budget_bytes is "
                f"{self.budget_bytes:,} B; raise the host-memory budget, pick a lighter "
                "redundancy policy, or add DP replicas so shards shrink"
            )
        self._files.make_dirs()
        sizes = {"data": data_nbytes, "red": red_nbytes}
        reusable = self._files.reusable_bytes(sizes, num_slots)
        stat = os.statvfs(self.path)
        free = stat.f_bavail * stat.f_frsize
        if needed - MANIFEST_RESERVE_BYTES - reusable > free:
            root_arg = "" if self.root == DEFAULT_ROOT else f" --root {self.root}"
            raise MemoryBudgetError(
                f"rank {self.rank} store needs {needed - reusable:,} B more but only {free:,} B "
                f"are free under {self.root}; free memory there (`baft inspect{root_arg}` lists "
                f"the job stores, `baft inspect --free [--idle-s S]{root_arg}` frees those no "
                "live job holds) or lower the snapshot size"
            )
        self.close()  # also drops read mappings: files may be truncated below
        self._files.map_slots(sizes, num_slots, kept)
        self._log.open_progress()
        return keep_version if kept is not None else None

    def publish(self, version: int, slot: int, covered: int) -> None:
        """Tell same-host readers that the first ``covered`` shard bytes of ``version`` in
        ``slot`` are final (the page's layout and protocol: :mod:`baft.store.progress`)."""
        self._log.publish(version, slot, covered)

    def data_view(self, slot: int) -> np.ndarray:
        """Writable uint8 view of the slot's shard file (zero copy)."""
        return self._files.view(slot, "data")

    def red_view(self, slot: int) -> np.ndarray:
        """Writable uint8 view of the slot's redundancy file (zero copy)."""
        return self._files.view(slot, "red")

    def host_bytes(self) -> int:
        """Bytes of host memory the store's files occupy now (allocated blocks)."""
        return self._files.host_bytes()

    # ------------------------------------------------------------------ reading
    def read(self, slot: int, kind: str, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of the slot's ``data`` or ``red`` file
        (``nbytes=None``: to the end), zero copy, from the store's read cache;
        ``StoreReadError`` if the file is absent or shorter (see
        :meth:`baft.store.reader.StoreReader.read`)."""
        return self._reader.read(slot, kind, offset, nbytes)

    def drop_read_cache(self) -> None:
        """Release the read mappings (views handed out keep theirs alive until dropped)."""
        self._reader.drop_cache()

    def flip_byte(self, slot: int, kind: str, offset: int) -> bool:
        """Fault injection: XOR the byte at ``offset`` of the slot's file with 0xFF in the
        file itself (every mapping sees it) and fsync; False if the file is absent or
        shorter."""
        return self._reader.flip_byte(slot, kind, offset)

    def verify(self, slot: int) -> list[str]:
        """Recompute the slot's checksums; returns problems (empty = clean)."""
        return self._reader.verify(slot)

    def inventory(self, verify: bool = True) -> RankInventory:
        """What this store holds; with ``verify`` every checksum is recomputed."""
        return self._reader.inventory(verify)

    # ---------------------------------------------------------- version protocol
    def begin(self, version: int, keep: Collection[int] = ()) -> int:
        """Slot to write ``version`` into, marked ``writing``: never the committed one nor
        one holding a complete version in ``keep`` (a differential rotation's window); the
        oldest otherwise (see :meth:`baft.store.versions.VersionLog.begin`)."""
        return self._log.begin(version, keep)

    def complete(self, slot: int, manifest: Manifest) -> None:
        """Record ``manifest`` (state complete) for the slot begun with its version."""
        self._log.complete(slot, manifest)

    def commit(self, version: int) -> None:
        """Record ``version`` as the newest globally committed version."""
        self._log.commit(version)

    def committed_version(self) -> int | None:
        """Version in the commit record, or None."""
        return self._log.committed_version()

    def clear_versions(self, keep: int | None = None) -> None:
        """Forget every version and the commit record (after restoring from disk or fresh);
        ``keep``: except that version (and the commit record, if it names it)."""
        self._log.clear_versions(keep)

    def read_manifest(self, slot: int) -> Manifest | None:
        """The slot's complete manifest, or None (empty, writing or unreadable)."""
        return self._log.read_manifest(slot)

    def read_version(
        self, slot: int, version: int | None, *, data: bool, red: bool
    ) -> tuple[Manifest | None, np.ndarray | None, np.ndarray | None]:
        """A restore's one read of a slot: its manifest and, when it holds ``version``,
        the whole ``data`` and/or ``red`` bytes asked for (zero copy; None otherwise).
        ``StoreReadError`` if a file is absent or shorter than its manifest says."""
        m = self._log.read_manifest(slot)
        if m is None or m.version != version:
            return m, None, None
        d = self._reader.read(slot, "data", 0, m.data_nbytes) if data else None
        r = self._reader.read(slot, "red", 0, m.red_nbytes) if red else None
        return m, d, r

    # --------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Drop this process's mappings, read cache included (files and contents stay)."""
        self._reader.drop_cache()
        self._log.close_progress()
        self._files.close()

    def destroy(self) -> None:
        """Remove this rank's store directory (simulates losing the node)."""
        self.close()
        self._files.remove()

    def reclaim_unless_holding(self, version: int | None) -> bool:
        """Free this store unless it holds a complete ``version``; if it does, forget every
        newer version (slot manifests dropped, the commit record names ``version``), so no
        version of the abandoned timeline can mix into a later restore; older ones stay (a
        differential rotation may need them to rebuild ``version``). Returns whether the
        store was removed."""
        if version is not None and self._log.roll_back_to(version):
            return False
        self.destroy()
        return True
