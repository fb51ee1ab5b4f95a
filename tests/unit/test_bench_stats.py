"""Statistics of ``baft bench overhead`` on synthetic numbers (no torch run): the Williams
design for 3-10 modes, bootstrap intervals over rounds, pooling launches, and the page's
intervals, noise statements and the memory/restore/transport/K/peer-version fields."""

from __future__ import annotations

import argparse
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from baft_bench import command as command_mod
from baft_bench.aggregate import FIELDS, block_order, merge_extra, pool_launches, summarize
from baft_bench.cli import add_bench_parser, command_line, config_from_args
from baft_bench.command import measure_overhead, render_markdown
from baft_bench.overhead import OverheadConfig
from baft_bench.stats import (
    bootstrap_ci,
    default_rounds,
    design_rounds,
    design_summary,
    format_ci,
    inside_noise,
    median_of_ratios,
    neighbour_pairs,
    point,
    ratio_of_means,
    ratio_of_medians,
    resample_rounds,
    williams_design,
)


# ------------------------------------------------------------------ the design
@pytest.mark.parametrize("n", range(3, 11))
def test_williams_design_is_carry_over_balanced(n: int) -> None:
    rows = williams_design(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n) == design_rounds(n)
    assert all(sorted(r) == list(range(n)) for r in rows)  # each mode once per round
    want = 1 if n % 2 == 0 else 2
    pairs = neighbour_pairs(rows)
    assert pairs == Counter({(a, b): want for a in range(n) for b in range(n) if a != b})
    # each mode leads a round equally often too (a Latin square by columns)
    assert Counter(r[0] for r in rows) == Counter({m: want for m in range(n)})


def test_small_designs_and_block_order_repeats_the_design() -> None:
    assert williams_design(0) == [] and williams_design(1) == [[0]]
    assert williams_design(2) == [[0, 1], [1, 0]]
    modes = [f"m{i}" for i in range(9)]
    rows = [block_order(modes, b) for b in range(18)]
    assert block_order(modes, 18) == rows[0] and block_order(modes, 20) == rows[2]
    assert [[modes.index(m) for m in r] for r in rows] == williams_design(9)


def test_nine_modes_in_eight_rounds_is_the_unbalanced_design_of_the_issue() -> None:
    s = design_summary(9, 8)
    assert (s["balanced"], s["design_rounds"], s["pairs_possible"]) == (False, 18, 72)
    assert s["pairs_present"] == 36 and s["pair_count_min"] == 0
    assert "NOT balanced" in s["note"] and "--blocks 18" in s["note"]
    full = design_summary(9, 36)
    assert full["balanced"] and (full["pair_count_min"], full["pair_count_max"]) == (4, 4)
    assert "2 full Williams design(s)" in full["note"]


@pytest.mark.parametrize(
    ("n", "requested", "rounds"),
    [(9, None, 18), (2, None, 8), (3, None, 12), (4, None, 8), (7, None, 14), (5, 10, 10)],
)
def test_default_rounds_are_whole_designs(n: int, requested: int | None, rounds: int) -> None:
    assert default_rounds(n, requested) == (rounds, None)
    assert rounds % design_rounds(n) == 0


def test_fewer_rounds_than_a_design_are_kept_and_named() -> None:
    rounds, note = default_rounds(9, 8)
    assert rounds == 8 and note is not None and "NOT balanced" in note


# ------------------------------------------------------------------ the bootstrap
def _noisy(ratio: float, rounds: int, seed: int) -> tuple[list[float], list[float]]:
    """Reference block walls with drifting load and a mode `ratio` slower with 2% noise."""
    rng = random.Random(seed)
    ref = [0.3 * (1 + 0.2 * rng.random()) for _ in range(rounds)]
    mode = [r * ratio * (1 + rng.gauss(0, 0.02)) for r in ref]
    return mode, ref


@pytest.mark.parametrize("seed", range(5))
def test_interval_contains_the_known_ratio_and_excludes_one(seed: int) -> None:
    mode, ref = _noisy(1.05, 36, seed)
    low, high = bootstrap_ci(median_of_ratios, mode, ref)
    assert low < 1.05 < high
    assert low > 1.0 and inside_noise(low, high) is False
    assert high - low < 0.05  # 36 rounds of 2% noise resolve 5%


