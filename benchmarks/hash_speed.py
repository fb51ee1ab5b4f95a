"""Checksum speed on this machine: xxh3_64 (xxhash) vs CRC32C (hardware SSE4.2, two
packages), whole 8 MiB chunks and 512 KiB blocks, plus copy-then-hash vs copy-and-hash
per block (what baft's copiers do). Needs ``pip install crc32c google-crc32c`` beside
xxhash and numpy (not baft dependencies). Prints GB/s medians of interleaved repeats.

    python benchmarks/hash_speed.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import xxhash

CHUNK = 8 << 20
BLOCK = 512 << 10


def _gbps(fn, nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    import crc32c
    import google_crc32c

    src = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src
    blocks = [src[i : i + BLOCK] for i in range(0, CHUNK, BLOCK)]

    def xxh_blocks() -> None:
        h = xxhash.xxh3_64()
        for b in blocks:
            h.update(b.data)
        h.intdigest()

    def copy_then_hash() -> None:
        np.copyto(dst, src)
        xxhash.xxh3_64_intdigest(dst.data)

    def copy_and_hash() -> None:
        h = xxhash.xxh3_64()
        for i in range(0, CHUNK, BLOCK):
            d = dst[i : i + BLOCK]
            np.copyto(d, src[i : i + BLOCK])
            h.update(d.data)
        h.intdigest()

    cases = {
        "xxh3_64, 8 MiB at once": lambda: xxhash.xxh3_64_intdigest(src.data),
        "xxh3_64, 512 KiB blocks (streaming)": xxh_blocks,
        "crc32c (crc32c pkg, hw), 8 MiB": lambda: crc32c.crc32c(src.data),
        "crc32c (google-crc32c, via a bytes copy)": lambda: google_crc32c.value(src.tobytes()),
        "copy only, 8 MiB": lambda: np.copyto(dst, src),
        "copy then hash (two passes)": copy_then_hash,
        "copy and hash per 512 KiB block": copy_and_hash,
    }
    print(
        f"crc32c hardware: {crc32c.hardware_based}; google-crc32c impl: {google_crc32c.implementation}"
    )
    results: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(3):  # interleave rounds so drifting load hits every case alike
        for name, fn in cases.items():
            results[name].append(_gbps(fn, CHUNK, a.repeats))
    for name, r in results.items():
        print(
            f"{name:40s} {statistics.median(r):6.2f} GB/s  (rounds: {', '.join(f'{x:.2f}' for x in r)})"
        )


if __name__ == "__main__":
    main()
