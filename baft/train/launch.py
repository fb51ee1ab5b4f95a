"""Launch a training job with torchrun (standalone, one process per rank).

Sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that elastic restarts on gloo do not reuse
stale peer addresses, and one compute thread per rank (two threads per rank on a 2-core
box made pipelines 3-6x slower).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from baft.config import TrainConfig, default_job_id


def torchrun_command(cfg_path: Path, nproc: int, max_restarts: int = 0) -> list[str]:
    """torchrun for the workers of ``cfg_path``'s run. Worker output goes to
    ``RUN_DIR/logs/`` (a crashed rank's peers' stack traces stay off the console); stdout
    is also shown (rank 0's progress and its one line per plan, failure and recovery)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        f"--log-dir={cfg_path.parent / 'logs'}",
        "--redirects=3",
        "--tee=1",
        "-m",
        "baft.train.worker",
        str(cfg_path),
    ]


def launch_env() -> dict[str, str]:
    env = dict(os.environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOGLEVEL", "ERROR")  # torchrun: one line per failed worker
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def prepare_run_dir(cfg: TrainConfig, *, resume: bool = False) -> Path:
    """Create the run directory and write the config the workers read.

    A new launch is a new job: earlier outputs, snapshot stores and DCP checkpoints of the
    same run directory are removed, unless ``resume``: then the job goes on from what its
    stores or DCP checkpoints hold (after a preemption, a stopped job, a replaced host).
    Restarts inside the launch keep everything.
    """
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ck = cfg.checkpoint
    if resume:
        if ck is not None:
            ck.job_id = ck.job_id or default_job_id(cfg.out_dir)
            ck.persist_dir = ck.persist_dir or str(out / "checkpoints")
        path = out / "config.json"
        path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        return path
    for name in (
        "metrics.jsonl",
        "summary.json",
        "recoveries.jsonl",
        "faults.jsonl",
        "hangs.jsonl",
        "plan_input.json",
    ):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "timeline", ignore_errors=True)
    shutil.rmtree(out / "progress", ignore_errors=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    if ck is not None:
        ck.job_id = ck.job_id or default_job_id(cfg.out_dir)
        ck.persist_dir = ck.persist_dir or str(out / "checkpoints")
        shutil.rmtree(Path(ck.store_root) / ck.job_id, ignore_errors=True)
        shutil.rmtree(ck.persist_dir, ignore_errors=True)
    path = out / "config.json"
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path


def launch(
    cfg: TrainConfig, *, max_restarts: int | None = None, quiet: bool = False, resume: bool = False
) -> int:
    """Run the job to completion; returns torchrun's exit code. ``resume``: continue the
    run directory's job instead of starting a new one."""
    cfg.validate()
    cfg_path = prepare_run_dir(cfg, resume=resume)
    if max_restarts is None:
        max_restarts = cfg.checkpoint.max_restarts if cfg.checkpoint else 0
    cmd = torchrun_command(cfg_path, cfg.parallel.world_size, max_restarts)
    stdout = subprocess.DEVNULL if quiet else None
    return subprocess.run(cmd, env=launch_env(), stdout=stdout, check=False).returncode