def test_no_difference_is_inside_the_noise() -> None:
    mode, ref = _noisy(1.0, 36, 7)
    low, high = bootstrap_ci(median_of_ratios, mode, ref)
    assert low < 1.0 < high and inside_noise(low, high) is True


def test_constant_series_has_zero_width() -> None:
    ref = [0.2, 0.3, 0.25, 0.4]  # a constant ratio, whatever the load
    mode = [1.1 * r for r in ref]
    for stat in (median_of_ratios, ratio_of_means):
        low, high = bootstrap_ci(stat, mode, ref)
        assert low == pytest.approx(1.1) and high == pytest.approx(1.1)


def test_bootstrap_is_seeded() -> None:
    mode, ref = _noisy(1.02, 20, 3)
    for stat in (median_of_ratios, ratio_of_means):
        a = bootstrap_ci(stat, mode, ref, seed=11)
        assert bootstrap_ci(stat, mode, ref, seed=11) == a
    assert bootstrap_ci(ratio_of_means, mode, ref, seed=12) != a


def test_launches_are_resampled_within_themselves() -> None:
    idx = resample_rounds([3, 5], resamples=500, seed=1)
    assert idx.shape == (500, 8)
    assert idx[:, :3].min() == 0 and idx[:, :3].max() == 2
    assert idx[:, 3:].min() == 3 and idx[:, 3:].max() == 7
    # one launch all 1.0, the other all 2.0: every resample keeps 3 and 5 of them
    low, high = bootstrap_ci(ratio_of_means, [1.0] * 3 + [2.0] * 5, [1.0] * 8, strata=[3, 5])
    assert low == high == pytest.approx((3 + 10) / 8)
    with pytest.raises(ValueError, match="add up to 7, not 8"):
        bootstrap_ci(ratio_of_means, [1.0] * 8, [1.0] * 8, strata=[3, 4])
    with pytest.raises(ValueError, match="differ in length"):
        bootstrap_ci(ratio_of_means, [1.0] * 8, [1.0] * 7)


def test_point_and_ratio_of_medians_over_rounds_of_iterations() -> None:
    num = [[1.0, 3.0], [2.0, 4.0]]  # two rounds of two iterations
    den = [[1.0, 1.0], [2.0, 2.0]]
    assert point(ratio_of_medians, num, den) == pytest.approx(2.5 / 1.5)
    assert point(median_of_ratios, [2.0, 3.0, 4.0], [1.0, 1.0, 1.0]) == 3.0
    est = ratio_of_medians(np.asarray(num)[None], np.asarray(den)[None])
    assert est.shape == (1,)


def test_format_ci() -> None:
    assert format_ci(1.0151, 1.0042, 1.0268) == "1.015x [1.004, 1.027]"
    assert format_ci(1.0, None, None) == "1.000x" and format_ci(None, 1, 2) == "-"
    assert inside_noise(None, 1.0) is None


# ------------------------------------------------------------------ summaries, launches
def _launch_raw(ratios: dict[str, float], rounds: int, seed: int, iters: int = 2) -> dict:
    """One launch's raw output: 2 ranks, `iters` iterations per block, every mode's block
    `ratio` times the same round's `none` block (times 1% noise)."""
    rng = random.Random(seed)
    cfg = OverheadConfig(modes=list(ratios), num_blocks=rounds, block_iters=iters).to_dict()
    modes: dict[str, dict[str, list[list[float]]]] = {m: {f: [] for f in FIELDS} for m in ratios}
    for _ in range(rounds):
        load = 0.3 * (1 + 0.3 * rng.random())
        for m, ratio in ratios.items():
            noise = 1.0 if m == "none" else 1 + rng.gauss(0, 0.01)
            for _ in range(iters):
                for f in FIELDS:
                    modes[m][f].append([0.0, 0.0])
                modes[m]["iter_s"][-1] = [load * ratio * noise] * 2
    return {
        "config": cfg,
        "world_size": 2,
        "snapshot_s": [0.01, 0.02 + seed / 100],
        "state_bytes": [100, 100],
        "emulated_times": None,
        "skipped": {},
        "wall_s": 10.0,
        "modes": modes,
    }


