"""148 MiB saved six times back to back, no training: baft's Persister against
``dcp.async_save`` (one overwritten directory) and ``dcp.save`` (a new directory per
version, pruned two back). Run: ``.venv/bin/python <this file>`` (one process, no_dist)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from baft.store.disk import Persister

N = 6
BASE = Path("/tmp/baft-persist-standalone")


def per_save(start: float) -> str:
    return f"{(time.perf_counter() - start) / N:.3f} s per save"


def main() -> None:
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(148 * 2**20 // 4 // 60) for i in range(60)}  # ~148 MiB
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir()
    persister = Persister(BASE / "baft", rank=0, keep_latest=2)
    t = time.perf_counter()
    for v in range(N):
        persister.save_async(v, state).wait(120)
    print("baft Persister:", per_save(t))
    t = time.perf_counter()
    for _ in range(N):
        writer = dcp.FileSystemWriter(BASE / "dcp", sync_files=True, overwrite=True)
        dcp.async_save(state, storage_writer=writer, no_dist=True).result()
    print("dcp.async_save (one dir, overwrite):", per_save(t))
    t = time.perf_counter()
    for v in range(N):
        writer = dcp.FileSystemWriter(
            BASE / f"v{v}", single_file_per_rank=True, sync_files=True, overwrite=True
        )
        dcp.save(state, storage_writer=writer, no_dist=True)
        if v >= 2:
            shutil.rmtree(BASE / f"v{v - 2}")
    print("dcp.save (new dir per version, prune 2 back):", per_save(t))
    shutil.rmtree(BASE, ignore_errors=True)


if __name__ == "__main__":
    main()
