"""The one device-copy seam: live tensors (CPU or CUDA) -> host snapshot buffers.

The training thread only *starts* a snapshot copy at its planned slot; whoever reads the
copied bytes (the checksum, the redundancy exchange) first waits on the handle that
:meth:`DeviceCopy.start` returned, and the training thread waits for everything only at
the step deadline (``synchronize``). Three implementations:

- :class:`CudaCopy`: ``non_blocking`` copies on a side stream into pinned host memory;
  the host never blocks on DMA. A pool of hash threads hashes each chunk once its CUDA
  event completes, in parallel (a single hashing thread could not keep up with the DMA).
- :class:`ThreadCopy`: the same semantics for ``--compute emulated`` (the stand-in for an
  accelerator, where the host is idle while the device computes): a copy thread plays the
  DMA engine. Copies go through :func:`copy_hash`, which hashes each block while it is
  still in cache, so no separate pass reads the snapshot only to checksum it.
- :class:`HostCopy`: CPU training, where the host *is* the device: a synchronous
  ``copy_hash`` at the slot, inside the bubble (a copy thread would compete with compute).

Everything else in the engine works on host bytes and never asks where the model is.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from baft.engine.priority import lower_thread_priority, raised
from baft.store.hashing import HASH_BLOCK_BYTES, copy_hashing

_log = logging.getLogger("baft")


Pair = tuple[torch.Tensor, torch.Tensor]
"""(host destination, live source) uint8 views of equal length."""


def copy_hash(pairs: Sequence[Pair]) -> int:
    """Copy every ``src`` into its ``dst`` and return the xxh3_64 of the destinations
    concatenated in order (for a chunk: the same digest as hashing the chunk afterwards)."""
    h = xxhash.xxh3_64()
    for dst, src in pairs:
        if all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in (dst, src)):
            # numpy views: a block's slicing and copy cost ~1 us of Python under the GIL
            # instead of torch's ~20 (68 MiB in 512 KiB blocks: 21-30 ms vs 39-373 ms
            # here, the rest of each block's copy runs without the GIL either way)
            block = functools.partial(_copy_block_np, dst.numpy(), src.numpy())
        else:
            block = functools.partial(_copy_block, dst, src)
        copy_hashing(h, dst.numel(), block)
    return h.intdigest()


def _copy_block_np(dst: np.ndarray, src: np.ndarray, lo: int, hi: int) -> memoryview:
    d = dst[lo:hi]
    np.copyto(d, src[lo:hi])
    return d.data


def _copy_block(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> memoryview:
    """Copy bytes ``[lo, hi)`` of ``src`` into ``dst``; the copied bytes, for hashing."""
    d = dst[lo:hi]
    d.copy_(src[lo:hi])
    return d.numpy().data


class ChunkCopy:
    """One chunk's copy in flight. ``wait`` returns once its bytes are in host memory
    and hashed: ``checksum`` is then the xxh3_64 of the chunk (host copiers hash while
    copying, the CUDA copier on its hash threads). ``seconds`` is the copy's own
    duration where known (not for DMA); ``hash_seconds`` a separate hashing pass's."""

    __slots__ = ("checksum", "seconds", "hash_seconds", "nbytes", "background", "_done")

    def __init__(self, nbytes: int, *, background: bool = False) -> None:
        self.background = background
        """Copied off the calling thread (a copy thread or DMA)."""
        self.checksum: int | None = None
        self.seconds = 0.0
        self.hash_seconds = 0.0
        self.nbytes = nbytes
        self._done = threading.Event()

    def finish(self, checksum: int | None, seconds: float) -> None:
        self.checksum, self.seconds = checksum, seconds
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"snapshot copy of {self.nbytes} B not done after {timeout_s} s")

    def done(self) -> bool:
        return self._done.is_set()


class DeviceCopy(Protocol):
    """Starts chunk copies from live tensors into host buffers."""

    asynchronous: bool
    """True when ``start`` returns before the bytes are copied (wait before reading)."""

    def start(self, pairs: Sequence[Pair]) -> ChunkCopy: ...

    def synchronize(self) -> None: ...

    def shutdown(self) -> None: ...


