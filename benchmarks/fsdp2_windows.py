"""Where an FSDP2 x PP iteration waits: pipeline p2p against FSDP2's collectives (issue 30).

baft schedules checkpoint work into the waits it can see: the pipeline's sends and
receives (slots of the wrapped schedule) and the DP all-reduce it issues itself. FSDP2
adds its own collectives inside forward and backward: the parameter all-gathers and the
gradient reduce-scatters. This script measures, per rank, how long an iteration of
``examples/fsdp2_pipeline.py``'s model spends in each (torch.profiler's ``FSDP::*`` and
``gloo:*`` ranges, training thread), without baft, to decide whether FSDP2's waits are
windows worth scheduling into.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 \\
        benchmarks/fsdp2_windows.py --iterations 20 > windows.jsonl

One JSON line per rank: seconds per iteration of each kind of wait.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.profiler import ProfilerActivity, profile

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_pipeline.py"

KINDS = {
    "pipeline p2p (gloo send/recv)": ("gloo:send", "gloo:recv"),
    "FSDP2 all-gather (forward)": ("FSDP::all_gather",),
    "FSDP2 reduce-scatter (backward)": ("FSDP::post_backward_reduce",),
}
"""What is summed: events named so, or so plus a module (``FSDP::all_gather (layers.0)``)."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4)
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("fsdp2_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh(
        "cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp_shard")
    )
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    model = ex.stage_model(pp, 2)
    ex.parallelize(model, mesh)
    stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    loss = nn.functional.cross_entropy
    schedule = Schedule1F1B(stage, n_microbatches=a.microbatches, loss_fn=loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = ex.Sampler(dp, mesh["dp_shard"].size())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ex.DATASET, ex.WIDTH, generator=g)
    y = torch.randint(0, ex.CLASSES, (ex.DATASET,), generator=g)

    def iteration() -> None:
        index = sampler.next_batch()
        opt.zero_grad()
        schedule.step(x[index]) if pp == 0 else schedule.step(target=y[index])
        opt.step()

    for _ in range(3):  # warm-up (FSDP2's lazy init, shape inference)
        iteration()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.iterations):
            iteration()
        per_iteration = (time.perf_counter() - t0) / a.iterations
    spent = dict.fromkeys(KINDS, 0.0)
    for e in prof.key_averages():
        for kind, prefixes in KINDS.items():
            if any(e.key == n or e.key.startswith(f"{n} (") for n in prefixes):
                spent[kind] += e.cpu_time_total / 1e6 / a.iterations
    row = {"rank": dist.get_rank(), "pp": pp, "iteration_s": per_iteration, **spent}
    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
