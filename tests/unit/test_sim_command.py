"""``baft simulate`` / ``baft plan --preset``: acceptance numbers, JSON shape, text output."""

from __future__ import annotations

import argparse
import json

import pytest

from baft.cli.plan import add_plan_parser
from baft.cli.simulate import add_simulate_parser
from baft.plan.types import CheckpointPolicy
from baft.sim.command import evaluate
from baft.sim.presets import build_scenario


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    add_simulate_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.mark.timeout(120)
def test_simulate_json_acceptance(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["simulate", "--preset", "llama2-34b", "--gpus", "512", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # exactly one JSON object
    assert set(data["modes"]) == {"baft", "naive-async", "sync"}
    for m in data["modes"].values():
        assert {"exposed_s", "exposed_fraction", "interval_iters", "expected_lost_s"} <= set(m)
    assert data["iteration_s"] > 0 and 0 < data["bubble_fraction"] < 1
    assert data["assumptions"]["d2h_Bps_per_gpu"] == 25.6e9
    baft = data["modes"]["baft"]
    assert baft["interval_iters"] == 1 and baft["exposed_fraction"] < 0.01
    assert baft["predicted_exposed_s"] == 0.0
    assert data["modes"]["sync"]["interval_iters"] > 1
    assert data["modes"]["sync"]["exposed_fraction"] > baft["exposed_fraction"]


@pytest.mark.timeout(120)
def test_zero_bubble_schedule_spills_or_stretches() -> None:
    scn = build_scenario("llama2-7b", "h100", 64, schedule="zbv")
    kw = {"mtbf_s": 6 * 3600.0, "storage_Bps": 0.5e9, "restart_s": 60.0}
    spill = evaluate(scn, CheckpointPolicy(), **kw)["modes"]["baft"]
    assert spill["interval_iters"] == 1 and spill["predicted_exposed_s"] > 0.0
    assert "bubbles hold only" in spill["reason"]
    stretch = evaluate(scn, CheckpointPolicy(on_overflow="stretch"), **kw)["modes"]["baft"]
    assert stretch["interval_iters"] > 1 and stretch["exposed_fraction"] <= 0.0101
    assert "stretched from every 1" in stretch["reason"]


@pytest.mark.timeout(120)
def test_simulate_text_and_plan_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["simulate", "--preset", "llama2-13b", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert "naive-async" in out and "assumptions:" in out and "Young/Daly" in out
    assert run(["plan", "--preset", "llama2-13b", "--gpus", "64", "--ranks", "0,63"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: owns bytes 0.." in out and "rank 63:" in out and "snapshot x" in out
    assert run(["plan", "--preset", "llama2-13b", "--gpus", "64", "--ranks", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["plan"]["ranks"]) == ["5"] and list(data["bubble_maps"]) == ["5"]


def test_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["simulate", "--gpus", "100"]) == 2
    assert "not a multiple of tp*pp" in capsys.readouterr().err
    assert run(["simulate", "--gpus", "64", "--redundancy", "xor:3"]) == 2
    assert "xor:3" in capsys.readouterr().err
