"""Downtime per failure: in-process recovery against torchrun's group restart, one run.

Part of ``baft bench recovery``. The same job (the recovery bench's: GPT pp=2 on 2 ranks,
one rank per simulated node) runs twice per recovery mode:

- ``crash/node``: ``--failures`` rank crashes (SIGKILL) and as many node losses (the
  rank's process and its node's store), alternating ranks so that no rank fails more
  often than in-process recovery allows before it hands over to a group restart;
- ``hang``: ``--failures`` frozen ranks (SIGSTOP), detected after ``--hang-timeout``.

Downtime of one failure = the fault (its injector record, just before the signal) to the
first iteration completed after it (the recovery record's ``resumed_at``, rank 0): what
a user loses besides the at most one iteration recomputed. Rows give the median, min and
max over the failures, and the median of each phase of the recovery record (in-process:
detect, abort or replace, rendezvous, build_engine, inventory, transfer_decode, load,
engine_start, first_iteration; group restart: detect_restart or detect + restart, then
the same).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from baft.train.launch import launch

MODES = {"in-process": True, "group restart": False}
GAP = 6
"""Iterations between two faults (the restore replays up to full_every - 1 steps)."""


def _faults(kind: str, n: int) -> list[str]:
    if kind == "hang":
        return [f"freeze:rank={i % 2},iter={GAP * (i + 1)}" for i in range(n)]
    crashes = [f"kill:rank={(i + 1) % 2},iter={GAP * (2 * i + 1)}" for i in range(n)]
    nodes = [f"node:{i % 2},iter={GAP * (2 * i + 2)}" for i in range(n)]
    return crashes + nodes


def _iterations(kind: str, failures: int) -> int:
    return GAP * (len(_faults(kind, failures)) + 1) + 2


def reference_digest(a: Any, cfg_of: Any, iterations: int) -> str:
    """The final state digest of the same job without checkpoints or faults, run once per
    length (``downtime-reference-<iterations>``)."""
    out = Path(a.out) / f"downtime-reference-{iterations}"
    summary = out / "summary.json"
    if not summary.is_file() or json.loads(summary.read_text())["iterations"] != iterations:
        cfg = cfg_of(a, out, [])
        cfg.num_iterations = iterations
        cfg.checkpoint = None
        if launch(cfg, quiet=not a.verbose) != 0:
            raise RuntimeError(f"the failure-free reference of {iterations} iterations failed; --verbose")  # fmt: skip
    return str(json.loads(summary.read_text())["final_state_digest"])


def _job(
    a: Any, cfg_of: Any, name: str, kind: str, inprocess: bool
) -> tuple[list[dict[str, Any]], str]:
    faults = _faults(kind, a.failures)
    out = Path(a.out) / f"downtime-{name}"
    cfg = cfg_of(a, out, faults)
    cfg.num_iterations = _iterations(kind, a.failures)
    cfg.inprocess = inprocess
    cfg.max_restarts = len(faults) + 2
    if kind == "hang":
        cfg.checkpoint.timeouts.collective_s = a.hang_timeout
    if launch(cfg, quiet=not a.verbose) != 0:
        raise RuntimeError(f"the {name} job failed; rerun with --verbose")
    summary = json.loads((out / "summary.json").read_text())
    recs = summary["recoveries"]
    fired: dict[str, float] = {}
    for line in (out / "faults.jsonl").read_text().splitlines():
        f = json.loads(line)
        if f["point"] != "recovery":
            fired[f["spec"]] = min(fired.get(f["spec"], f["time"]), f["time"])
    order = sorted(fired.items(), key=lambda kv: kv[1])  # the faults in the order they struck
    if len(recs) != len(order):
        raise RuntimeError(f"{name}: {len(order)} faults but {len(recs)} recoveries: {recs}")
    for r, (spec, t) in zip(recs, order, strict=True):
        r["fault"] = spec
        r["downtime_s"] = r["resumed_at"] - t
    return recs, str(summary["final_state_digest"])


def _of(recs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The recoveries from faults of ``kind`` (``kill``, ``node``, ``freeze``)."""
    return [r for r in recs if r["fault"].split(":", 1)[0] == kind]


