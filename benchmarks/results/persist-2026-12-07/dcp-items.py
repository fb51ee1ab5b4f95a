"""What one DCP save of a baft-sized state costs in the writer's CPU, by how it is handed over.

148 MiB in 340 tensors, plus torch's flattened ``param_groups`` of 85 parameters x 11
hyperparameters (935 plain values, a dozen distinct), saved with ``dcp.save`` in one
process (no training beside it), four times each way:

- ``flat``: one top-level key per entry (what baft handed DCP before 2026-12-07);
- ``nested``: grouped by first key part (``baft.store.dcp_state.nested_by_head``);
- ``nested+memo``: and each distinct plain value serialized once
  (``baft.store.dcp_state.SavePlanner``);
- ``tensors only``: no ``param_groups`` (what the bench's ``dcp-async`` saves).

Run: ``.venv/bin/python benchmarks/results/persist-2026-12-07/dcp-items.py``
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from baft.store.dcp_state import SavePlanner, nested_by_head

HYPERS = {
    "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
    "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
    "fused": None, "decoupled_weight_decay": True,
}  # fmt: skip


def save(state: dict[str, Any], where: Path, planner: Any) -> tuple[float, float]:
    shutil.rmtree(where, ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    writer = dcp.FileSystemWriter(where, single_file_per_rank=True, sync_files=True)
    dcp.save(state, storage_writer=writer, no_dist=True, planner=planner)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    per = 148 * 2**20 // 4 // 340
    tensors = {f"model.t{i}": torch.randn(per) for i in range(340)}
    groups = {f"optimizer.param_groups.p{i}.{k}": v for i in range(85) for k, v in HYPERS.items()}
    flat = {**tensors, **groups}
    ways = [
        ("flat", lambda: flat, lambda: None),
        ("nested", lambda: nested_by_head(flat), lambda: None),
        ("nested+memo", lambda: nested_by_head(flat), SavePlanner),
        ("tensors only", lambda: tensors, lambda: None),
    ]
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for rep in range(4):
            for name, state, planner in ways:
                wall, cpu = save(state(), Path(tmp) / name.replace(" ", "_"), planner())
                print(f"round {rep}: {name:13s} wall {wall:.3f} s  cpu {cpu:.3f} s")


if __name__ == "__main__":
    main()
