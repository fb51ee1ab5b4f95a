"""The device-copy seam: host and thread copiers copy the same bytes and hash them on the
way to the digest a separate pass would give; the thread copier only starts copies."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from baft.engine.device import (
    HASH_BLOCK_BYTES,
    HostCopy,
    ThreadCopy,
    copy_hash,
    device_copy_for,
)
from baft.engine.flat import FlatState
from baft.store.manifest import checksum


def _state() -> FlatState:
    g = torch.Generator().manual_seed(0)
    return FlatState(
        [
            ("a", torch.randn(3 * HASH_BLOCK_BYTES // 4 + 5, generator=g)),  # spans blocks
            ("b", torch.randint(0, 1000, (17,), generator=g)),
            ("c", torch.tensor(3.5, dtype=torch.float64)),
        ]
    )


def test_copy_hash_equals_a_separate_hash_of_the_copied_bytes() -> None:
    flat = _state()
    out = torch.zeros(flat.nbytes, dtype=torch.uint8)
    digest = copy_hash(flat.pairs(flat.pieces(0, flat.nbytes), out))
    expected = torch.cat([t.reshape(-1).view(torch.uint8) for t in flat.tensors])
    assert torch.equal(out, expected)
    assert digest == checksum(out.numpy())


@pytest.mark.parametrize("copier_cls", [HostCopy, ThreadCopy])
def test_copiers_give_identical_bytes_and_checksums_per_chunk(copier_cls: type) -> None:
    flat = _state()
    copier = copier_cls()
    out = torch.zeros(flat.nbytes, dtype=torch.uint8)
    bounds = [0, 1000, HASH_BLOCK_BYTES + 3, flat.nbytes]  # chunks cut mid-tensor
    copies = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        copies.append((lo, hi, copier.start(flat.pairs(flat.pieces(lo, hi), out[lo:hi]))))
    copier.synchronize()
    for lo, hi, c in copies:
        c.wait(5.0)
        assert c.done() and c.nbytes == hi - lo
        assert c.checksum == checksum(out[lo:hi].numpy())
    expected = torch.cat([t.reshape(-1).view(torch.uint8) for t in flat.tensors])
    assert torch.equal(out, expected)
    copier.shutdown()


def test_thread_copy_returns_before_copying_and_synchronize_waits() -> None:
    """The training thread only starts a copy: with the copy thread held, start() returns
    and the bytes are not there yet; synchronize() (the step deadline) waits for them."""
    copier = ThreadCopy()
    release = threading.Event()
    blocker = torch.zeros(1, dtype=torch.uint8)

    # hold the copy thread on a first item whose source blocks until released
    held = threading.Event()

    def slow_pairs() -> list:
        class Src:
            def __getitem__(self, key: slice) -> torch.Tensor:
                held.set()
                release.wait(5.0)
                return torch.ones(1, dtype=torch.uint8)

        return [(blocker, Src())]

    first = copier.start(slow_pairs())  # type: ignore[arg-type]
    src = torch.arange(8, dtype=torch.uint8)
    dst = torch.zeros(8, dtype=torch.uint8)
    second = copier.start([(dst, src)])
    assert held.wait(5.0)
    assert not second.done() and torch.equal(dst, torch.zeros(8, dtype=torch.uint8))
    release.set()
    copier.synchronize()
    assert first.done() and second.done()
    assert torch.equal(dst, src) and blocker.item() == 1
    copier.shutdown()


def test_thread_copy_failure_is_raised_at_the_deadline() -> None:
    copier = ThreadCopy()
    # a source shorter than its destination: copy_ raises on the copy thread
    c = copier.start([(torch.zeros(5, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))])
    with pytest.raises(RuntimeError, match="snapshot copy failed"):
        copier.synchronize()
    assert c.done() and c.checksum is None
    copier.shutdown()


def test_device_copy_for_picks_the_seam() -> None:
    assert isinstance(device_copy_for(torch.device("cpu")), HostCopy)
    emulated = device_copy_for(torch.device("cpu"), emulated=True)
    assert isinstance(emulated, ThreadCopy) and emulated.asynchronous
    emulated.shutdown()


class _FakeCuda:
    """Just enough of torch.cuda for CudaCopy's logic on a CPU-only machine: streams are
    no-ops, an event completes when the test lets the copies "land" (``landed``)."""

    landed = threading.Event()

    class Stream:
        def __init__(self, device: object = None) -> None:
            self.waited: list[object] = []

        def wait_stream(self, other: object) -> None:
            self.waited.append(other)

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    class Event:
        def __init__(self) -> None:
            self.recorded = False

        def record(self, stream: object) -> None:
            self.recorded = True

        def synchronize(self) -> None:
            assert self.recorded
            assert _FakeCuda.landed.wait(10.0)

        def query(self) -> bool:
            return self.recorded and _FakeCuda.landed.is_set()

    def __init__(self) -> None:
        self.current = object()
        self.entered: list[object] = []
        _FakeCuda.landed = threading.Event()

    def current_stream(self, device: object = None) -> object:
        return self.current

    def stream(self, s: object):  # noqa: ANN201 - a context manager
        import contextlib

        self.entered.append(s)
        return contextlib.nullcontext()


def test_cuda_seam_orders_copies_after_compute_and_hashes_each_chunk_after_its_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA copier without a GPU (torch.cuda faked): copies are issued on the side
    stream after it waited for the compute stream; start() returns at once, a chunk is
    hashed on the hash threads only once its event completed, and its checksum is the
    xxh3 of the chunk's bytes in order (several pieces), as the restore verifies it."""
    import baft.engine.device as device

    fake = _FakeCuda()
    monkeypatch.setattr(device.torch, "cuda", fake)
    copier = device.CudaCopy(torch.device("cuda", 0), threads=3)
    assert copier.asynchronous
    srcs = [torch.arange(i, i + 40, dtype=torch.uint8) for i in range(6)]
    outs = [torch.zeros(80, dtype=torch.uint8) for _ in range(3)]
    chunks = [
        copier.start([(out[:40], srcs[2 * j]), (out[40:], srcs[2 * j + 1])])
        for j, out in enumerate(outs)
    ]
    assert copier.stream.waited == [fake.current] * 3  # each ordered after compute
    assert fake.entered == [copier.stream] * 3  # issued on the side stream
    time.sleep(0.05)
    assert not any(c.done() for c in chunks) and all(c.checksum is None for c in chunks)
    _FakeCuda.landed.set()
    for c, out in zip(chunks, outs, strict=True):
        c.wait(5.0)
        assert c.background and c.checksum == checksum(out.numpy()) and c.hash_seconds >= 0
    copier.synchronize()
    assert all(torch.equal(out, torch.cat(srcs[2 * j : 2 * j + 2])) for j, out in enumerate(outs))
    apart = [torch.zeros(40, dtype=torch.uint8) for _ in range(2)]  # not back to back
    c = copier.start([(apart[0], srcs[0]), (apart[1], srcs[1])])
    c.wait(5.0)
    assert c.checksum == checksum(torch.cat(srcs[:2]).numpy())
    copier.shutdown()


