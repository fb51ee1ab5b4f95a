"""Hash while copying: the one loop that copies a range block by block and hashes each
block while it is still in cache.

A snapshot chunk (:func:`baft.engine.device.copy_hash`) and a same-host redundancy pull
both copy bytes into the store and need their xxh3_64 for the manifest. Hashing a block
right after copying it costs little more than the copy alone; a separate pass over an
8 MiB chunk re-reads it from L3 or memory (measured by ``hash_speed.py`` in the repository's measurement scripts). The digest is
the same as :func:`baft.store.manifest.checksum` of the copied bytes afterwards.

The caller copies (a torch ``copy_`` or ``np.copyto``, whichever its buffers are); this
module owns the block size and the order, and never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xxhash

HASH_BLOCK_BYTES = 512 << 10
"""Copy-and-hash granularity: small enough that a copied block is still in the core's
L2 cache when it is hashed."""

CopyBlock = Callable[[int, int], Any]
"""``copy(lo, hi)``: copy bytes ``[lo, hi)`` of a range and return the copied bytes as a
buffer (a memoryview or anything ``xxhash`` reads without a copy)."""


def copy_hashing(hasher: xxhash.xxh3_64, nbytes: int, copy: CopyBlock) -> None:
    """Copy ``nbytes`` bytes block by block with ``copy`` and feed each copied block to
    ``hasher`` right after it: ``hasher`` then also covers the
    range, as if its bytes had been hashed after the copy."""
    for lo in range(0, nbytes, HASH_BLOCK_BYTES):
        hi = min(nbytes, lo + HASH_BLOCK_BYTES)
        hasher.update(copy(lo, hi))
