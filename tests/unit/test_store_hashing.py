"""Hash while copying (store/hashing): block by block, the digest of the copied bytes."""

from __future__ import annotations

import numpy as np
import xxhash

from baft.store.hashing import HASH_BLOCK_BYTES, copy_hashing
from baft.store.manifest import checksum


def test_copy_hashing_copies_every_block_and_hashes_what_it_copied() -> None:
    n = 2 * HASH_BLOCK_BYTES + 3
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    blocks: list[tuple[int, int]] = []

    def copy(lo: int, hi: int) -> memoryview:
        blocks.append((lo, hi))
        np.copyto(dst[lo:hi], src[lo:hi])
        return dst[lo:hi].data

    h = xxhash.xxh3_64()
    copy_hashing(h, n, copy)
    assert blocks == [
        (0, HASH_BLOCK_BYTES),
        (HASH_BLOCK_BYTES, 2 * HASH_BLOCK_BYTES),
        (2 * HASH_BLOCK_BYTES, n),
    ]
    assert np.array_equal(dst, src)
    assert h.intdigest() == checksum(src)


def test_one_hasher_over_several_ranges_is_the_digest_of_their_concatenation() -> None:
    """A region pulled in pieces (redundancy) or a chunk of several tensors (device copy)."""
    parts = [np.full(k, k % 251, np.uint8) for k in (5, HASH_BLOCK_BYTES + 1, 0, 17)]
    out = [np.empty_like(p) for p in parts]
    h = xxhash.xxh3_64()
    for src, dst in zip(parts, out, strict=True):

        def copy(lo: int, hi: int, src: np.ndarray = src, dst: np.ndarray = dst) -> memoryview:
            np.copyto(dst[lo:hi], src[lo:hi])
            return dst[lo:hi].data

        copy_hashing(h, src.size, copy)
    assert h.intdigest() == checksum(np.concatenate(parts))
    assert all(np.array_equal(a, b) for a, b in zip(parts, out, strict=True))
    assert h.intdigest() != checksum(np.concatenate(parts[:2]))
