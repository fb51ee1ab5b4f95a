"""``baft bench reduction``: its flags, the gradient sizes it picks and the report's
arithmetic on fake timings (no launches, no process groups)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("baft_bench")

from baft_bench import reduction  # noqa: E402
from baft_bench.cli import add_bench_parser  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_defaults_are_a_balanced_design_of_every_arm() -> None:
    a = _parse(["bench", "reduction"])
    assert a.func is reduction.run_reduction
    cfg = reduction.config_from_args(a)
    assert cfg.arms == list(reduction.ARMS) and cfg.num_dp == 2 and cfg.num_pp == 1
    assert cfg.num_rounds == 8  # two Williams designs of 4 arms
    assert cfg.check_replicas == 4 and cfg.grad_mib is None and cfg.world_size == 2
    assert reduction.config_from_args(_parse(["bench", "reduction", "--pp", "2"])).world_size == 4


@pytest.mark.parametrize(
    "flags",
    [
        ["--arms", "deterministic,sum-allreduce"],  # no reference
        ["--arms", "allreduce,bogus"],
        ["--dp", "1"],
        ["--check-replicas", "3"],
        ["--grad-mib", "0"],
        ["--block-reps", "0"],
        ["--launches", "0"],
    ],
)
def test_bad_flags_are_refused(flags: list[str]) -> None:
    with pytest.raises(ValueError):
        reduction.config_from_args(_parse(["bench", "reduction", *flags]))


def test_bad_flags_exit_2_without_launching(capsys: pytest.CaptureFixture[str]) -> None:
    a = _parse(["bench", "reduction", "--dp", "1"])
    assert a.func(a) == 2
    assert "need pp >= 1 and dp >= 2" in capsys.readouterr().err


def test_command_line_reproduces_the_config() -> None:
    a = _parse(["bench", "reduction", "--grad-mib", "8", "--launches", "2", "--json",
                "--iteration-from", "x.json"])  # fmt: skip
    cfg = reduction.config_from_args(a)
    words = shlex.split(reduction.command_line(a))
    assert words[:3] == ["baft", "bench", "reduction"] and words[-1] == "--json"
    b = _parse(words[1:])
    assert reduction.config_from_args(b) == cfg and b.iteration_from == ["x.json"]
    assert b.launches == 2


def test_gradient_sizes() -> None:
    default = reduction.ReductionConfig()
    numel = sum(_numel(s) for s in reduction.stage_shapes(default, 0))
    assert numel == 12_738_560  # stage 0 of the overhead bench's default model (48.6 MiB)
    sized = reduction.ReductionConfig(grad_mib=10.5)
    shapes = reduction.stage_shapes(sized, 0)
    assert sum(_numel(s) for s in shapes) == int(10.5 * 2**18)
    assert max(_numel(s) for s in shapes) == reduction.CHUNK_ELEMENTS


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _launch(ms: dict[str, float], rounds: int, reps: int, slow_rank: float) -> dict[str, Any]:
    """One launch's raw output with constant times per arm; rank 1 is ``slow_rank`` ms
    slower (the max over ranks is what counts)."""
    row = {"stage": 0, "digests": {n: "d" for n in ms}, "pairs": {
        "deterministic == deterministic-shrunk": {"identical": True, "differing": 0, "of": 8},
    }}  # fmt: skip
    return {
        "config": reduction.ReductionConfig(num_rounds=rounds, block_reps=reps).to_dict(),
        "rounds": rounds,
        "grad_bytes": [32, 32],
        "arms": {
            n: {"rep_s": [[v / 1e3, (v + slow_rank) / 1e3]] * (rounds * reps)}
            for n, v in ms.items()
        },
        "memory": {**{n: [100, 200] for n in ms}, reduction.GATHER_ALONE: [2**20, 3 * 2**20]},
        "identity": {"ranks": [{**row, "dp": 0}, {**row, "dp": 1}]},
        "wall_s": 1.0,
    }


def test_summary_arithmetic_on_fake_timings(tmp_path: Path) -> None:
    ms = {"allreduce": 10.0, "deterministic": 15.0, "sum-allreduce": 10.0,
          "deterministic-shrunk": 4.0}  # fmt: skip
    raw = {"config": reduction.ReductionConfig().to_dict(),
           "launches": [_launch(ms, 4, 3, 2.0), _launch(ms, 8, 3, 2.0)]}  # fmt: skip
    ref = tmp_path / "overhead.json"
    ref.write_text(json.dumps({"modes": {"none": {"wall_per_iter_s": 0.4, "median_iter_s": 0.3}}}))
    refs = reduction.iteration_refs([str(ref), str(tmp_path / "missing.json")])
    assert refs == [{"source": str(ref), "iteration_ms": 400.0}]
    result = reduction.summarize(raw, refs)
    assert result["launch_rounds"] == [4, 8] and result["launches"] == 2
    arms = result["arms"]
    assert arms["allreduce"]["ms"] == {"value": 12.0, "low": 12.0, "high": 12.0}  # rank 1's
    det = arms["deterministic"]
    assert det["ratio"]["value"] == pytest.approx(17 / 12)
    assert det["ratio"]["low"] == pytest.approx(17 / 12) == det["ratio"]["high"]
    assert det["added_ms"]["value"] == pytest.approx(5.0)
    assert det["of_iteration"][0]["value"] == pytest.approx(5.0 / 400.0)
    assert len(det["per_launch"]) == 2 and det["reductions"] == 36
    assert arms["sum-allreduce"]["ratio"]["value"] == pytest.approx(1.0)
    assert arms["deterministic-shrunk"]["added_ms"]["value"] == pytest.approx(-6.0)
    assert det["memory_bytes"] == [100, 200]
    assert result["gather_memory_bytes"] == [2**20, 3 * 2**20]
    assert result["identity"]["checks"]["deterministic == deterministic-shrunk"]["identical"]
    assert result["identity"]["dp_ranks_agree"]
    page = reduction.render_markdown(result, command="baft bench reduction", date="D")
    assert "1.417x [1.417, 1.417]" in page and "5.0 [5.0, 5.0]" in page
    assert "1.2% [1.2%, 1.2%] of the overhead bench's 400.0 ms iteration" in page
    assert "`deterministic == deterministic-shrunk`: identical" in page
    assert "preallocated output) | 0 | 1 / 3 |" in page
    assert "| deterministic | 0 G = 0 (1 G flat buffer kept" in page  # kept across iterations


def test_the_ratio_is_paired_per_round() -> None:
    # the machine slows down in the second half: both arms alike, the ratio stays 2
    rounds, reps = 4, 2
    raw = _launch({"allreduce": 10.0, "deterministic": 20.0}, rounds, reps, 0.0)
    raw["config"]["arms"] = ["allreduce", "deterministic"]
    for name, base in (("allreduce", 10.0), ("deterministic", 20.0)):
        raw["arms"][name]["rep_s"] = [
            [base * (1 if i < rounds * reps // 2 else 3) / 1e3] * 2 for i in range(rounds * reps)
        ]
    det = reduction.summarize(raw)["arms"]["deterministic"]
    assert det["ratio"] == {"value": 2.0, "low": 2.0, "high": 2.0}
    assert det["of_iteration"] == []


def test_a_differing_result_is_reported() -> None:
    bad = {"identical": False, "differing": 7, "of": 8}
    good = {"identical": True, "differing": 0, "of": 8}
    rows = [
        {"stage": 0, "dp": 0, "digests": {"deterministic": "a"}, "pairs": {"x": good},
         "order": {"replicas": 4, "y": bad}},
        {"stage": 0, "dp": 1, "digests": {"deterministic": "b"}, "pairs": {"x": good},
         "order": {"replicas": 4, "y": good}},
    ]  # fmt: skip
    s = reduction.identity_summary([{"ranks": rows}])
    assert s["checks"]["x"]["identical"] and not s["checks"]["y"]["identical"]
    assert s["checks"]["y"]["max_differing"] == 7 and not s["dp_ranks_agree"]


def test_blocks_must_split_evenly() -> None:
    with pytest.raises(ValueError, match="equal blocks"):
        reduction.per_round_ms([[0.001]] * 5, 2)
    assert reduction.per_round_ms([[0.001, 0.003]] * 4, 2) == [[3.0, 3.0], [3.0, 3.0]]
