"""How long the pure planner takes at cluster scale (the issue asks 4096 ranks under 1 s).

    .venv/bin/python benchmarks/planner_speed.py [--repeats 7] [--out benchmarks/results]

For each preset layout: simulate the schedule once, take its BubbleMaps, StateLayouts and
the coding module's redundancy transfers (default policy: xor:2, a checkpoint every
iteration), then time ``baft.plan.plan`` alone ``--repeats`` times and report the median
and the range. The inputs are the ones ``baft simulate`` plans. Writes
benchmarks/results/planner-speed-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

from baft.plan import CheckpointPolicy, owned_ranges, plan
from baft.sim.command import _cost, _sim, _transfers
from baft.sim.presets import build_scenario, layouts

CASES = [
    ("llama2-34b", "h100", 512),
    ("llama2-70b", "h100", 4096),
    ("gpt3-175b", "h100", 4096),
    ("gpt3-175b", "a100", 4096),
]


def measure(model: str, hardware: str, gpus: int, repeats: int) -> dict:
    scn = build_scenario(model, hardware, gpus)
    bubbles = _sim(scn).bubble_maps(scn.topology)
    lays = layouts(scn)
    cost = _cost(scn, 2e9)
    policy = CheckpointPolicy()
    shards = {r: b - a for r, (a, b) in owned_ranges(bubbles, lays, cost, policy).items()}
    transfers = _transfers(scn, policy, shards)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = plan(bubbles, lays, cost, policy, transfers)
        times.append(time.perf_counter() - t0)
    tasks = sum(len(ts) for rp in p.ranks.values() for ts in rp.tasks.values())
    tasks += sum(len(rp.spilled) for rp in p.ranks.values())
    topo = scn.topology
    return {
        "model": model,
        "hardware": hardware,
        "ranks": len(p.ranks),
        "layout": f"dp{topo.num_dp} pp{topo.num_pp} tp{topo.num_tp}",
        "slots_per_rank": max(len(b.slots) for b in bubbles.values()),
        "tensors_per_rank": max(len(lay.tensors) for lay in lays.values()),
        "tasks": tasks,
        "exposed_ms": p.exposed_s * 1e3,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "times_s": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    results = []
    for model, hw, gpus in CASES:
        r = measure(model, hw, gpus, a.repeats)
        print(json.dumps({k: v for k, v in r.items() if k != "times_s"}), flush=True)
        results.append(r)
    date = dt.date.today().isoformat()
    lines = [
        f"# Planner run time at cluster scale — {date}",
        "",
        f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()} (one core used; shared, noisy box)",
        f"- command: `.venv/bin/python benchmarks/planner_speed.py --repeats {a.repeats}`",
        "- what is timed: `baft.plan.plan(bubbles, layouts, cost, policy, transfers)` only, "
        "on the simulator's BubbleMaps for the preset (default layout, 1F1B), xor:2 "
        "redundancy transfers, a checkpoint every iteration",
        "- tasks: planned SNAPSHOT + SEND tasks over all ranks (identical ranks share them)",
        "",
        "| preset | ranks | layout | slots/rank | tensors/rank | tasks | median s | min-max s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} on {r['hardware']} | {r['ranks']} | {r['layout']} | "
            f"{r['slots_per_rank']} | {r['tensors_per_rank']} | {r['tasks']:,} | "
            f"{r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} |"
        )
    lines += ["", "Raw:", "```json", json.dumps(results, indent=1), "```", ""]
    path = Path(a.out) / f"planner-speed-{date}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
