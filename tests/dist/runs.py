"""Helpers for tests that launch real baft training jobs (torchrun, gloo, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from baft.config import ModelConfig, ParallelConfig, TrainConfig
from baft.train.launch import launch

TINY_MODEL = ModelConfig(num_layers=4, d_model=64, num_heads=4, seq_len=32)


def tiny_config(out: Path, **parallel: Any) -> TrainConfig:
    iterations = parallel.pop("iterations", 3)
    batch = parallel.pop("batch", 8)
    return TrainConfig(
        model=ModelConfig(**{f: getattr(TINY_MODEL, f) for f in TINY_MODEL.__slots__}),  # type: ignore[attr-defined]
        parallel=ParallelConfig(**parallel),
        num_iterations=iterations,
        global_batch=batch,
        out_dir=str(out),
    )


def run_job(cfg: TrainConfig, **kw: Any) -> dict[str, Any]:
    """Launch, assert success, return {'metrics': [...], 'summary': {...}}."""
    rc = launch(cfg, quiet=True, **kw)
    assert rc == 0, f"training failed with exit code {rc} (config {cfg})"
    out = Path(cfg.out_dir)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"metrics": metrics, "summary": summary, "out": out}


def read_timeline(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / "timeline" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
