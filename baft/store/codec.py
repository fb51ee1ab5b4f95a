"""The byte kernels of the codes: XOR parity, zero padding to a stripe's segment, and
the zfec (Reed-Solomon) encoders and decoders, cached per shape.

:class:`baft.store.coding.GroupLayout` decides which bytes go where; these functions
only compute. Pure: numpy and zfec, no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import zfec

BytesLike = bytes | bytearray | memoryview | np.ndarray
"""Anything exposing a contiguous byte buffer."""


def u8(x: BytesLike) -> np.ndarray:
    """``x`` as a flat uint8 array (no copy)."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint8)
    return np.frombuffer(x, np.uint8)


def xor_into(out: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """out ^= each array (zero-extended), on uint64 views where aligned."""
    out[:] = 0
    wide = out.size // 8 * 8
    out64 = out[:wide].view(np.uint64) if out.ctypes.data % 8 == 0 else None
    for a in arrays:
        n = a.size
        head = min(n, wide) // 8 * 8
        if out64 is not None and head and a.ctypes.data % 8 == 0:
            np.bitwise_xor(out64[: head // 8], a[:head].view(np.uint64), out=out64[: head // 8])
            np.bitwise_xor(out[head:n], a[head:n], out=out[head:n])
        else:
            np.bitwise_xor(out[:n], a, out=out[:n])


def padded(arrays: Sequence[np.ndarray], nbytes: int) -> list[np.ndarray]:
    """Each array contiguous and zero-extended to ``nbytes`` (copied only when short)."""
    out = []
    for a in arrays:
        if a.size == nbytes:
            out.append(np.ascontiguousarray(a))
        else:
            buf = np.zeros(nbytes, np.uint8)
            buf[: a.size] = a
            out.append(buf)
    return out


@functools.lru_cache(maxsize=64)
def encoder(k: int, n: int) -> zfec.Encoder:
    """The zfec encoder of ``k`` data blocks out of ``n``."""
    return zfec.Encoder(k, n)


@functools.lru_cache(maxsize=64)
def decoder(k: int, n: int) -> zfec.Decoder:
    """The zfec decoder of ``k`` data blocks out of ``n``."""
    return zfec.Decoder(k, n)
