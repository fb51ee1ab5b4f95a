"""Where the time of elastic replicas' deterministic reduction goes, step by step, next to
the plain all-reduce (a diagnostic beside ``baft bench reduction``; no CIs).

Each rank holds one pipeline stage's gradient of the overhead bench's default model
(``baft_bench.reduction``'s gradients) and repeats, after a barrier each: the steps of
``VirtualReplicas._reduce`` with one replica per rank (cat into a fresh flat tensor, the
all-gather into a fresh output, clone, add, divide, copy back), the same all-gather into
an output reused every time, and the all-reduce of a fresh cat and of a reused buffer.
Rank 0 prints the median milliseconds of each step over the repetitions (the first two
left out) as a markdown table. Run it the way the bench runs its workers::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 OMP_NUM_THREADS=1 \\
      python -m torch.distributed.run --standalone --nproc-per-node=2 \\
      benchmarks/reduction_steps.py [REPS]
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate

import torch
import torch.distributed as dist

from baft_bench.reduction import ReductionConfig, replica_grads, stage_shapes


def main(reps: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    grads = replica_grads(stage_shapes(ReductionConfig(), 0), 0, 0, rank)
    n = sum(g.numel() for g in grads)
    offsets = [0, *accumulate(g.numel() for g in grads)][:-1]
    reused = torch.zeros(world * n)
    times: dict[str, list[float]] = {}

    @contextmanager
    def step(name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        times.setdefault(name, []).append(time.perf_counter() - start)

    for _ in range(reps):
        dist.barrier()
        with step("cat into a fresh G"):
            flat = torch.cat([g.reshape(-1) for g in grads])
        every = torch.empty(world * n)
        with step(f"all_gather_into_tensor into a fresh {world} G"):
            dist.all_gather_into_tensor(every, flat)
        with step("clone G (the sum's first term)"):
            acc = every[:n].clone()
        for r in range(1, world):
            with step("add G (per further replica)"):
                acc += every[r * n : (r + 1) * n]
        with step("divide G"):
            acc.div_(world)
        with step("copy back into the gradients"):
            for o, g in zip(offsets, grads, strict=True):
                g.copy_(acc[o : o + g.numel()].view_as(g))
        dist.barrier()
        with step(f"all_gather_into_tensor into a reused {world} G"):
            dist.all_gather_into_tensor(reused, flat)
        dist.barrier()
        fresh = torch.cat([g.reshape(-1) for g in grads])
        with step("all_reduce of a fresh cat (G)"):
            dist.all_reduce(fresh)
        dist.barrier()
        with step("all_reduce of a reused G"):
            dist.all_reduce(reused[:n])
    if rank == 0:
        print(f"{world} ranks, G = {n * 4 / 2**20:.1f} MiB, median of {reps - 2} repetitions\n")
        print("| step | ms (rank 0) |\n|---|---|")
        for name, values in times.items():
            print(f"| {name} | {statistics.median(values[2:]) * 1e3:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
