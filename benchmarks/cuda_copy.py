"""The CUDA snapshot copy on a real GPU: does it cost the host and the compute nothing?

baft's CUDA seam (:class:`baft.engine.device.CudaCopy`) copies live device tensors into
pinned host memory on a side stream, ordered after the compute stream, and the host
never waits for it until the step deadline. This measures, on one GPU:

- ``start_ms``: host time of ``CudaCopy.start`` for the whole state, one chunk per
  tensor (the training thread's only cost: it must be far below the copy itself);
- ``copied_ms``: until the copies landed (GB/s into shared memory registered with
  ``cudaHostRegister``, as the store's slots are, and into ``pin_memory`` tensors);
  ``hashed_ms``: until the copier's hash threads had hashed every chunk;
- bf16 matrix products alone, then with the copy running beside them (their slowdown is
  what a copy in a bubble-free stretch would cost);
- the host's xxh3 pass over the copied bytes (the reader's checksum on CUDA, GB/s) on
  1, 4 and 8 threads;
- the bytes: the host copy equals the device tensors.

Run (prints one JSON object): ``python benchmarks/cuda_copy.py --gib 2``. On a machine
without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from baft.engine.device import CudaCopy, HostPins, hash_threads


def _shm_buffer(nbytes: int, pins: HostPins) -> tuple[torch.Tensor, mmap.mmap]:
    """A host buffer in /dev/shm like a store slot, registered with CUDA."""
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="baft-cuda-copy-")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    if not pins.pin(t):
        raise RuntimeError("cudaHostRegister refused the shared-memory buffer")
    return t, mm


def _time_matmuls(a: torch.Tensor, b: torch.Tensor, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        a @ b
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="state size to snapshot (GiB)")
    p.add_argument("--tensors", type=int, default=64, help="tensors the state is cut into")
    p.add_argument("--matmul", type=int, default=8192, help="square bf16 matmul size")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False}))
        return 0
    dev = torch.device("cuda", 0)
    total = int(args.gib * (1 << 30))
    per = total // args.tensors // 4 * 4
    state = [torch.randn(per // 4, device=dev) for _ in range(args.tensors)]
    srcs = [t.view(torch.uint8) for t in state]
    nbytes = per * args.tensors
    out: dict[str, object] = {
        "cuda": True,
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "state_bytes": nbytes,
        "tensors": args.tensors,
    }
    pins = HostPins()
    shm, mm = _shm_buffer(nbytes, pins)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copier = CudaCopy(dev)

    def pairs(host: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(host[i * per : (i + 1) * per], s) for i, s in enumerate(srcs)]

    for name, host in (("shm_registered", shm), ("pin_memory", pinned)):
        best: dict[str, float] = {}
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            chunks = [copier.start([pair]) for pair in pairs(host)]  # one chunk per tensor
            t1 = time.perf_counter()
            copier.synchronize()  # the step deadline: copies landed
            t2 = time.perf_counter()
            for c in chunks:  # hashed on the copier's hash threads
                c.wait(60.0)
            t3 = time.perf_counter()
            for key, value in (
                ("start_ms", (t1 - t0) * 1e3),
                ("copied_ms", (t2 - t0) * 1e3),
                ("hashed_ms", (t3 - t0) * 1e3),
            ):
                best[key] = min(best.get(key, float("inf")), value)
        out[f"copy_{name}"] = {
            **{k: round(v, 3) for k, v in best.items()},
            "copy_gb_per_s": round(nbytes / best["copied_ms"] / 1e6, 2),
            "hash_threads": hash_threads(),
            "checksums_right": all(
                c.checksum == xxhash.xxh3_64_intdigest(d.numpy().data)
                for c, (d, _) in zip(chunks, pairs(host), strict=True)
            ),
        }
    expect = torch.cat([s.cpu() for s in srcs])
    out["bytes_equal"] = bool(torch.equal(shm, expect) and torch.equal(pinned, expect))

    a = torch.randn(args.matmul, args.matmul, device=dev, dtype=torch.bfloat16)
    b = torch.randn(args.matmul, args.matmul, device=dev, dtype=torch.bfloat16)
    _time_matmuls(a, b, 3)  # warm-up
    n = 20
    alone = min(_time_matmuls(a, b, n) for _ in range(3))
    beside = []
    for _ in range(3):
        torch.cuda.synchronize()
        chunks = [copier.start([p]) for p in pairs(shm)]  # copies on the side stream ...
        beside.append(_time_matmuls(a, b, n))  # ... while the compute stream multiplies
        for c in chunks:
            c.wait(60.0)
    flops = 2 * args.matmul**3 * n
    out["matmul_ms_alone"] = round(alone, 2)
    out["matmul_ms_with_copy"] = round(min(beside), 2)
    out["matmul_slowdown"] = round(min(beside) / alone, 4)
    out["tflops_alone"] = round(flops / alone / 1e9, 1)

    arr = shm.numpy()
    for threads in (1, 4, 8):  # xxhash releases the GIL: chunks hash in parallel
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda i: xxhash.xxh3_64_intdigest(arr[i * per : (i + 1) * per].data),
                          range(args.tensors)))  # fmt: skip
            out[f"host_xxh3_gb_per_s_{threads}_threads"] = round(
                nbytes / (time.perf_counter() - t0) / 1e9, 2
            )
    copier.shutdown()
    pins.release()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
