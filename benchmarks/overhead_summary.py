"""One table over many `baft bench overhead` launches: every ``*.raw.json`` under the given
directories, one row per launch, ratios to that launch's ``none`` (ratio of medians, wall
ratio, paired wall ratio) for the engine modes, and a pooled row per configuration (mean
of the launches' paired wall ratios, per top-level folder: one code state each).

    python benchmarks/overhead_summary.py benchmarks/results/overhead-2026-12-05
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from baft_bench.aggregate import summarize

MODES = ("naive-async", "baft-full", "baft")


def _label(raw: dict) -> str:
    cfg = raw["config"]
    engine = f" {cfg['engine']}" if cfg.get("engine") else ""
    return f"{cfg['compute']} {cfg['checkpoint']}{engine}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path)
    a = p.parse_args()
    rows, pooled = [], defaultdict(lambda: defaultdict(list))
    for path in sorted(f for d in a.dirs for f in d.rglob("*.raw.json")):
        raw = json.loads(path.read_text())
        result = summarize(raw)
        label = _label(raw)
        where = path.relative_to(next(d for d in a.dirs if d in path.parents))
        group = f"{where.parts[0]}: {label}"
        cells = []
        for mode in MODES:
            m = result["modes"].get(mode)
            if m is None:
                cells.append("-")
                continue
            mib = m["bytes_per_iter"] / 2**20
            cells.append(
                f"{m['ratio_vs_none']:.3f} / {m['wall_ratio_vs_none']:.3f} / "
                f"{m['paired_wall_ratio_vs_none']:.3f} ({mib:.0f} MiB)"
            )
            pooled[group][mode].append(m["paired_wall_ratio_vs_none"])
        none_ms = result["modes"]["none"]["wall_per_iter_s"] * 1e3
        rows.append(
            f"| {path.parent.relative_to(path.parents[2])} | {label} | {none_ms:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    print("| launch | configuration | none wall ms | " + " | ".join(MODES) + " |")
    print("|---|---|---|" + "---|" * len(MODES))
    print("\n".join(rows))
    print()
    print("Pooled: mean over launches of the paired wall ratio (launches)")
    print()
    print("| folder: configuration | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for label, by_mode in pooled.items():
        cells = [
            f"{statistics.fmean(v):.3f} ({len(v)})" if (v := by_mode.get(mode)) else "-"
            for mode in MODES
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
