"""lm-resiliency's restore after a rank crash, for ``baft bench recovery``.

The same job as the recovery bench's memory row (reference GPT, pp=2 on 2 ranks, one
rank per simulated node), protected the way the library documents it:
``enable_resiliency(model, optimizer, interval=1, ...)`` every iteration, replica on the
other rank, recovery mode ``latest``. Rank 1 is SIGKILLed at iteration ``kill_at``;
torchrun stops rank 0 with SIGTERM, on which the library flushes its own shard and the
replica it holds of rank 1 to node-local disk; the restarted job's ``enable_resiliency``
loads them (rank 1's state comes from its peer's replica). Phases: ``detect_restart`` (kill to
the new worker process, including the survivor's flush), ``rendezvous`` (process group
and model), ``load`` (``enable_resiliency`` with its recovery), ``first_iteration``.
Each rank records the state digest of the last two steps before the kill; the restored
state must match the recorded one of the step it resumes from.

Worker: ``python -m baft_bench.peer_recovery CONFIG_JSON`` under torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULT = "lm-resiliency-recovery.json"


def _now() -> float:
    return time.time()


def _worker(c: dict[str, Any], t_start: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    from baft.model.config import ModelConfig
    from baft.pipeline.mesh import init_mesh
    from baft.train.config import ParallelConfig, TrainConfig
    from baft.train.trainer import Trainer

    out = Path(c["out"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    cfg = TrainConfig(
        model=ModelConfig(num_layers=c["layers"], d_model=c["d_model"], num_heads=8, seq_len=32),
        parallel=ParallelConfig(
            num_dp=1, num_pp=2, schedule="1f1b", num_microbatches=4, ranks_per_node=1
        ),
        num_iterations=c["iterations"],
        global_batch=4,
        out_dir=str(out),
    )
    mesh = init_mesh(cfg.parallel)
    rank = mesh.rank
    trainer = Trainer(cfg, mesh)
    t_ready = _now()
    handle: Any = enable_resiliency(
        nn.ModuleList(trainer.modules),
        trainer.optimizer,
        framework="pytorch",
        interval=1,
        enable_detection=False,  # SCOUT detection builds NCCL groups
        checkpoint=InMemoryCkptConfig(
            replication_jump=1,
            disk_flush_interval=0,
            disk_folder=str(out / "gemini"),
            run_id="baft-bench-recovery",
            pin_memory=False,
        ),
        group=dist.group.WORLD,
        device=torch.device("cpu"),
        recovery_mode="latest",
    )
    t_loaded = _now()
    start = int(handle.step_count)  # optimizer steps done = next 0-based iteration
    restored = trainer.state_digest() if restart else ""
    first_s = 0.0
    for it in range(start, c["iterations"]):
        if restart == 0 and rank == 1 and it == c["kill_at"]:
            (out / "killed_at.txt").write_text(repr(_now()))
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = _now()
        trainer.run_step(it)
        if it == start:
            first_s = _now() - t0
        if restart == 0 and it + 1 >= c["kill_at"] - 1:  # digests of the last two steps
            digest = trainer.state_digest()
            if rank == 0:
                (out / f"digest-step{it + 1}.txt").write_text(digest)
    handle.close()
    if rank != 0 or restart == 0:
        return
    killed = float((out / "killed_at.txt").read_text())
    want = out / f"digest-step{start}.txt"
    result = {
        "restored_step": start,
        "lost_iterations": c["kill_at"] - start,
        "bit_exact": want.is_file() and want.read_text() == restored,
        "seconds": {
            "detect_restart": t_start - killed,
            "rendezvous": t_ready - t_start,
            "load": t_loaded - t_ready,
            "first_iteration": first_s,
        },
    }
    (out / RESULT).write_text(json.dumps(result) + "\n")


def run_lm_recovery(
    out: Path, *, layers: int, d_model: int, iterations: int, verbose: bool = False
) -> dict[str, Any]:
    """Launch the job (one restart allowed); returns the recovery bench's row."""
    import shutil

    from baft.train.launch import launch_env

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    kill_at = iterations // 3
    config = {
        "out": str(out),
        "layers": layers,
        "d_model": d_model,
        "iterations": iterations,
        "kill_at": kill_at,
    }
    path = out / "peer-recovery.json"
    path.write_text(json.dumps(config) + "\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=1", "--monitor-interval=0.1", "-m", "baft_bench.peer_recovery", str(path),
    ]  # fmt: skip
    stdout = None if verbose else subprocess.DEVNULL
    rc = subprocess.run(cmd, env=launch_env(), stdout=stdout, stderr=stdout).returncode
    if rc != 0 or not (out / RESULT).is_file():
        raise RuntimeError(f"the lm-resiliency recovery job failed (exit code {rc}); --verbose")
    r = json.loads((out / RESULT).read_text())
    if not r["bit_exact"]:
        raise RuntimeError(f"lm-resiliency restored step {r['restored_step']} is not bit-exact")
    s = r["seconds"]
    return {
        "scenario": "rank crash (lm-resiliency)",
        "source": "peer replica, flushed to local disk on SIGTERM",
        "restored_version": r["restored_step"],
        "lost_iterations": r["lost_iterations"],
        "shard_sources": {},
        "restore_s": s["load"],
        "total_s": sum(s.values()),
        "seconds": s,
    }


def main(argv: list[str] | None = None) -> int:
    import lm_resiliency  # noqa: F401  (imports before the clock starts, as baft's worker)

    from baft.train.worker import process_main

    t_start = _now()
    argv = sys.argv[1:] if argv is None else argv
    config = json.loads(Path(argv[0]).read_text())
    return process_main(lambda: _worker(config, t_start))


if __name__ == "__main__":
    sys.exit(main())
