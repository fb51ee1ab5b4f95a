"""Start-up measurement: time this machine's checkpoint cost model in ~1-3 s.

``measure_cost_model()`` returns bytes per second for the checkpoint primitives the
planner schedules (snapshot copy into pre-faulted shared memory, XOR parity encoding,
torch.save + fsync, xxh3 hashing) and ``interference``: the relative slowdown of a
single-threaded compute loop while another process streams memory (bubble CPU is not
free: the copy competes for memory bandwidth). ``net_Bps`` is measured by the transport.

All numbers are medians of a few repeats with one intra-op thread, like a trainer rank.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import xxhash

COST_KEYS: tuple[str, ...] = (
    "copy_Bps",
    "encode_Bps",
    "persist_Bps",
    "hash_Bps",
    "interference",
    "interference_wall",
)
"""Keys of ``measure_cost_model``'s result (the last two only when measured)."""

_HOG = """
import sys, time
import numpy as np
src = np.ones(16 << 20, dtype=np.float64)  # 128 MiB each: well past any private cache
dst = np.zeros_like(src)
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    np.copyto(dst, src)
"""


def _median_s(fn: Callable[[], object], repeats: int, *, warmup: bool = True) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls (after one untimed call)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops with one intra-op thread, as a trainer rank does."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextmanager
def shm_buffer(nbytes: int, directory: str | Path | None = None) -> Iterator[np.ndarray]:
    """A pre-faulted uint8 memmap over a temporary file in /dev/shm (or ``directory``)."""
    base = Path(directory) if directory is not None else Path("/dev/shm")
    if not base.is_dir():
        base = Path(tempfile.gettempdir())
    fd, name = tempfile.mkstemp(prefix="baft-calib-", dir=base)
    os.close(fd)
    try:
        buf = np.memmap(name, dtype=np.uint8, mode="w+", shape=(nbytes,))
        buf.fill(1)  # touch every page now, not inside the timed copy
        yield buf
        del buf
    finally:
        os.unlink(name)


def _persist_s(src: torch.Tensor, repeats: int, persist_dir: str | Path | None) -> float:
    """Median seconds of torch.save of ``src`` to a fresh file plus flush and fsync."""
    with tempfile.TemporaryDirectory(prefix="baft-calib-", dir=persist_dir) as tmp:
        counter = iter(range(repeats + 1))

        def save() -> None:
            with open(Path(tmp) / f"{next(counter)}.pt", "wb") as f:
                torch.save(src, f)
                f.flush()
                os.fsync(f.fileno())

        return _median_s(save, repeats, warmup=False)


