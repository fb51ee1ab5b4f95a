import time, shutil, sys
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from baft.store.disk import Persister
torch.manual_seed(0)
state = {f"t{i}": torch.randn(148 * 2**20 // 4 // 60) for i in range(60)}  # ~148 MiB in 60 tensors
base = Path("/tmp/ck/pers"); shutil.rmtree(base, ignore_errors=True); base.mkdir()
N = 6
p = Persister(base / "baft", rank=0, keep_latest=2)
t = time.perf_counter()
for v in range(N):
    p.save_async(v, state).wait(120)
print(f"baft Persister: {(time.perf_counter() - t) / N:.3f} s per save")
t = time.perf_counter()
for v in range(N):
    f = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(base / "dcp", sync_files=True, overwrite=True), no_dist=True)
    f.result()
print(f"dcp.async_save (one dir, overwrite): {(time.perf_counter() - t) / N:.3f} s per save")
t = time.perf_counter()
for v in range(N):
    d = base / f"dcpv{v}"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(d, single_file_per_rank=True, sync_files=True, overwrite=True), no_dist=True)
    if v >= 2: shutil.rmtree(base / f"dcpv{v-2}")
print(f"dcp.save (new dir per version, prune 2 back): {(time.perf_counter() - t) / N:.3f} s per save")
