"""Simulator vs real CPU runs: per-rank blocked time predicted from measured stage times.

    .venv/bin/python benchmarks/sim_vs_measured.py [--iterations 14]

For each layout one real `baft train --no-checkpoint --dp 1` launch (2 ranks unless
stated); from its timelines: median forward and backward seconds of each stage's
microbatch, median optimizer seconds and the median gap between a sender's compute and
the receiver's start (p2p). Those feed ``baft.sim.simulate``; its per-rank blocked
seconds are compared with the measured medians (iterations 4..end).
Writes benchmarks/results/sim-vs-measured-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from baft.config import ModelConfig, ParallelConfig, TrainConfig
from baft.profile.timeline import read_timelines
from baft.sim.simulator import StageTimes, simulate
from baft.train.launch import launch

LAYOUTS = [("1f1b", 2, 4), ("1f1b", 2, 8), ("gpipe", 2, 8), ("1f1b", 4, 8)]


def stage_times(run: Path, pp: int) -> tuple[StageTimes, list[float]]:
    records = read_timelines(run)
    fwd: dict[int, list[float]] = {s: [] for s in range(pp)}
    bwd: dict[int, list[float]] = {s: [] for s in range(pp)}
    opt: list[float] = []
    blocked: dict[int, list[float]] = {r: [] for r in records}
    for rank, recs in records.items():
        for rec in recs[4:]:
            blocked[rank].append(sum(e.duration for e in rec.events if e.cat == "wait"))
            for e in rec.events:
                if e.name == "F" and e.stage is not None:
                    fwd[e.stage].append(e.duration)
                elif e.name == "B" and e.stage is not None:
                    bwd[e.stage].append(e.duration)
                elif e.name == "optimizer":
                    opt.append(e.duration)
    # Time on a rank that is neither compute nor wait (the loss on the last stage, Python
    # between actions, splitting microbatches) is on the critical path too: spread it
    # over that stage's microbatches, as part of the forward (where the loss sits).
    m = sum(1 for e in records[0][-1].events if e.name == "F")
    extra = {
        r: statistics.median(
            rec.iter_s - sum(e.duration for e in rec.events if e.cat in ("compute", "wait"))
            for rec in recs[4:]
        )
        / max(1, m)
        for r, recs in records.items()
    }
    times = StageTimes(
        forward_s=tuple(statistics.median(fwd[s]) + extra[s] for s in range(pp)),
        backward_s=tuple(statistics.median(bwd[s]) for s in range(pp)),
        optimizer_s=statistics.median(opt),
        p2p_s=_p2p_latency(records),
    )
    return times, [statistics.median(blocked[r]) for r in sorted(blocked)]


def _p2p_latency(records: dict) -> float:
    """Median delay from a forward's end on rank r to the end of rank r+1's wait for it."""
    gaps = []
    for rank in sorted(records)[:-1]:
        for sender, receiver in zip(records[rank][4:], records[rank + 1][4:], strict=False):
            ends = {e.mb: sender.t0 + e.end for e in sender.events if e.name == "F"}
            evs = list(receiver.events)
            for k, e in enumerate(evs):
                if e.name == "F" and e.mb in ends and k and evs[k - 1].cat == "wait":
                    gap = receiver.t0 + evs[k - 1].end - ends[e.mb]
                    if 0 <= gap < 0.01:
                        gaps.append(gap)
    return statistics.median(gaps) if gaps else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iterations", type=int, default=14)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, pp, m in LAYOUTS:
            out = Path(tmp) / f"{schedule}-{pp}-{m}"
            cfg = TrainConfig(
                model=ModelConfig(num_layers=8, d_model=128),
                parallel=ParallelConfig(num_dp=1, num_pp=pp, schedule=schedule, num_microbatches=m),
                num_iterations=a.iterations,
                global_batch=4 * m,
                out_dir=str(out),
            )
            assert launch(cfg, quiet=True) == 0
            times, measured = stage_times(out, pp)
            sim = simulate(schedule, pp, m, times)
            # The simulator ends every iteration at a global barrier before the optimizer
            # step (gradient-norm all-reduce, as in torchtitan/Megatron); baft's trainer
            # has none with dp=1, so that wait is not part of the measured blocked time.
            barrier = {
                r: sum(x.idle_s for x in sim.slots[r] if x.slot_id == "pre_step") for r in range(pp)
            }
            predicted = [sim.blocked_s[r] - barrier[r] for r in range(pp)]
            row = {
                "schedule": schedule,
                "pp": pp,
                "m": m,
                "measured_blocked_ms": [round(x * 1e3, 2) for x in measured],
                "simulated_blocked_ms": [round(x * 1e3, 2) for x in predicted],
                "error": [
                    round((s - x) / x, 3) if x else None
                    for s, x in zip(predicted, measured, strict=True)
                ],
                "fwd_ms": [round(x * 1e3, 2) for x in times.forward_s],  # type: ignore[union-attr]
                "bwd_ms": [round(x * 1e3, 2) for x in times.backward_s],  # type: ignore[union-attr]
                "p2p_ms": round(times.p2p_s * 1e3, 3),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    date = dt.date.today().isoformat()
    lines = [
        f"# Simulator vs measured blocked time — {date}",
        "",
        f"- machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo; "
        f"command: `.venv/bin/python benchmarks/sim_vs_measured.py --iterations {a.iterations}`",
        "- model: GPT 8 layers, d_model 128, seq 64, 4 sequences per microbatch, dp=1",
        "- simulated blocked time excludes the simulator's pre-step global barrier "
        "(baft's trainer has none at dp=1)",
        "- simulator input: measured median F/B seconds per stage (F plus the per-microbatch time that is neither compute nor wait, e.g. the loss), optimizer seconds, and the median forward p2p latency (sender F end -> receiver wait end)",
        "- pp=4 runs 4 processes on 2 cores (oversubscribed): compute times there include contention",
        "",
        "| schedule | pp | m | measured blocked ms per rank | simulated | relative error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = " / ".join("n/a" if e is None else f"{e:+.0%}" for e in r["error"])
        lines.append(
            f"| {r['schedule']} | {r['pp']} | {r['m']} | {r['measured_blocked_ms']} | "
            f"{r['simulated_blocked_ms']} | {err} |"
        )
    lines += ["", "Raw:", "```json", json.dumps(rows, indent=1), "```", ""]
    path = Path(a.out) / f"sim-vs-measured-{date}.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
