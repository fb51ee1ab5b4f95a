"""Simulator vs real CPU runs: per-rank blocked time predicted from measured compute.

    .venv/bin/python benchmarks/sim_vs_measured.py [--iterations 30] [--compute real]

For each layout one real `baft train --no-checkpoint --dp 1` launch (2 ranks unless
stated). From its timelines (iterations 4..end) every F and B of every rank gets its busy
time: from the compute's start to the rank's next event (the Python, loss and send
posting after a compute are on the critical path too; the time before a rank's first
action is added to it). Two predictions of each rank's blocked seconds:

- **median inputs**: one forward and one backward time per stage (medians), the median
  optimizer time and the median transfer time (from when both ends were ready to the end
  of the receiver's wait: transfers rendezvous). This is what the cluster presets do.
- **trace replay**: each measured iteration's own per-action busy times
  (``StageTimes.per_action``) and the ranks' start skew (``StageTimes.start_s``),
  simulated one by one; the median over iterations. Waits
  are ``max(0, producer late)``, so timing noise adds idle on average (Jensen): medians
  in, medians out under-predicts; the replay shows the schedule model is right.
- **sampled**: 200 simulated iterations whose per-action times are drawn independently
  from each stage's measured distribution (and the start skew from the measured ones);
  the median. A prediction from distributions, not from the iterations' own traces.

``--compute emulated`` runs the same layouts with timed-sleep compute (10 ms F, 20 ms B
per microbatch): then 4 processes on 2 cores do not fight over the CPU.
Writes benchmarks/results/sim-vs-measured-<date>.md (or -emulated-<date>.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

import torch

from baft.model.config import ModelConfig
from baft.profile.timeline import IterationRecord, read_timelines
from baft.sim.simulator import StageTimes, simulate
from baft.train.config import ParallelConfig, TrainConfig
from baft.train.launch import launch

LAYOUTS = [("1f1b", 2, 4), ("1f1b", 2, 8), ("gpipe", 2, 8), ("1f1b", 4, 8)]
SKIP = 4
"""Warm-up iterations left out."""
SAMPLES = 200
"""Monte-Carlo iterations of the sampled prediction."""

Busy = dict[tuple[int, str, int], float]


def busy_times(rec: IterationRecord) -> tuple[Busy, float]:
    """Per action (stage, kind, mb) of one rank's iteration: seconds from its start to the
    rank's next event; and the optimizer seconds."""
    evs = sorted(rec.events, key=lambda e: e.start)
    out: Busy = {}
    opt = 0.0
    lead = 0.0
    first = True
    for k, e in enumerate(evs):
        if e.name == "optimizer":
            opt = e.duration
        if e.cat != "compute" or e.name not in ("F", "B") or e.stage is None or e.mb is None:
            continue
        nxt = evs[k + 1].start if k + 1 < len(evs) else e.end
        if first:  # time before the first action that is not a wait
            waits = sum(x.duration for x in evs[:k] if x.cat == "wait")
            lead = max(0.0, e.start - waits)
            first = False
        out[(e.stage, e.name, e.mb)] = nxt - e.start + lead
        lead = 0.0
    return out, opt


def transfer_s(records: dict[int, list[IterationRecord]]) -> float:
    """Median activation transfer: from when both ends were ready (sender's F ended, the
    receiver waiting) to the end of the receiver's wait."""
    gaps = []
    for rank in sorted(records)[:-1]:
        for sender, receiver in zip(records[rank][SKIP:], records[rank + 1][SKIP:], strict=False):
            ends = {e.mb: sender.t0 + e.end for e in sender.events if e.name == "F"}
            evs = list(receiver.events)
            for k, e in enumerate(evs):
                if e.name == "F" and e.mb in ends and k and evs[k - 1].cat == "wait":
                    wait = evs[k - 1]
                    gap = receiver.t0 + wait.end - max(ends[e.mb], receiver.t0 + wait.start)
                    if 0 <= gap < 0.01:
                        gaps.append(gap)
    return statistics.median(gaps) if gaps else 0.0


def _predict(schedule: str, pp: int, m: int, times: StageTimes) -> list[float]:
    sim = simulate(schedule, pp, m, times)
    # The simulator ends every iteration at a global barrier before the optimizer step
    # (gradient-norm all-reduce, as in torchtitan/Megatron); baft's trainer has none with
    # dp=1, so that wait is not part of the measured blocked time.
    return [
        sim.blocked_s[r] - sum(x.idle_s for x in sim.slots[r] if x.slot_id == "pre_step")
        for r in range(pp)
    ]


