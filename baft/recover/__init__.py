"""Recovery: the pure coordinator (which version, from where) and the restore runtime."""

from baft.recover.coordinator import (
    Decode,
    PieceTransfer,
    RecoveryPlan,
    ShardSource,
    VersionAssessment,
    assess_version,
    coordinate,
)

__all__ = [
    "Decode",
    "PieceTransfer",
    "RecoveryPlan",
    "ShardSource",
    "VersionAssessment",
    "assess_version",
    "coordinate",
]
