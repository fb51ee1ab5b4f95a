"""Snapshot store: shared-memory slots, manifests and checksums, erasure coding (pure).

- ``policy``: redundancy policies and coding groups (pure).
- ``coding``: stripe layout of a coding group, encode / rebuild (pure); ``codec``: its
  byte kernels (XOR, zfec).
- ``manifest``: manifest, commit and inventory records with xxh3 checksums.
- ``paths``: where stores live: the host id, the directory tree and a store's file names.
- ``shm``: the per-rank shared-memory store (version slots; its own read path), composed
  of ``slots`` (the mapped slot files), ``versions`` (the version log and progress page)
  and ``reader`` (reads, verification, inventory); ``reclaim``: freeing stores no live
  job holds.
- ``disk``: the disk tier: versions as DCP checkpoints (background writer, commit marker);
  ``disk_layout``: its directory layout and which versions are complete; ``dcp_state``:
  a flat state as DCP sees it (DTensor shards, zero-copy compaction) and loading it.
- ``peer``: read-only view of a same-host rank's store (redundancy moved once).
- ``inspect``: ``baft inspect`` over a store directory.
"""

from baft.store.coding import (
    GroupLayout,
    Recipe,
    Region,
    Segment,
    Transfer,
    UnrecoverableError,
    group_layouts,
)
from baft.store.manifest import (
    ChunkRecord,
    Manifest,
    RankInventory,
    RegionRecord,
    VersionInfo,
    checksum,
    chunk_records,
    region_records,
)
from baft.store.paths import find_stores
from baft.store.policy import Redundancy, coding_groups, group_of
from baft.store.shm import (
    DEFAULT_ROOT,
    MemoryBudgetError,
    SnapshotStore,
    StoreReadError,
)

__all__ = [
    "DEFAULT_ROOT",
    "ChunkRecord",
    "GroupLayout",
    "Manifest",
    "MemoryBudgetError",
    "RankInventory",
    "Recipe",
    "Redundancy",
    "Region",
    "RegionRecord",
    "Segment",
    "SnapshotStore",
    "StoreReadError",
    "Transfer",
    "UnrecoverableError",
    "VersionInfo",
    "checksum",
    "chunk_records",
    "coding_groups",
    "find_stores",
    "group_layouts",
    "group_of",
    "region_records",
]
