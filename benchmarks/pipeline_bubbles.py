"""Measured per-rank blocked fraction of real 1F1B runs next to the analytic bubble.

    .venv/bin/python benchmarks/pipeline_bubbles.py [--iterations 14] [--out benchmarks/results]

For pp in {2, 4} and microbatches in {4, 8}: one `baft train --no-checkpoint --dp 1`
launch each, medians over the iterations after warm-up (the first 4 are dropped), and
the analytic bubble fraction (p-1)/(m+p-1). pp=4 runs 4 processes on this 2-core box,
so its waits are partly CPU contention (see shared/reference/cpu-measurements.md).
Writes benchmarks/results/pipeline-bubbles-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from baft.model.config import ModelConfig
from baft.train.config import ParallelConfig, TrainConfig
from baft.train.launch import launch


def measure(pp: int, m: int, iterations: int, out: Path) -> dict:
    cfg = TrainConfig(
        model=ModelConfig(num_layers=8, d_model=128),
        parallel=ParallelConfig(num_dp=1, num_pp=pp, schedule="1f1b", num_microbatches=m),
        num_iterations=iterations,
        global_batch=4 * m,
        out_dir=str(out),
    )
    assert launch(cfg, quiet=True) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][4:]
    iter_s = statistics.median(r["iter_s"] for r in rows)
    fractions = [
        statistics.median(r["blocked_s"][k] / r["iter_s"] for r in rows) for k in range(pp)
    ]
    return {
        "pp": pp,
        "m": m,
        "iter_s": iter_s,
        "blocked_fraction": fractions,
        "analytic": (pp - 1) / (m + pp - 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iterations", type=int, default=14)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp in (2, 4):
            for m in (4, 8):
                r = measure(pp, m, a.iterations, Path(tmp) / f"pp{pp}m{m}")
                print(json.dumps(r), flush=True)
                results.append(r)
    date = dt.date.today().isoformat()
    lines = [
        f"# Pipeline bubbles: measured vs analytic (1F1B) — {date}",
        "",
        f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, gloo",
        f"- command: `.venv/bin/python benchmarks/pipeline_bubbles.py --iterations {a.iterations}`",
        "- model: GPT 8 layers, d_model 128, seq 64, batch 4 sequences per microbatch; dp=1",
        "- blocked fraction = time a rank spent blocked in pipeline waits / iteration time, "
        "median over iterations 4..end; analytic = (p-1)/(m+p-1)",
        "- pp=4 runs 4 processes on 2 cores: its waits include CPU contention",
        "",
        "| pp | microbatches | median iteration (ms) | blocked fraction per rank | analytic |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        fr = " / ".join(f"{x:.1%}" for x in r["blocked_fraction"])
        lines.append(
            f"| {r['pp']} | {r['m']} | {r['iter_s'] * 1e3:.1f} | {fr} | {r['analytic']:.1%} |"
        )
    lines += ["", "Raw:", "```json", json.dumps(results, indent=1), "```", ""]
    path = Path(a.out) / f"pipeline-bubbles-{date}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
