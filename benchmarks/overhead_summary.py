"""One table over many `baft bench overhead` launches: every ``*.raw.json`` under the given
directories, one row per file, ratios to that launch's ``none`` (ratio of medians, wall
ratio, paired wall ratio with its 95% bootstrap interval over rounds) for the engine modes,
and a pooled row per configuration (per top-level folder: one code state each): the paired
wall ratio over the rounds of all its launches, with a bootstrap interval that resamples
rounds within each launch, and the mean of the launches' paired wall ratios.

    python benchmarks/overhead_summary.py benchmarks/results/overhead-2026-12-05
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from baft_bench.aggregate import per_round, pool_launches, summarize
from baft_bench.stats import bootstrap_ci, format_ci, median_of_ratios, point

MODES = ("naive-async", "baft-full", "baft")


def _label(raw: dict) -> str:
    cfg = raw["config"]
    engine = f" {cfg['engine']}" if cfg.get("engine") else ""
    return f"{cfg['compute']} {cfg['checkpoint']}{engine}"


def _pooled_cell(launches: list[tuple[list[float], list[float]]]) -> str:
    """Paired wall ratio over every launch's rounds (mode walls, `none` walls), its
    interval (rounds resampled within each launch), the launches' mean and counts."""
    mode = [w for m, _ in launches for w in m]
    ref = [w for _, r in launches for w in r]
    strata = [len(m) for m, _ in launches]
    low, high = bootstrap_ci(median_of_ratios, mode, ref, strata=strata)
    mean = statistics.fmean(point(median_of_ratios, m, r) for m, r in launches)
    value = point(median_of_ratios, mode, ref)
    return f"{format_ci(value, low, high)}, mean {mean:.3f} ({len(strata)} / {len(mode)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path)
    a = p.parse_args()
    rows = []
    pooled: defaultdict[str, defaultdict[str, list[tuple[list[float], list[float]]]]]
    pooled = defaultdict(lambda: defaultdict(list))
    for path in sorted(f for d in a.dirs for f in d.rglob("*.raw.json")):
        raw = pool_launches(json.loads(path.read_text()))
        result = summarize(raw)
        label = _label(raw)
        where = path.relative_to(next(d for d in a.dirs if d in path.parents))
        group = f"{where.parts[0]}: {label}"
        bi, strata = raw["config"]["block_iters"], raw["launch_rounds"]
        walls = {m: per_round(s["iter_s"], bi)["walls"] for m, s in raw["modes"].items()}
        cells = []
        for mode in MODES:
            m = result["modes"].get(mode)
            if m is None:
                cells.append("-")
                continue
            mib = m["bytes_per_iter"] / 2**20
            head = format_ci(m["paired_wall_ratio_vs_none"], m["ci_low"], m["ci_high"])
            cells.append(
                f"{m['ratio_vs_none']:.3f} / {m['wall_ratio_vs_none']:.3f} / {head} ({mib:.0f} MiB)"
            )
            start = 0
            for size in strata:  # each launch of the file its own stratum
                sl = slice(start, start + size)
                pooled[group][mode].append((walls[mode][sl], walls["none"][sl]))
                start += size
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
    print(
        "Pooled: paired wall ratio over the rounds of all launches [95% CI, rounds resampled "
        "within each launch], mean of the launches' paired wall ratios (launches / rounds)"
    )
    print()
    print("| folder: configuration | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for label, by_mode in pooled.items():
        cells = [_pooled_cell(v) if (v := by_mode.get(mode)) else "-" for mode in MODES]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