def measure_throughputs(
    nbytes: int = 32 << 20,
    *,
    repeats: int = 3,
    persist_dir: str | Path | None = None,
    shm_dir: str | Path | None = None,
    persist_nbytes: int | None = None,
) -> dict[str, float]:
    """``copy_Bps``, ``encode_Bps``, ``persist_Bps``, ``hash_Bps`` for ``nbytes`` buffers.

    ``encode_Bps`` counts the bytes of one operand of a two-operand XOR into a
    preallocated output; ``persist_Bps`` writes ``persist_nbytes`` (default ``nbytes``)
    to ``persist_dir`` (default: the temp dir). Snapshots stream from memory: a buffer
    that stays in a cache between repeats measures the cache (here 8 MiB copied at
    11-14 GB/s, 32 MiB and more at 6.8 GB/s).
    """
    if nbytes < 8 or nbytes % 8:
        raise ValueError(f"nbytes={nbytes} must be a positive multiple of 8, e.g. 32 << 20")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    with _one_thread(), shm_buffer(nbytes, shm_dir) as shm:
        # its own generator: the calibration runs on the training thread of rank 0, and a
        # draw from torch's global RNG would change the user's dropout from then on
        gen = torch.Generator().manual_seed(0)
        src = torch.rand(nbytes // 4, dtype=torch.float32, generator=gen)
        dst = torch.from_numpy(shm.view(np.float32))
        copy_s = _median_s(lambda: dst.copy_(src), repeats)
        a, b = shm.view(np.uint64), src.numpy().view(np.uint64)
        out = np.ones_like(a)  # ones_like writes every page: pre-faulted
        encode_s = _median_s(lambda: np.bitwise_xor(a, b, out=out), repeats)
        hash_s = _median_s(lambda: xxhash.xxh3_64_intdigest(shm.data), repeats)
        written = src[: (persist_nbytes or nbytes) // 4]
        persist_s = _persist_s(written, repeats, persist_dir)
    return {
        "copy_Bps": nbytes / copy_s,
        "encode_Bps": nbytes / encode_s,
        "persist_Bps": written.numel() * 4 / persist_s,
        "hash_Bps": nbytes / hash_s,
    }


def _compute_loop() -> Callable[[int], tuple[float, float]]:
    """A transformer-like MLP block (layer norm, 256->1024->256, GELU, residual) on 512
    tokens, forward+backward in float32 (activations spill L2, like a real block):
    ``run(num_steps) -> (wall s, CPU s)``."""
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(256, 1024, generator=gen).div_(16).requires_grad_()
    w2 = torch.randn(1024, 256, generator=gen).div_(32).requires_grad_()
    x = torch.randn(512, 256, generator=gen)

    def run(num_steps: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(num_steps):
            hidden = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (256,)) @ w1)
            loss = (x + hidden @ w2).square().mean()
            loss.backward()
        return time.perf_counter() - wall, time.thread_time() - cpu

    return run


class _MemoryHog:
    """Another process copying 64 MiB arrays in a loop; ``pause()``/``resume()`` it."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> _MemoryHog:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOG, str(self.max_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.__exit__()
            raise RuntimeError("the memory-copy helper process failed to start")
        return self

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()  # SIGKILL also ends a stopped process
            self.proc.wait(timeout=10)
            self.proc = None


def measure_interference(*, num_runs: int = 7, run_s: float = 0.03) -> tuple[float, float]:
    """Relative slowdown (0.4 = 40% slower) of a compute loop while another process copies.

    Returns ``(wall, cpu)``: the slowdown in wall-clock time (what a rank feels: memory
    bandwidth plus competition for cores) and in the loop's own CPU time (memory
    bandwidth only; barely moved by other load on the machine). Runs alternate between
    the copying process paused and running, so outside load drifts into both alike;
    each value is the median of the per-pair ratios minus one, clamped at 0.
    """
    if num_runs < 1 or run_s <= 0:
        raise ValueError(f"num_runs={num_runs} must be >= 1 and run_s={run_s} > 0")
    with _one_thread():
        run = _compute_loop()
        run(3)  # warm-up: allocator, autograd graph
        num_steps = max(1, round(run_s / max(run(5)[0] / 5, 1e-6)))
        wall_ratios, cpu_ratios = [], []
        with _MemoryHog(max_s=30.0) as hog:
            for _ in range(num_runs):
                hog.pause()
                alone = run(num_steps)
                hog.resume()
                time.sleep(0.002)  # let the copier get back on a core
                loaded = run(num_steps)
                wall_ratios.append(loaded[0] / max(alone[0], 1e-9))
                cpu_ratios.append(loaded[1] / max(alone[1], 1e-9))
    wall = max(0.0, statistics.median(wall_ratios) - 1.0)
    return wall, max(0.0, statistics.median(cpu_ratios) - 1.0)


def measure_cost_model(
    nbytes: int = 32 << 20,
    *,
    repeats: int = 3,
    interference: bool = True,
    persist_dir: str | Path | None = None,
    persist_nbytes: int | None = None,
) -> dict[str, float]:
    """Measure the cost model: the four ``*_Bps`` throughputs and ``interference``.

    ``interference`` is the memory-bandwidth slowdown of compute next to a memory copier
    (CPU-time based, what ``CostModel.interference`` means) and ``interference_wall``
    the wall-clock slowdown, which adds competition for cores (see ``measure_interference``).
    ``interference=False`` skips that measurement (about 0.5 s and a helper process);
    both keys are then absent, so the caller picks its own default.
    """
    result = measure_throughputs(
        nbytes, repeats=repeats, persist_dir=persist_dir, persist_nbytes=persist_nbytes
    )
    if interference:
        wall, cpu = measure_interference()
        result["interference"], result["interference_wall"] = cpu, wall
    return result


if __name__ == "__main__":
    began = time.perf_counter()
    measured = measure_cost_model()
    for key, value in measured.items():
        shown = f"{value / 2**30:8.2f} GiB/s" if key.endswith("_Bps") else f"{value:8.1%}"
        print(f"{key:>13}: {shown}")
    print(f"{'took':>13}: {time.perf_counter() - began:8.2f} s")
