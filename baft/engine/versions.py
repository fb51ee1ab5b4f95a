"""The bookkeeping of the version being written (chunks done, checksums, seconds per
protect component). The writer (:mod:`baft.engine.writer`) fills it; the commit
(:mod:`baft.engine.commit`) and persisting (:mod:`baft.engine.persisting`) own what
happens to a version after it is written.
"""

from __future__ import annotations

import torch

COMPONENTS = ("copy", "hash", "send", "pull", "recv_wait", "encode", "deadline_wait")
"""Where a version's protect time goes: ``copy`` (snapshot copies, hashing included where
the copier hashes on the way), ``hash`` (a separate checksum pass: CUDA only), ``send``
(network sends), ``pull`` (same-host redundancy copies from a peer's store), ``recv_wait``
(waiting for network receives and peers' progress), ``encode`` (parity), and
``deadline_wait`` (the training thread waiting for copies at the step deadline)."""


class Version:
    """Bookkeeping of the version being written."""

    def __init__(self, version: int, slot: int, data: torch.Tensor, red: torch.Tensor) -> None:
        self.version = version
        self.slot = slot
        self.data = data
        self.red = red
        self.done: set[int] = set()
        self.covered = 0
        self.checksums: dict[int, int] = {}
        self.in_bubble_s = 0.0
        self.exposed_s = 0.0
        self.snapshot_bytes = 0
        self.protected: set[int] = set()
        self.has_record = False
        """Differential: the payload carries the record of step ``version - 1``."""
        self.seconds: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
        """Seconds per protect component (see COMPONENTS), summed over threads."""