def _pairs_nbytes(pairs: Sequence[Pair]) -> int:
    return sum(d.numel() for d, _ in pairs)


class HostCopy:
    """CPU training: a synchronous copy-and-hash on the calling thread."""

    asynchronous = False

    def start(self, pairs: Sequence[Pair]) -> ChunkCopy:
        c = ChunkCopy(_pairs_nbytes(pairs))
        t0 = time.perf_counter()
        digest = copy_hash(pairs)
        c.finish(digest, time.perf_counter() - t0)
        return c

    def synchronize(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


class ThreadCopy:
    """Accelerator semantics on the host (``--compute emulated``): a copy thread plays
    the DMA engine. ``start`` only queues; the thread copies and hashes in FIFO order;
    ``synchronize`` (the step deadline) waits for the queue.

    The thread runs at ``SCHED_IDLE`` (:mod:`baft.engine.priority`): a DMA engine takes
    no host CPU, so the copy thread that plays one must not delay the training thread's
    wake-ups either (at normal priority each wake-up from a pipeline wait can queue
    behind it for a scheduler slice). While the step waits for it in ``synchronize`` it
    runs at normal priority, so that no other busy thread starves it (no inversion)."""

    asynchronous = True

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Sequence[Pair], ChunkCopy] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._idle = False
        self._native_id = 0
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="baft-copy", daemon=True
        )
        self._thread.start()
        started.wait()

    def start(self, pairs: Sequence[Pair]) -> ChunkCopy:
        c = ChunkCopy(_pairs_nbytes(pairs), background=True)
        self._queue.put((pairs, c))
        return c

    def synchronize(self) -> None:
        with raised(self._native_id, self._idle and self._queue.unfinished_tasks > 0):
            self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("snapshot copy failed") from err

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(30.0)

    def _run(self, started: threading.Event) -> None:
        self._native_id = threading.get_native_id()
        self._idle = lower_thread_priority("copy")
        started.set()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                pairs, c = item
                t0 = time.perf_counter()
                digest = copy_hash(pairs)
                c.finish(digest, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - re-raised by synchronize()
                self._error = e
                if item is not None:
                    item[1].finish(None, 0.0)
            finally:
                self._queue.task_done()


def _span(dsts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 view of ``dsts`` when they lie back to back in one storage (the pieces
    of a chunk in its slot), else None."""
    if not dsts:
        return None
    first = dsts[0]
    storage, pos = first.untyped_storage(), first.storage_offset()
    for d in dsts:
        if d.untyped_storage().data_ptr() != storage.data_ptr() or d.storage_offset() != pos:
            return None
        pos += d.numel()
    start = int(first.storage_offset())
    return torch.empty(0, dtype=torch.uint8).set_(storage, start, (int(pos) - start,), (1,))


def hash_threads() -> int:
    """Threads that hash CUDA snapshot copies on the host: ``$BAFT_HASH_THREADS``, else
    the cores this rank's share of the host leaves beside its training thread, 1 to 8.

    Measured on H200 hosts (16 cores, gVisor): one thread hashes 5-10 GB/s, four 17-36,
    eight 30-67, against 55 GB/s of device-to-host copy; with one thread the hash of a
    1.1 GiB state took 255 ms per iteration and the step waited for it."""
    if os.environ.get("BAFT_HASH_THREADS"):
        return max(1, int(os.environ["BAFT_HASH_THREADS"]))
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, (os.cpu_count() or 2) // local - 1))


class CudaCopy:
    """CUDA tensors: asynchronous D2H copies on a side stream, ordered after compute.
    The host never waits for them before the step deadline (``synchronize``). Each
    chunk is hashed once its event completes, on a pool of :func:`hash_threads` threads
    (xxhash releases the GIL, so chunks hash in parallel beside the training thread)."""

    asynchronous = True
    issues_off_thread = True
    """The engine may issue this copier's copies from a thread of its own, after
    :meth:`mark` on the training thread."""

    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.device = device
        self._issued = False
        """A copy was issued since the last synchronize (else there is nothing to wait for)."""
        self._after: Any = None
        self._pool = ThreadPoolExecutor(threads or hash_threads(), thread_name_prefix="baft-hash")

    def mark(self) -> None:
        """On the training thread: copies started from now until :meth:`synchronize`
        (from any thread) are ordered after the work its stream holds now. The state
        they copy stays as it is until the step, which comes after ``synchronize``."""
        self._after = torch.cuda.Event()
        self._after.record(torch.cuda.current_stream(self.device))

    def start(self, pairs: Sequence[Pair]) -> ChunkCopy:
        c = ChunkCopy(_pairs_nbytes(pairs), background=True)
        # The side stream must see every kernel that produced the sources so far.
        if self._after is not None:
            self.stream.wait_event(self._after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self._issued = True
        self._pool.submit(self._hash, c, event, [dst for dst, _ in pairs])
        return c

    @staticmethod
    def _hash(c: ChunkCopy, event: Any, dsts: list[torch.Tensor]) -> None:
        digest = None
        try:
            event.synchronize()  # releases the GIL
            t0 = time.perf_counter()
            span = _span(dsts)
            if span is not None:  # the usual case: one call, one GIL release per chunk
                digest = xxhash.xxh3_64_intdigest(span.numpy().data)
            else:
                h = xxhash.xxh3_64()
                for d in dsts:  # consecutive pieces of the chunk: the chunk's digest
                    h.update(d.numpy().data)
                digest = h.intdigest()
            c.hash_seconds = time.perf_counter() - t0
        finally:
            c.finish(digest, 0.0)  # a failed hash leaves None: the reader hashes

    def synchronize(self) -> None:
        """Wait for every copy issued so far, from whichever thread: an event recorded
        now on the side stream follows them all in stream order."""
        self._after = None
        if self._issued:
            self._issued = False
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()

    def shutdown(self) -> None:
        self.synchronize()
        self._pool.shutdown(wait=True)


class HostPins:
    """Host buffers page-locked for CUDA (``cudaHostRegister``), so that device copies
    into them are DMA the host never waits for. Memory that goes away (a store's slots
    re-allocated or closed) must be unregistered first, else its pages stay locked for
    the life of the CUDA context: :meth:`release` before the store unmaps.

    Own code rather than ``pin_memory=True`` because the store's slots are shared-memory
    files that outlive the process (torch pins only memory it allocates itself)."""

    def __init__(self) -> None:
        self._ptrs: list[int] = []

    def pin(self, t: torch.Tensor) -> bool:
        """Page-lock ``t``'s memory (no-op without CUDA); False, with a warning, where
        CUDA refuses (copies into it then block the host for their duration)."""
        if not torch.cuda.is_available() or not t.numel():
            return False
        n = t.numel() * t.element_size()
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
        if int(rc) != 0:
            _log.warning(
                "cudaHostRegister of %d B failed (error %s): snapshot copies into this "
                "buffer are not asynchronous",
                n,
                rc,
            )
            return False
        self._ptrs.append(t.data_ptr())
        return True

    def release(self) -> None:
        """Unregister every buffer pinned here (before their memory is unmapped)."""
        while self._ptrs:
            ptr = self._ptrs.pop()
            rc = torch.cuda.cudart().cudaHostUnregister(ptr)
            if int(rc) != 0:
                _log.warning("cudaHostUnregister failed (error %s)", rc)


def device_copy_for(device: torch.device, *, emulated: bool = False) -> DeviceCopy:
    """The copier for live tensors on ``device``; ``emulated`` compute gets accelerator
    semantics (a copy thread) although the tensors are on the CPU."""
    if device.type == "cuda":
        return CudaCopy(device)
    return ThreadCopy() if emulated else HostCopy()


__all__ = [
    "ChunkCopy",
    "CudaCopy",
    "DeviceCopy",
    "HASH_BLOCK_BYTES",
    "HostCopy",
    "HostPins",
    "ThreadCopy",
    "copy_hash",
    "device_copy_for",
    "hash_threads",
]