def compare(run: Path, schedule: str, pp: int, m: int) -> dict:
    records = read_timelines(run)
    iters = min(len(recs) for recs in records.values())
    measured = [
        statistics.median(
            sum(e.duration for e in rec.events if e.cat == "wait") for rec in records[r][SKIP:]
        )
        for r in range(pp)
    ]
    p2p = transfer_s(records)
    per_iter: list[Busy] = []
    starts: list[tuple[float, ...]] = []
    opts = []
    for i in range(SKIP, iters):
        merged: Busy = {}
        for r in range(pp):
            busy, opt = busy_times(records[r][i])
            merged.update(busy)
            opts.append(opt)
        per_iter.append(merged)
        t0 = min(records[r][i].t0 for r in range(pp))
        starts.append(tuple(records[r][i].t0 - t0 for r in range(pp)))
    # every stage's busy times of one kind, all iterations and microbatches pooled
    pooled = {
        (st, kind): [b[(st, kind, k)] for b in per_iter for k in range(m)]
        for st in range(pp)
        for kind in ("F", "B")
    }
    fwd = [statistics.median(pooled[(st, "F")]) for st in range(pp)]
    bwd = [statistics.median(pooled[(st, "B")]) for st in range(pp)]
    opt_s = statistics.median(opts)
    medians = _predict(
        schedule,
        pp,
        m,
        StageTimes(forward_s=tuple(fwd), backward_s=tuple(bwd), optimizer_s=opt_s, p2p_s=p2p),
    )

    def replay(traces: list[tuple[Busy, tuple[float, ...]]]) -> list[float]:
        """Median per rank of the predictions for (per-action times, start skew) traces."""
        preds = [
            _predict(
                schedule,
                pp,
                m,
                StageTimes(
                    forward_s=0.0,
                    backward_s=0.0,
                    optimizer_s=opt_s,
                    p2p_s=p2p,
                    per_action=busy,
                    start_s=start,
                ),
            )
            for busy, start in traces
        ]
        return [statistics.median(x[r] for x in preds) for r in range(pp)]

    traced = replay(list(zip(per_iter, starts, strict=True)))
    # Sampled: every action's busy time drawn independently from its stage's pooled
    # measured distribution, the start skew from the measured ones: a prediction from
    # distributions, not from the iterations' own traces.
    rng = random.Random(0)
    sampled = replay(
        [
            (
                {
                    (st, kind, k): rng.choice(pooled[(st, kind)])
                    for st in range(pp)
                    for kind in ("F", "B")
                    for k in range(m)
                },
                rng.choice(starts),
            )
            for _ in range(SAMPLES)
        ]
    )

    def err(pred: list[float]) -> list[float | None]:
        return [round((s - x) / x, 3) if x else None for s, x in zip(pred, measured, strict=True)]

    return {
        "schedule": schedule,
        "pp": pp,
        "m": m,
        "iterations": iters - SKIP,
        "measured_blocked_ms": [round(x * 1e3, 2) for x in measured],
        "median_inputs_ms": [round(x * 1e3, 2) for x in medians],
        "median_inputs_error": err(medians),
        "sampled_ms": [round(x * 1e3, 2) for x in sampled],
        "sampled_error": err(sampled),
        "trace_replay_ms": [round(x * 1e3, 2) for x in traced],
        "trace_replay_error": err(traced),
        "fwd_busy_ms": [round(x * 1e3, 2) for x in fwd],
        "bwd_busy_ms": [round(x * 1e3, 2) for x in bwd],
        "p2p_ms": round(p2p * 1e3, 3),
    }


def _fmt(errors: list[float | None]) -> str:
    return " / ".join("n/a" if e is None else f"{e:+.0%}" for e in errors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--compute", choices=("real", "emulated"), default="real")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, pp, m in LAYOUTS:
            out = Path(tmp) / f"{schedule}-{pp}-{m}"
            emulated = {"fwd": [0.01] * pp, "bwd": [0.02] * pp}
            cfg = TrainConfig(
                model=ModelConfig(num_layers=8, d_model=128),
                parallel=ParallelConfig(num_dp=1, num_pp=pp, schedule=schedule, num_microbatches=m),
                num_iterations=a.iterations,
                global_batch=4 * m,
                out_dir=str(out),
                compute=a.compute,
                emulated_times=emulated if a.compute == "emulated" else None,
            )
            assert launch(cfg, quiet=True) == 0
            row = compare(out, schedule, pp, m)
            print(json.dumps(row), flush=True)
            rows.append(row)
    date = dt.date.today().isoformat()
    suffix = "" if a.compute == "real" else "-emulated"
    compute = (
        "real (GPT 8 layers, d_model 128, seq 64, 4 sequences per microbatch)"
        if a.compute == "real"
        else "emulated: timed sleeps of 10 ms per F and 20 ms per B, real parameters and p2p"
    )
    lines = [
        f"# Simulator vs measured blocked time ({a.compute} compute) — {date}",
        "",
        f"- machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo; command: "
        f"`.venv/bin/python benchmarks/sim_vs_measured.py --iterations {a.iterations} "
        f"--compute {a.compute}`",
        f"- compute: {compute}; dp=1; medians over iterations {SKIP}..end",
        "- measured: per rank, the seconds blocked in pipeline waits per iteration (median)",
        "- median inputs: the simulator fed one median busy time per stage for F and for B "
        "(compute plus what follows it before the next event), the median optimizer time and "
        "the median rendezvous transfer time; what the cluster presets do",
        f"- sampled: {SAMPLES} simulated iterations, each action's busy time drawn from its "
        "stage's measured distribution and the start skew from the measured ones; median",
        "- trace replay: the simulator fed each measured iteration's own busy time per action "
        "and the ranks' start skew, median of the per-iteration predictions",
        "- all three exclude the simulator's pre-step global barrier (baft's trainer has none at dp=1)",
        "- pp=4 runs 4 processes on 2 cores (oversubscribed); with real compute a rank's "
        "compute time there includes waiting for a core",
        "",
        "| schedule | pp | m | measured ms per rank | median inputs | error | sampled | error "
        "| trace replay | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['pp']} | {r['m']} | {r['measured_blocked_ms']} | "
            f"{r['median_inputs_ms']} | {_fmt(r['median_inputs_error'])} | "
            f"{r['sampled_ms']} | {_fmt(r['sampled_error'])} | "
            f"{r['trace_replay_ms']} | {_fmt(r['trace_replay_error'])} |"
        )
    lines += ["", "Raw:", "```json", json.dumps(rows, indent=1), "```", ""]
    path = Path(a.out) / f"sim-vs-measured{suffix}-{date}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
