"""``baft bench goodput``: the efficiency formula on hand-computed numbers, which inputs are
measured and which assumed, and the simulated rows' labels (no processes, no simulator
run except where named)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("baft_bench")

from baft_bench import goodput as g  # noqa: E402
from baft_bench.cli import add_bench_parser  # noqa: E402


def test_efficiency_hand_computed() -> None:
    # T = 1 s, r = 1.1 -> Tc = 1.1 s; a failure costs 60 + 0.5 * 1.1 = 60.55 s;
    # per iteration 1.1 / 3600 * 60.55 = 66.605 / 3600 s; efficiency 1 / (1.1 + that)
    out = g.efficiency(iter_s=1.0, overhead_ratio=1.1, downtime_s=60.0, lost_iters=0.5, mtbf_s=3600.0)  # fmt: skip
    assert out["iter_with_ckpt_s"] == pytest.approx(1.1)
    assert out["failure_s_per_iter"] == pytest.approx(66.605 / 3600)
    assert out["efficiency"] == pytest.approx(1 / (1.1 + 66.605 / 3600))
    assert out["efficiency"] == pytest.approx(0.894054, abs=1e-6)


def test_efficiency_limits() -> None:
    free = g.efficiency(iter_s=0.5, overhead_ratio=1.0, downtime_s=0.0, lost_iters=0.0, mtbf_s=1.0)
    assert free["efficiency"] == 1.0
    # no failures to speak of: only the overhead counts
    rare = g.efficiency(iter_s=2.0, overhead_ratio=1.25, downtime_s=10.0, lost_iters=1.0, mtbf_s=1e15)  # fmt: skip
    assert rare["efficiency"] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        g.efficiency(iter_s=1.0, overhead_ratio=1.0, downtime_s=-1.0, lost_iters=0.0, mtbf_s=1.0)


def test_job_mtbf_scales_per_gpu() -> None:
    assert g.job_mtbf_s(16384) == pytest.approx(3 * 3600)
    assert g.job_mtbf_s(1024) == pytest.approx(16 * 3 * 3600)
    assert g.job_mtbf_s(2, ref_mtbf_h=1.0, ref_gpus=4) == pytest.approx(7200)
    with pytest.raises(ValueError):
        g.job_mtbf_s(0)


def _overhead() -> dict:
    def mode(ratio: float, **extra: object) -> dict:
        return {"median_iter_s": 0.5 * ratio, "paired_wall_ratio_vs_none": ratio, "wall_ratio_vs_none": 9.9, **extra}  # fmt: skip

    return {
        "compute": "real",
        "config": {"num_pp": 2, "num_dp": 1},
        "modes": {
            "none": {**mode(1.0), "wall_per_iter_s": 1.0},
            "torch-save": mode(2.0),
            "baft": mode(1.1, ci_low=1.05, ci_high=1.2),
            "naive-async": mode(1.2, restores="no"),
            "dlrover-flash": mode(1.05),
        },
    }


RECOVERY = {
    "persist_every": 4,
    "rows": [
        {
            "scenario": "rank crash",
            "lost_iterations": 1,
            "total_s": 5.0,
            "replay_s": 0.0,
            "seconds": {},
        },  # fmt: skip
        {
            "scenario": "node loss",
            "lost_iterations": 2,
            "total_s": 8.0,
            "replay_s": 1.0,
            "seconds": {},
        },  # fmt: skip
        {
            "scenario": "power loss, cold (evicted) cache",
            "lost_iterations": 2,
            "total_s": 20.0,
            "seconds": {},
        },  # fmt: skip
    ],
}


def test_measured_inputs_and_sources() -> None:
    out = g.measured_goodput(_overhead(), RECOVERY, gpus=[1024], ref_mtbf_h=3.0, ref_gpus=16384)
    rows = {r["mode"]: r for r in out["modes"]}
    assert out["iter_s"] == 1.0 and out["bench_ranks"] == 2
    baft = rows["baft"]
    # the node-loss row: all phases + the replay outside them; its own lost iterations
    assert baft["downtime_s"] == 9.0 and baft["lost_iters"] == 2.0
    assert baft["overhead_ratio"] == 1.1  # the paired wall ratio, not the wall ratio
    assert baft["downtime_source"].startswith("measured") and "assumed" not in baft["downtime_source"]  # fmt: skip
    at = {a["gpus"]: a for a in baft["by_gpus"]}
    assert set(at) == {2, 1024}
    # 1024 GPUs: MTBF 48 h; Tc = 1.1, cost = 9 + 2 * 1.1 = 11.2 s
    assert at[1024]["efficiency"] == pytest.approx(1 / (1.1 + 1.1 / 172800 * 11.2))
    lo, hi = at[1024]["efficiency_ci"]  # a higher ratio -> a lower efficiency
    assert lo == pytest.approx(1 / (1.2 + 1.2 / 172800 * (9 + 2 * 1.2)))
    assert hi == pytest.approx(1 / (1.05 + 1.05 / 172800 * (9 + 2 * 1.05)))
    disk = rows["torch-save"]
    assert disk["downtime_s"] == 20.0 and disk["lost_iters"] == 0.5
    assert "assumed the same for torch-save" in disk["downtime_source"]
    assert disk["lost_source"].startswith("assumed")
    for mode in ("none", "dlrover-flash", "naive-async"):  # nothing survives / did not restore
        assert rows[mode]["reason"] and all(a["efficiency"] is None for a in rows[mode]["by_gpus"])  # fmt: skip
    assert "did not restore" in rows["naive-async"]["reason"]


def test_missing_recovery_row_is_named() -> None:
    out = g.measured_goodput(_overhead(), {"rows": []}, gpus=[8])
    baft = next(r for r in out["modes"] if r["mode"] == "baft")
    assert "none of the rows" in baft["reason"]


def _sim() -> dict:
    def row(exposed: float, lost: float, recovery: float, interval: int = 1) -> dict:
        return {"exposed_fraction": exposed, "expected_lost_s": lost, "recovery_s": recovery, "interval_iters": interval}  # fmt: skip

    return {
        "iteration_s": 2.0,
        "modes": {
            "baft": row(0.01, 62.0, 60.0),
            "naive-async": row(0.02, 62.0, 60.0),
            "sync": row(0.05, 200.0, 100.0, 100),
        },  # fmt: skip
        "differential": {"mode": {**row(0.0, 67.0, 60.0), "replay_s": 3.0}},
    }


def test_simulated_inputs_labels() -> None:
    measured = {r["mode"]: r for r in g.measured_goodput(_overhead(), RECOVERY, gpus=[4])["modes"]}  # fmt: skip

    def inputs(mode: str) -> g.ModeInputs:
        return g.ModeInputs(**{k: v for k, v in measured[mode].items() if k != "by_gpus"})

    baft = g.simulated_inputs("baft", inputs("baft"), _sim())
    assert baft.overhead_ratio == 1.0 and baft.overhead_source.startswith("simulated (differential")
    assert baft.downtime_s == 63.0 and baft.lost_iters == pytest.approx((67 - 60 - 3) / 2.0)
    assert baft.ci is None
    disk = g.simulated_inputs("torch-save", inputs("torch-save"), _sim())
    assert disk.overhead_ratio == 1.05 and disk.lost_iters == 50.0  # interval 100 / 2
    extra = {**_overhead()["modes"], "checkfreq": {"paired_wall_ratio_vs_none": 1.4, "median_iter_s": 1}}  # fmt: skip
    cf_in = g.mode_inputs("checkfreq", extra["checkfreq"], RECOVERY)
    cf = g.simulated_inputs("checkfreq", cf_in, _sim())
    assert cf.overhead_ratio == 1.4 and cf.overhead_source.startswith("MEASURED ratio held")
    assert cf.downtime_s == 100.0 and cf.lost_iters == 1.5  # the sync row's disk recovery
    none = g.simulated_inputs("none", inputs("none"), _sim())
    assert none.reason and none.downtime_s is None


def test_load_json_from_results_page(tmp_path: Path) -> None:
    page = tmp_path / "recovery.md"
    page.write_text("# page\n\n```json\n" + json.dumps(RECOVERY) + "\n```\n")
    assert g.load_json(page) == RECOVERY
    (tmp_path / "empty.md").write_text("no json")
    with pytest.raises(ValueError):
        g.load_json(tmp_path / "empty.md")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "o.json").write_text(json.dumps(_overhead()))
    (tmp_path / "r.json").write_text(json.dumps(RECOVERY))
    md = tmp_path / "page" / "goodput.md"
    a = _parse(["bench", "goodput", "--overhead", str(tmp_path / "o.json"), "--recovery",
                str(tmp_path / "r.json"), "--gpus", "16384", "--no-sim", "--json", "--markdown", str(md)])  # fmt: skip
    assert a.func(a) == 0
    out = json.loads(capsys.readouterr().out)
    baft = next(r for r in out["measured"]["modes"] if r["mode"] == "baft")
    assert [x["gpus"] for x in baft["by_gpus"]] == [2, 16384]
    assert "simulated" not in out and "Llama 3" in out["assumptions"]["mtbf"]
    text = md.read_text()
    assert "| baft | 1.100 [1.050, 1.200] | 9.00 | 2.0 |" in text
    assert "assumed the same for torch-save" in text and "SIMULATED" not in text


def test_cli_bad_input_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _parse(["bench", "goodput", "--overhead", str(tmp_path / "missing.json"), "--recovery", "x"])  # fmt: skip
    assert a.func(a) == 2
    assert "error" in capsys.readouterr().err
    a = _parse(["bench", "goodput", "--overhead", "x", "--recovery", "y", "--gpus", "0"])
    assert a.func(a) == 2


def test_simulated_rows_on_the_simulator() -> None:
    """One small cluster through the real simulator: rows labelled, efficiencies in (0, 1]."""
    inputs = [g.mode_inputs(m, v, RECOVERY) for m, v in _overhead()["modes"].items()]
    (sc,) = g.simulated_goodput(inputs, gpus=[512], preset="llama2-7b")
    assert sc["label"] == "simulated" and sc["gpus"] == 512
    rows = {r["mode"]: r for r in sc["modes"]}
    assert 0 < rows["baft"]["efficiency"] <= 1 and rows["baft"]["overhead_source"].startswith("simulated")  # fmt: skip
    assert rows["dlrover-flash"]["efficiency"] is None