def _row(scenario: str, mode: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    down = [r["downtime_s"] for r in recs]
    phases: dict[str, list[float]] = {}
    for r in recs:
        for k, v in r["seconds"].items():
            phases.setdefault(k, []).append(v)
    restore = [sum(r["seconds"].get(k, 0.0) for k in ("inventory", "transfer_decode", "load")) for r in recs]  # fmt: skip
    return {
        "scenario": scenario,
        "mode": mode,
        "failures": len(recs),
        "downtime_median_s": statistics.median(down),
        "downtime_min_s": min(down),
        "downtime_max_s": max(down),
        "downtime_s": down,
        "faults": [r["fault"] for r in recs],
        "restore_median_s": statistics.median(restore),
        "lost_iterations": [r["lost_iterations"] for r in recs],
        "sources": sorted({r["source"] for r in recs}),
        "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "phases_n": {k: len(v) for k, v in phases.items()},
    }


def downtime_rows(a: Any, cfg_of: Any) -> list[dict[str, Any]]:
    """Rank crash, node loss and (``--hang-timeout`` > 0) hang rows, in-process and group
    restart; ``cfg_of(a, out, inject)`` builds the recovery bench's job config. Each job's
    final state is compared with the same job's without checkpoints or faults
    (``final_bit_identical``; the crash and node rows share one job)."""
    rows: list[dict[str, Any]] = []
    for mode, inprocess in MODES.items():
        tag = mode.replace(" ", "-")
        recs, digest = _job(a, cfg_of, f"{tag}-crash-node", "crash", inprocess)
        same = digest == reference_digest(a, cfg_of, _iterations("crash", a.failures))
        rows.append({**_row("rank crash (SIGKILL)", mode, _of(recs, "kill")), "final_bit_identical": same})  # fmt: skip
        rows.append({**_row("node loss (process + store)", mode, _of(recs, "node")), "final_bit_identical": same})  # fmt: skip
        if a.hang_timeout > 0:
            recs, digest = _job(a, cfg_of, f"{tag}-hang", "hang", inprocess)
            same = digest == reference_digest(a, cfg_of, _iterations("hang", a.failures))
            rows.append({**_row(f"rank hang (SIGSTOP, timeout {a.hang_timeout:g} s)", mode, recs), "final_bit_identical": same})  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Downtime per failure: in-process recovery vs group restart",
        "",
        "Fault to the first completed iteration after it (median [min, max] over the "
        "failures); phases are medians over the same failures (rank 0's record: a phase "
        "that rank 0 did not go through is missing or counted over fewer failures). "
        "Final = failure-free: the job's final state (every rank's parameters, buffers and "
        "optimizer state) against the same job's without checkpoints or faults.",
        "",
        "| scenario | mode | n | downtime median (s) | [min, max] | restore (s) | lost iters | final = failure-free | phases (median s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_median_s"].items())
        same = r.get("final_bit_identical")
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {r['failures']} | {r['downtime_median_s']:.2f} | "
            f"[{r['downtime_min_s']:.2f}, {r['downtime_max_s']:.2f}] | {r['restore_median_s']:.3f} | "
            f"{r['lost_iterations']} | {'-' if same is None else 'bit-identical' if same else 'differs'} | {phases} |"
        )
    by = {(r["scenario"], r["mode"]): r for r in rows}
    lines.append("")
    for (scenario, mode), r in by.items():
        g = by.get((scenario, "group restart"))
        if mode == "in-process" and g is not None:
            ratio = g["downtime_median_s"] / r["downtime_median_s"]
            lines.append(
                f"- {scenario}: in-process {ratio:.2f}x shorter downtime (median) than the group restart"
            )
    return lines