def test_summary_has_an_interval_for_every_ratio_and_the_noise_verdicts() -> None:
    raw = _launch_raw({"none": 1.0, "naive-async": 1.05, "baft": 1.05, "torch-save": 1.5}, 10, 0)
    result = summarize(raw)
    baft = result["modes"]["baft"]
    for name in ("ratio_vs_none", "paired_ratio_vs_none", "wall_ratio_vs_none"):
        low, high = baft["ci"][name]
        assert low <= baft[name] <= high
    assert baft["ci"]["paired_wall_ratio_vs_none"] == [baft["ci_low"], baft["ci_high"]]
    assert baft["ci_low"] < 1.05 < baft["ci_high"] and baft["inside_noise_vs_none"] is False
    assert baft["vs"]["naive-async"]["inside_noise"] is True  # both 5% slower
    assert result["modes"]["torch-save"]["vs"]["naive-async"]["inside_noise"] is False
    assert "naive-async" not in result["modes"]["naive-async"]["vs"]
    assert result["modes"]["none"]["ci"]["paired_wall_ratio_vs_none"] == [1.0, 1.0]
    assert (result["launches"], result["launch_rounds"], baft["rounds"]) == (1, [10], 10)
    assert result["design"]["balanced"] is False  # 4 modes: 4 rounds a design
    assert "per_launch" not in baft
    page = render_markdown(result, command="c", date="d", plot=None)
    assert "- rounds: 10 (one launch)" in page and "NOT balanced" in page
    line = next(x for x in page.splitlines() if x.startswith("- `baft` (paired wall ratio)"))
    assert "vs `none` " in line and "slower, beyond the noise" in line
    assert "vs `naive-async` " in line and "inside the noise (the 95% CI contains 1.0)" in line


def test_launches_pool_their_rounds_and_keep_their_samples() -> None:
    ratios = {"none": 1.0, "baft": 1.05, "torch-save": 1.5}
    one, two = _launch_raw(ratios, 6, 1), _launch_raw(ratios, 6, 2)
    del two["modes"]["torch-save"]  # skipped in one launch: out of the pooled numbers
    raw = {"config": one["config"], "launches": [one, two]}
    pooled = pool_launches(raw)
    assert pooled["launch_rounds"] == [6, 6] and list(pooled["modes"]) == ["none", "baft"]
    assert len(pooled["modes"]["baft"]["iter_s"]) == 24  # 2 launches x 6 rounds x 2 iters
    assert pooled["snapshot_s"] == pytest.approx([0.01, 0.035])  # median over launches
    assert "not measured in every launch" in pooled["skipped"]["torch-save"]
    result = summarize(raw)
    assert (result["launches"], result["launch_rounds"]) == (2, [6, 6])
    per = result["modes"]["baft"]["per_launch"]
    assert [p["rounds"] for p in per] == [6, 6]
    assert all(p["ci_low"] <= 1.05 <= p["ci_high"] for p in per)
    single = summarize(one)["modes"]["baft"]["paired_wall_ratio_vs_none"]
    assert per[0]["paired_wall_ratio_vs_none"] == pytest.approx(single)
    page = render_markdown(result, command="c", date="d", plot=None)
    assert "- rounds: 12 (2 launches, each a fresh torchrun job, of 6/6 rounds, pooled)" in page
    assert "per launch 1.0" in page


def test_merge_extra_over_launches() -> None:
    mem = [
        {"rss_peak_bytes": [5, 9], "shm_bytes": [1, 1], "cuda_peak_bytes": None},
        {"rss_peak_bytes": [7, 8], "shm_bytes": [1, 2], "cuda_peak_bytes": None},
    ]
    assert merge_extra("memory", mem) == {
        "rss_peak_bytes": [7, 9],
        "shm_bytes": [1, 2],
        "cuda_peak_bytes": None,
    }
    assert merge_extra("restores", ["yes", "no"]) == "no"
    assert merge_extra("restores", ["yes", "yes"]) == "yes"
    assert merge_extra("transport", ["shm", "network"]) == "shm/network"
    assert merge_extra("k", [8, 8]) == 8 and merge_extra("k", [8, 4]) == [8, 4]
    assert merge_extra("k", [None, None]) is None


