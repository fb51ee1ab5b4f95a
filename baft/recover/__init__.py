"""Recovery: the pure coordinator (which version, from where) and the restore runtime."""

from baft.recover.coordinator import (
    Decode,
    LocatedInventory,
    PieceTransfer,
    RecoveryPlan,
    ShardSource,
    StoreRef,
    TopologyMismatchError,
    VersionAssessment,
    assess_version,
    coordinate,
    coordinate_located,
    reader_of,
)

__all__ = [
    "Decode",
    "LocatedInventory",
    "PieceTransfer",
    "RecoveryPlan",
    "ShardSource",
    "StoreRef",
    "TopologyMismatchError",
    "VersionAssessment",
    "assess_version",
    "coordinate",
    "coordinate_located",
    "reader_of",
]