def test_cuda_copies_issued_after_mark_wait_for_the_marked_point_from_any_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's issuer thread starts copies after the training thread's ``mark``:
    they wait for the event recorded on the training stream then, not for the issuing
    thread's own stream; ``synchronize`` (the deadline) ends the mark."""
    import baft.engine.device as device

    fake = _FakeCuda()
    monkeypatch.setattr(device.torch, "cuda", fake)
    copier = device.CudaCopy(torch.device("cuda", 0), threads=1)
    _FakeCuda.landed.set()
    copier.mark()
    marked = copier._after
    assert isinstance(marked, _FakeCuda.Event) and marked.recorded
    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    issuer = threading.Thread(target=lambda: copier.start([(dst, src)]).wait(5.0))
    issuer.start()
    issuer.join(5.0)
    assert copier.stream.waited == [marked] and torch.equal(dst, src)
    copier.synchronize()
    copier.start([(dst, src)]).wait(5.0)
    assert copier.stream.waited == [marked, fake.current]  # no mark: the current stream
    copier.shutdown()


def test_hash_threads_leave_the_training_thread_its_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import baft.engine.device as device

    monkeypatch.delenv("BAFT_HASH_THREADS", raising=False)
    monkeypatch.setattr(device.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert device.hash_threads() == 8  # at most 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert device.hash_threads() == 3  # 4 cores per rank, one trains
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert device.hash_threads() == 1  # at least one
    monkeypatch.setenv("BAFT_HASH_THREADS", "5")
    assert device.hash_threads() == 5


def _policy(native_id: int) -> int:
    import os

    return os.sched_getscheduler(native_id)


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling")
def test_copy_thread_idles_and_runs_at_normal_priority_while_the_step_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DMA engine takes no host CPU: the copy thread playing one is SCHED_IDLE, and at
    SCHED_OTHER exactly while the training thread waits for it in synchronize()."""
    import os

    monkeypatch.setenv("BAFT_BACKGROUND_PRIORITY", "idle")
    copier = ThreadCopy()
    tid = copier._native_id
    assert _policy(tid) == os.SCHED_IDLE
    release, seen = threading.Event(), []

    class Src:
        def __getitem__(self, key: slice) -> torch.Tensor:
            release.wait(5.0)
            seen.append(_policy(tid))  # the policy while the step waits
            return torch.ones(1, dtype=torch.uint8)

    copier.start([(torch.zeros(1, dtype=torch.uint8), Src())])  # type: ignore[list-item]
    threading.Timer(0.2, release.set).start()
    copier.synchronize()
    assert seen == [os.SCHED_OTHER]
    assert _policy(tid) == os.SCHED_IDLE
    copier.shutdown()
    monkeypatch.setenv("BAFT_BACKGROUND_PRIORITY", "worker")  # the copy thread keeps normal
    copier = ThreadCopy()
    assert _policy(copier._native_id) == os.SCHED_OTHER
    copier.shutdown()
