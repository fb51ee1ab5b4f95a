"""Helpers for tests that launch real baft training jobs (torchrun, gloo, CPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from baft.model.config import ModelConfig
from baft.train.config import ParallelConfig, TrainConfig
from baft.plan.inputs import PLAN_INPUT_FILE
from baft.train.launch import launch, launch_env, prepare_run_dir, torchrun_command

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


def run_job(
    cfg: TrainConfig, *, plan_input: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """Launch, assert success, return {'metrics': [...], 'summary': {...}}.

    ``plan_input``: the planner inputs the job finds saved in its run directory, as a
    restarted job would (it plans from them at once instead of profiling).
    """
    if plan_input is None:
        rc = launch(cfg, quiet=True, **kw)
    else:  # launch() starts from a clean run directory: prepare it, then add the input
        cfg.validate()
        cfg_path = prepare_run_dir(cfg)
        (Path(cfg.out_dir) / PLAN_INPUT_FILE).write_text(json.dumps(plan_input))
        assert cfg.checkpoint is not None
        cmd = torchrun_command(cfg_path, cfg.parallel.world_size, cfg.max_restarts)
        rc = subprocess.run(cmd, env=launch_env(), stdout=subprocess.DEVNULL).returncode
    assert rc == 0, f"training failed with exit code {rc} (config {cfg})"
    out = Path(cfg.out_dir)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"metrics": metrics, "summary": summary, "out": out}


def read_timeline(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / "timeline" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
