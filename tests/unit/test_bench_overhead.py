"""Aggregation, report and config of ``baft bench overhead`` on fake numbers (no torch run)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from baft_bench.aggregate import summarize, summarize_mode
from baft_bench.cli import add_bench_parser, command_line, config_from_args, run_bench
from baft_bench.command import render_markdown
from baft_bench.overhead import OverheadConfig


def _samples(iter_s: list[list[float]], **other: list[list[float]]) -> dict[str, Any]:
    zeros = [[0.0 for _ in row] for row in iter_s]
    return {
        "iter_s": iter_s,
        "exposed_s": other.get("exposed_s", zeros),
        "in_bubble_s": other.get("in_bubble_s", zeros),
        "bytes": other.get("bytes", zeros),
    }


def _raw() -> dict[str, Any]:
    cfg = OverheadConfig(modes=["none", "torch-save", "baft"]).to_dict()
    return {
        "config": cfg,
        "world_size": 2,
        "snapshot_s": [0.010, 0.020],
        "state_bytes": [100, 60],
        "emulated_times": None,
        "skipped": {"naive-async": "ImportError: nope"},
        "wall_s": 12.0,
        "modes": {
            # per iteration: [rank0, rank1]
            "none": _samples([[0.10, 0.20], [0.30, 0.25], [0.19, 0.05]]),
            "torch-save": _samples(
                [[0.40, 0.30], [0.50, 0.20], [0.10, 0.45]],
                exposed_s=[[0.2, 0.1], [0.3, 0.1], [0.1, 0.25]],
                bytes=[[100, 60], [100, 60], [100, 60]],
            ),
            "baft": _samples(
                [[0.20, 0.21], [0.22, 0.20], [0.21, 0.21]],
                exposed_s=[[0.01, 0.0], [0.0, 0.0], [0.02, 0.01]],
                in_bubble_s=[[0.03, 0.02], [0.04, 0.02], [0.02, 0.03]],
                bytes=[[100, 60], [100, 60], [100, 60]],
            ),
        },
    }


def test_summarize_mode_takes_max_over_ranks_then_median() -> None:
    m = summarize_mode(_raw()["modes"]["torch-save"])
    assert m["median_iter_s"] == 0.45  # maxes 0.40, 0.50, 0.45
    assert m["exposed_s"] == 0.25  # maxes 0.2, 0.3, 0.25
    assert m["in_bubble_fraction"] == 0.0
    assert m["bytes_per_iter"] == 160
    assert m["bytes_per_rank"] == [100, 60]
    assert m["num_iters"] == 3


def test_in_bubble_fraction_is_share_of_all_checkpoint_seconds() -> None:
    m = summarize_mode(_raw()["modes"]["baft"])
    bubble, exposed = 0.03 + 0.02 + 0.04 + 0.02 + 0.02 + 0.03, 0.01 + 0.02 + 0.01
    assert m["in_bubble_fraction"] == pytest.approx(bubble / (bubble + exposed))
    assert summarize_mode(_raw()["modes"]["none"])["in_bubble_fraction"] is None


def test_summarize_ratios_and_snapshot_fraction() -> None:
    result = summarize(_raw(), {"nproc": 2})
    assert result["modes"]["none"]["median_iter_s"] == 0.20  # maxes 0.20, 0.30, 0.19
    assert result["modes"]["none"]["ratio_vs_none"] == 1.0
    assert result["modes"]["torch-save"]["ratio_vs_none"] == pytest.approx(0.45 / 0.20)
    assert result["modes"]["baft"]["ratio_vs_none"] == pytest.approx(0.21 / 0.20)
    assert result["sync_snapshot_fraction"] == pytest.approx(0.020 / 0.20)  # slowest rank
    assert result["compute"] == "real"
    assert result["machine"] == {"nproc": 2}
    assert result["skipped"] == {"naive-async": "ImportError: nope"}
    assert list(result["modes"]) == ["none", "torch-save", "baft"]
    keys = {"median_iter_s", "ratio_vs_none", "exposed_s", "in_bubble_fraction", "bytes_per_iter"}
    assert all(keys <= set(m) for m in result["modes"].values())
    json.dumps(result)  # one JSON object


def test_paired_ratio_compares_blocks_of_the_same_round() -> None:
    raw = _raw()
    raw["config"]["block_iters"] = 1  # three rounds of one iteration each
    result = summarize(raw)
    # torch-save / none per round: 0.40/0.20=2.0, 0.50/0.30=1.67, 0.45/0.19=2.37 -> 2.0
    assert result["modes"]["torch-save"]["paired_ratio_vs_none"] == pytest.approx(2.0)
    assert result["modes"]["none"]["paired_ratio_vs_none"] == 1.0


def test_wall_per_iteration_is_the_pace_not_the_per_iteration_max() -> None:
    raw = _raw()
    raw["config"]["block_iters"] = 1
    m = summarize(raw)["modes"]["torch-save"]
    # per round, mean over ranks: torch-save 0.35, 0.35, 0.275; none 0.15, 0.275, 0.12
    assert m["wall_per_iter_s"] == pytest.approx((0.35 + 0.35 + 0.275) / 3)
    assert m["wall_ratio_vs_none"] == pytest.approx(0.325 / ((0.15 + 0.275 + 0.12) / 3))
    assert m["paired_wall_ratio_vs_none"] == pytest.approx(
        0.275 / 0.12
    )  # median of 2.33, 1.27, 2.29
    # ranks whose iteration boundaries alternate: the max says 1.5x, the pace is the same
    raw["config"]["block_iters"] = 2
    raw["modes"] = {
        "none": _samples([[0.2, 0.2], [0.2, 0.2]]),
        "baft": _samples([[0.1, 0.3], [0.3, 0.1]]),
    }
    m = summarize(raw)["modes"]["baft"]
    assert m["ratio_vs_none"] == pytest.approx(1.5)
    assert m["wall_ratio_vs_none"] == pytest.approx(1.0)
    assert m["paired_wall_ratio_vs_none"] == pytest.approx(1.0)


def test_markdown_table_has_raw_numbers_and_ratios() -> None:
    result = summarize(_raw(), {"nproc": 2, "cpu_model": "Fake CPU", "ram_gib": 24.0})
    page = render_markdown(result, command="baft bench overhead", date="2026-01-02", plot="x.png")
    assert "2026-01-02" in page and "Fake CPU" in page and "`baft bench overhead`" in page
    assert "| torch-save | 450.0 |" in page
    # ratio of medians, paired ratio (one round: the interval is the value)
    assert "| 2.250x [2.250, 2.250] | 2.250x [2.250, 2.250] |" in page
    # wall ms / iter, its ratios
    assert "| 325.0 | 1.789x [1.789, 1.789] | 1.789x [1.789, 1.789] |" in page
    assert "- rounds: 1 (one launch)" in page
    assert "EMULATED" not in page
    assert "skipped `naive-async`: ImportError: nope" in page
    assert "![iteration times per mode](x.png)" in page


def test_emulated_results_are_labelled() -> None:
    raw = _raw()
    raw["config"]["compute"] = "emulated"
    raw["emulated_times"] = {"fwd": [0.01, 0.02], "bwd": [0.03, 0.04]}
    page = render_markdown(summarize(raw), command="c", date="d", plot=None)
    assert page.splitlines()[0].endswith("(EMULATED compute)")
    assert "| none (EMULATED) |" in page
    assert "stage 1: 20.0/40.0" in page


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_config_from_flags_and_exact_command() -> None:
    a = _parse("overhead", "--modes", "none,torch-save", "--blocks", "3", "--d-model", "64")
    cfg = config_from_args(a)
    assert cfg.modes == ["none", "torch-save"] and cfg.num_blocks == 3 and cfg.d_model == 64
    again = config_from_args(_parse(*command_line(a).split()[2:]))
    assert again == cfg


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--modes", "torch-save"], "must include none"),
        (["--modes", "none,fast"], "unknown mode"),
        (["--modes", "none,none"], "twice"),
        (["--blocks", "0"], "--blocks must be >= 1"),
        (["--batch", "3"], "must split evenly"),
    ],
)
def test_bad_flags_raise_value_error_with_the_fix(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(_parse("overhead", *flags))


def test_recovery_and_scale_register_their_own_commands() -> None:
    from baft_bench.recovery import run_recovery
    from baft_bench.scale import run_scale

    assert _parse("recovery").func is run_recovery
    assert _parse("scale", "--json").func is run_scale


def test_bench_without_a_benchmark_says_which_exist(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_parse()) == 2
    assert "overhead, recovery, scale" in capsys.readouterr().err


def test_total_iterations_counts_warmup_switches_and_profiling() -> None:
    cfg = OverheadConfig(modes=["none", "baft"], num_blocks=2, block_iters=3, num_warmup=1)
    # 1 global warm-up + 2 modes x (1 warm-up + 2 blocks x (1 switch + 3)) + 3 profiling
    # + 3 checkpoints to baft's one re-plan
    # + the restore check of baft: K + 2 checkpoints (K guessed 8 for full_every=auto)
    assert cfg.replan_iters() == 3
    assert cfg.total_iterations() == 1 + 2 * (1 + 2 * 4) + 3 + 3 + (8 + 2)
    cfg.restore_check = False
    assert cfg.total_iterations() == 1 + 2 * (1 + 2 * 4) + 3 + 3
    cfg.interval = 2  # a checkpoint every other iteration: the re-plan comes later
    assert cfg.replan_iters() == 6


def test_component_table_reports_added_cpu_and_paths_per_rank() -> None:
    """Per rank: blocked time, CPU over `none`, component seconds and bytes per path."""
    from baft_bench.aggregate import COMPONENTS

    raw = _raw()
    iters = 3
    raw["modes"]["none"]["cpu_s"] = [[0.10, 0.20]] * iters
    raw["modes"]["baft"]["cpu_s"] = [[0.13, 0.26]] * iters
    raw["modes"]["baft"]["blocked_s"] = [[0.05, 0.04]] * iters
    raw["modes"]["baft"]["copy_s"] = [[0.007, 0.008]] * iters
    raw["modes"]["baft"]["pull_bytes"] = [[2.0 * 2**20, 3.0 * 2**20]] * iters
    raw["modes"]["baft"]["net_bytes"] = [[0.0, 0.0]] * iters
    raw["modes"]["none"]["faults"] = [[12000.0, 16500.0]] * iters
    raw["modes"]["baft"]["faults"] = [[3000.0, 0.0]] * iters
    result = summarize(raw, {"malloc": {"MALLOC_TRIM_THRESHOLD_": "7"}})
    assert result["modes"]["none"]["per_rank"]["faults"] == [12000.0, 16500.0]
    per = result["modes"]["baft"]["per_rank"]
    assert per["protect_cpu_s"] == pytest.approx([0.03, 0.06])
    assert per["copy_s"] == [0.007, 0.008]
    page = render_markdown(result, command="baft bench overhead", date="2026-12-03", plot=None)
    header = "| mode | rank | blocked ms | added CPU ms | " + " | ".join(
        f"{c} ms" for c in COMPONENTS
    )
    assert header in page
    assert "| baft | 0 | 50.0 | 30.0 | 7.0 |" in page
    assert page.count("| baft | 1 | 40.0 | 60.0 | 8.0 |") == 1
    assert "| 3.0 | 0.0 | 0.0 |" in page  # rank 1 pulled 3 MiB, none over the network, 0 faults
    assert "| none | 1 | - | 0.0 |" in page and page.count("| 16.5 |") == 1  # none's faults (k)
    assert "glibc with MALLOC_TRIM_THRESHOLD_=7" in page


def test_bench_components_match_the_engine() -> None:
    from baft.engine.engine import COMPONENTS as ENGINE_COMPONENTS
    from baft_bench.aggregate import COMPONENTS

    assert COMPONENTS == ENGINE_COMPONENTS


def test_fixed_emulated_times_parse_and_reject_bad_input() -> None:
    cfg = OverheadConfig(modes=["none"], compute="emulated", emulated_ms="15.5/29,15/28.5")
    cfg.validate()
    assert cfg.fixed_emulated_times() == {"fwd": [0.0155, 0.015], "bwd": [0.029, 0.0285]}
    with pytest.raises(ValueError, match="gives 1 stages, the layout has 2"):
        OverheadConfig(modes=["none"], compute="emulated", emulated_ms="15/29").validate()
    with pytest.raises(ValueError, match="expected FWD/BWD milliseconds per stage"):
        OverheadConfig(modes=["none"], compute="emulated", emulated_ms="15,29").validate()
    assert OverheadConfig(modes=["none"]).fixed_emulated_times() is None


@pytest.mark.parametrize("n", [3, 4, 5, 7])
def test_block_order_balances_which_mode_follows_which(n: int) -> None:
    from collections import Counter

    from baft_bench.aggregate import block_order

    modes = [f"m{i}" for i in range(n)]
    rounds = [block_order(modes, b) for b in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(r) == modes for r in rounds)
    pairs = Counter((r[i - 1], r[i]) for r in rounds for i in range(1, n))
    want = 1 if n % 2 == 0 else 2
    assert pairs == Counter({(a, b): want for a in modes for b in modes if a != b})
    assert block_order(modes, len(rounds)) == rounds[0]
    assert block_order(["a", "b"], 1) == ["b", "a"] and block_order([], 3) == []


def test_engine_options_reach_every_engine_mode_and_bad_ones_are_named() -> None:
    cfg = OverheadConfig(
        modes=["none", "naive-async", "baft"], engine="host_work=always,snapshot_copy=thread"
    )
    cfg.validate()
    for mode in ("naive-async", "baft-full", "baft"):
        ck = cfg.engine_checkpoint(mode)
        assert (ck.exchange.host_work, ck.exchange.snapshot_copy, ck.exchange.paths) == (
            "always",
            "thread",
            "network",  # the engine arms' transport unless named for shm (baft-shm)
        )
    assert OverheadConfig(modes=["none"]).engine_checkpoint("baft").exchange.host_work == "auto"
    with pytest.raises(ValueError, match="key one of host_work"):
        OverheadConfig(modes=["none", "baft"], engine="budget_bytes=1").validate()
    with pytest.raises(ValueError, match="host_work must be"):
        OverheadConfig(modes=["none", "baft"], engine="host_work=sometimes").validate()
