"""Sum up a ``benchmarks/cuda_check.sh`` run: bit-exactness and overhead per mode.

``python benchmarks/cuda_summary.py OUT`` reads ``OUT/<run>/summary.json`` and
``metrics.jsonl`` of the check's runs, writes ``OUT/check.json`` and prints it. Exit 1
unless every run of a size ended on the same state digest and every recovery came from
memory (bit-identical trajectories).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median
from typing import Any

SIZES = {"small": ("none", "full", "diff"), "large": ("large-none", "large-full", "large-diff")}
WARMUP = 4
"""Iterations left out of the medians (profiling, planning, first re-plan)."""


def _run(path: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((path / "summary.json").read_text())
        lines = (path / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return None
    metrics = [m for m in map(json.loads, lines) if m["iteration"] >= WARMUP]
    out: dict[str, Any] = {
        "digest": summary["final_state_digest"],
        "recoveries": [
            {k: r.get(k) for k in ("source", "restored_version", "lost_iterations", "reason")}
            for r in summary.get("recoveries", [])
        ],
        "median_iter_ms": round(1e3 * median(m["iter_s"] for m in metrics), 2),
    }
    if metrics and "exposed_s" in metrics[0]:
        out["median_exposed_ms"] = round(1e3 * median(m["exposed_s"] for m in metrics), 2)
        keys = sorted({k for m in metrics for k in m.get("seconds", {})})
        out["median_seconds_ms"] = {
            k: round(1e3 * median(m.get("seconds", {}).get(k, 0.0) for m in metrics), 2)
            for k in keys
        }
    return out


def main(out: Path) -> int:
    report: dict[str, Any] = {}
    ok = True
    for size, names in SIZES.items():
        runs = {n: _run(out / n) for n in names}
        report[size] = runs
        present = {n: r for n, r in runs.items() if r is not None}
        if len(present) < len(names) or len({r["digest"] for r in present.values()}) != 1:
            ok = False
        if any(rec["source"] != "memory" for r in present.values() for rec in r["recoveries"]):
            ok = False
        base = runs[names[0]]
        for n in names[1:]:
            r = runs[n]
            if base is not None and r is not None:
                r["ratio_vs_none"] = round(r["median_iter_ms"] / base["median_iter_ms"], 4)
    report["bit_identical"] = ok
    text = json.dumps(report, indent=1)
    (out / "check.json").write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
