"""``baft bench sweep``: the command list it plans and the summary page from synthetic JSON
(no launches)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("baft_bench")

from baft_bench import sweep  # noqa: E402
from baft_bench.cli import add_bench_parser, config_from_args  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_dry_run_prints_every_launch(capsys: pytest.CaptureFixture[str]) -> None:
    a = _parse(["bench", "sweep", "--dry-run", "--out", "R"])
    assert a.func(a) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8
    words = [shlex.split(line) for line in lines]
    flags = [dict(zip(w[3::2], w[4::2], strict=False)) for w in words]
    assert all(w[:3] == ["baft", "bench", "overhead"] and w[-1] == "--json" for w in words)
    assert [f["--d-model"] for f in flags[:3]] == ["256", "512", "768"]
    assert all(f["--layers"] == "8" for f in flags)
    assert flags[3]["--pp"] == "4"
    assert flags[4]["--dp"] == "2" and flags[4]["--batch"] == "8"
    assert [f["--schedule"] for f in flags[5:7]] == ["interleaved-1f1b", "zbv"]
    assert flags[7]["--dp-shard"] == "2" and flags[7]["--pp"] == "2"  # FSDP2 stages
    assert [f["--results-dir"] for f in flags] == [f"R/{c.name}" for c in sweep.SWEEP]
    assert all(f["--blocks"] == "4" and f["--block-iters"] == "2" for f in flags)
    assert all("--modes" not in f for f in flags)  # every installed mode, one launch each


def test_every_planned_launch_parses_and_validates() -> None:
    a = _parse(["bench", "sweep", "--modes", "none,baft", "--blocks", "8", "--block-iters", "4"])
    for cfg, words in sweep.plan(a):
        b = _parse(words)
        c = config_from_args(b)
        assert c.modes == ["none", "baft"] and c.num_blocks == 8 and c.block_iters == 4, cfg.name


def test_only_picks_and_rejects(capsys: pytest.CaptureFixture[str]) -> None:
    a = _parse(["bench", "sweep", "--dry-run", "--only", "zbv,pp4"])
    assert a.func(a) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "--schedule zbv" in out[0] and "--pp 4" in out[1]
    a = _parse(["bench", "sweep", "--dry-run", "--only", "pp8"])
    assert a.func(a) == 2
    assert "unknown configuration" in capsys.readouterr().err


def _result(ratios: dict[str, float], **extra: dict) -> dict:
    modes = {m: {"paired_wall_ratio_vs_none": r, "wall_per_iter_s": 0.3 * r, **extra.get(m, {})} for m, r in ratios.items()}  # fmt: skip
    return {"modes": modes, "state_bytes_per_rank": [146 * 2**20, 145 * 2**20], "skipped": {}}


def test_page_from_synthetic_json() -> None:
    entries = [
        {
            "name": "size-256",
            "what": "state size: d_model 256",
            "command": "baft bench overhead --d-model 256",
        },  # fmt: skip
        {
            "name": "pp4",
            "what": "pipeline depth 4",
            "command": "baft bench overhead --pp 4",
            "error": "exit code 1",
        },  # fmt: skip
        {
            "name": "zbv",
            "what": "zero-bubble V schedule",
            "command": "baft bench overhead --schedule zbv",
        },  # fmt: skip
    ]
    results = {
        "size-256": _result(
            {"none": 1.0, "baft": 1.0312}, baft={"ci_low": 1.01, "ci_high": 1.05, "k": 8}
        ),  # fmt: skip
        "zbv": _result({"none": 1.0, "baft": 1.2, "checkfreq": 1.5}),
    }
    results["zbv"]["skipped"] = {"dlrover-flash": "import failed"}
    page = sweep.render_page(entries, results, date="2026-12-06", argv="baft bench sweep")
    assert "| configuration | what | state MiB / rank | none wall ms | none | baft | checkfreq | K |" in page  # fmt: skip
    assert "| [size-256](size-256/) | state size: d_model 256 | 146, 145 | 300 | 1.000 | 1.031 [1.010, 1.050] | - | baft 8 |" in page  # fmt: skip
    assert "| [zbv](zbv/) | zero-bubble V schedule | 146, 145 | 300 | 1.000 | 1.200 | 1.500 | - |" in page  # fmt: skip
    assert "| pp4 | pipeline depth 4 | FAILED: exit code 1 |" in page
    assert "[ci_low, ci_high]" in page
    assert "baft bench overhead --schedule zbv" in page
    assert "- skipped zbv: dlrover-flash: import failed" in page


def test_page_without_ci_says_nothing_of_ci() -> None:
    entries = [{"name": "zbv", "what": "w", "command": "c"}]
    page = sweep.render_page(entries, {"zbv": _result({"none": 1.0})}, date="d", argv="a")
    assert "ci_low" not in page


def test_run_one_keeps_json_and_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Done:
        returncode = 0
        stdout = "noise\n" + json.dumps(_result({"none": 1.0})) + "\n"

    seen = {}

    def fake_run(argv: list[str], **kw: object) -> Done:
        seen["argv"] = argv
        return Done()

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    cfg = sweep.SWEEP[0]
    entry = sweep.run_one(cfg, ["bench", "overhead"], tmp_path)
    assert seen["argv"][1:] == ["-m", "baft.cli", "bench", "overhead"]
    assert entry["json"] == "size-256.json" and entry["rc"] == 0
    assert json.loads((tmp_path / "size-256.json").read_text())["modes"]["none"]
    Done.stdout = ""
    Done.returncode = 3
    assert "exit code 3" in sweep.run_one(cfg, ["x"], tmp_path)["error"]