# ------------------------------------------------------------------ the other fields
def test_page_renders_memory_restores_transport_k_and_peer_versions() -> None:
    raw = _launch_raw({"none": 1.0, "baft": 1.02, "lm-resiliency": 1.1}, 4, 0)
    raw["peer_versions"] = {"lm-resiliency": "0.2.0", "dlrover": "0.6.1"}
    mib = 2**20
    raw["modes"]["baft"].update(
        memory={
            "rss_peak_bytes": [1200 * mib, 1100 * mib],
            "shm_bytes": [146 * mib, 146 * mib],
            "cuda_peak_bytes": None,
        },  # fmt: skip
        restores="yes",
        transport="network",
        k=8,
    )
    raw["modes"]["lm-resiliency"].update(restores="n/a", transport="network")
    result = summarize(raw)
    assert result["peer_versions"] == raw["peer_versions"]
    assert result["modes"]["baft"]["restores"] == "yes" and result["modes"]["baft"]["k"] == 8
    assert "memory" not in result["modes"]["none"]
    page = render_markdown(result, command="c", date="d", plot=None)
    assert "- peer library versions: lm-resiliency 0.2.0, dlrover 0.6.1; K (full_every) chosen: `baft` 8" in page  # fmt: skip
    assert "| mode | peak RSS MiB | shared memory MiB | CUDA peak MiB | restores | transport | K |" in page  # fmt: skip
    assert "| baft | 1200 / 1100 | 146 / 146 | - | yes | network | 8 |" in page
    assert "| lm-resiliency | - | - | - | n/a | network | - |" in page
    assert "| none | - | - | - | - | - | - |" in page


def test_page_without_the_other_fields_leaves_them_out() -> None:
    result = summarize(_launch_raw({"none": 1.0, "baft": 1.02}, 4, 0))
    result.pop("peer_versions")  # an older result
    page = render_markdown(result, command="c", date="d", plot=None)
    assert "peak RSS" not in page and "peer library versions" not in page


# ------------------------------------------------------------------ flags, launches
def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "overhead", *argv])


def test_blocks_default_to_a_whole_design_and_launches_are_on_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = _parse("--modes", "none,torch-save,baft")
    assert config_from_args(a).num_blocks == 12 and "--blocks 12" in command_line(a)
    assert "--launches" not in command_line(a)
    a = _parse("--modes", "none,torch-save,baft", "--blocks", "4", "--launches", "3")
    assert config_from_args(a).num_blocks == 4
    assert "NOT balanced" in capsys.readouterr().err
    again = _parse(*command_line(a).split()[3:])
    assert again.launches == 3 and again.blocks == 4
    with pytest.raises(ValueError, match="--launches must be >= 1"):
        config_from_args(_parse("--modes", "none", "--launches", "0"))


def test_measure_overhead_runs_fresh_launches_and_pools_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ratios = {"none": 1.0, "baft": 1.05}
    fakes = iter([_launch_raw(ratios, 4, 1), _launch_raw(ratios, 4, 2)])
    calls: list[Any] = []

    def fake_launch(cfg: OverheadConfig, timeout_s: float) -> dict:
        calls.append(cfg)
        return next(fakes)

    monkeypatch.setattr(command_mod, "_launch", fake_launch)
    monkeypatch.setattr(command_mod, "engine_import_error", lambda: None)
    cfg = OverheadConfig(modes=list(ratios), num_blocks=4, block_iters=2, out_dir=str(tmp_path))
    result, raw = measure_overhead(cfg, timeout_s=1.0, launches=2)
    assert len(calls) == 2 and len(raw["launches"]) == 2
    assert raw["launches"][0]["modes"]["baft"]["iter_s"] != raw["launches"][1]["modes"]["baft"]["iter_s"]  # fmt: skip
    assert result["launches"] == 2 and result["modes"]["baft"]["rounds"] == 8
    path = command_mod.write_results(result, raw, tmp_path / "results", "c")
    assert "2 launches" in path.read_text()
