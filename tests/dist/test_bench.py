"""A real 2-rank ``baft bench overhead`` run (torchrun, gloo, CPU) with a tiny model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from baft_bench.cli import add_bench_parser, run_bench
from baft.model.config import ModelConfig
from baft.model.gpt import build_stage_module

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch", "4"]


def _rank_state_bytes(num_layers: int, d_model: int, seq_len: int) -> list[int]:
    """Model + AdamW bytes per pipeline rank: 3 float32 tensors per parameter + a step."""
    cfg = ModelConfig(num_layers=num_layers, d_model=d_model, num_heads=2, seq_len=seq_len)
    sizes = []
    for stage in range(2):
        params = list(build_stage_module(cfg, stage, 2, seed=0).parameters())
        sizes.append(sum(3 * p.numel() * 4 + 4 for p in params))
    return sizes


def _run(tmp_path: Path, *flags: str) -> int:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "overhead", *TINY, "--out", str(tmp_path / "run"), *flags])
    return run_bench(args)


@pytest.mark.slow  # default tier: unit test_bench_overhead, test_bench_stats (the harness)
@pytest.mark.timeout(180)
def test_overhead_none_vs_torch_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = _run(
        tmp_path,
        "--modes", "none,torch-save", "--blocks", "1", "--block-iters", "2",
        "--warmup", "1", "--json", "--results-dir", str(tmp_path / "results"),
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)  # stdout is exactly one JSON object
    assert set(result) >= {"sync_snapshot_fraction", "compute", "modes", "config", "machine"}
    assert result["compute"] == "real"
    assert list(result["modes"]) == ["none", "torch-save"]
    keys = {"median_iter_s", "ratio_vs_none", "exposed_s", "in_bubble_fraction", "bytes_per_iter"}
    for m in result["modes"].values():
        assert keys <= set(m)
        assert m["num_iters"] == 2
    sizes = _rank_state_bytes(2, 32, 16)
    assert result["state_bytes_per_rank"] == sizes
    ts = result["modes"]["torch-save"]
    assert ts["bytes_per_rank"] == sizes
    assert ts["bytes_per_iter"] == sum(sizes)
    assert ts["in_bubble_fraction"] == 0.0 and ts["exposed_s"] > 0
    none = result["modes"]["none"]
    assert none["bytes_per_iter"] == 0 and none["exposed_s"] == 0
    assert none["in_bubble_fraction"] is None and none["ratio_vs_none"] == 1.0
    assert result["sync_snapshot_fraction"] > 0
    pages = list((tmp_path / "results").glob("overhead-real-*.md"))
    assert len(pages) == 1 and pages[0].with_suffix(".png").is_file()
    assert pages[0].with_suffix(".raw.json").is_file()
    assert "| torch-save |" in pages[0].read_text()
    assert not (tmp_path / "run" / "ckpt").exists()  # checkpoint files cleaned up
