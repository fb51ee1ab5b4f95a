"""Entry point of one training process (started by torchrun through ``baft train``).

Usage: ``python -m baft.train.worker CONFIG_JSON``. Writes, under the run directory,
``metrics.jsonl`` (rank 0, one object per iteration), ``timeline/rank{r}.jsonl`` (every
rank) and ``summary.json`` (rank 0, at the end).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from baft.inprocess.run import run as baft_run
from baft.pipeline.mesh import init_mesh
from baft.pipeline.step import StepResult, combine_digests
from baft.train.config import TrainConfig
from baft.train.progress import Progress
from baft.train.trainer import Trainer


def _gather_metrics(trainer: Trainer, res: StepResult) -> dict[str, Any]:
    """One small all-reduce: mean loss over the ranks reading different data (DP replicas
    and FSDP2 shards), blocked and iteration seconds per rank."""
    world = dist.get_world_size()
    rank = trainer.mesh.rank
    c = trainer.mesh.coords
    par = trainer.cfg.parallel
    vec = torch.zeros(1 + 2 * world, dtype=torch.float64)
    if res.loss is not None and c.tp % par.num_tp == 0:  # one TP rank of each data slice
        vec[0] = res.loss / par.num_data_ranks
    vec[1 + rank] = res.timeline.blocked_s()
    vec[1 + world + rank] = res.timeline.iter_s
    dist.all_reduce(vec)
    values = vec.tolist()
    return {
        "iteration": res.iteration,
        "loss": values[0],
        "iter_s": max(values[1 + world :]),
        "blocked_s": values[1 : 1 + world],
    }


def _truncate_metrics(path: Path, resume: int) -> list[float]:
    """Keep metrics of iterations before ``resume`` (a restart redoes the rest)."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m["iteration"] < resume:
            kept.append(m)
    path.write_text("".join(json.dumps(m) + "\n" for m in kept))
    return [m["loss"] for m in kept]


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg`` on this process's rank; returns the summary (on every rank)."""
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        # A bit-identical trajectory after a restart needs deterministic kernels: a
        # fixed cuBLAS workspace (set before the first cuBLAS handle) and no atomics in
        # backward passes. warn_only: an op without a deterministic kernel says so.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Attention by the math kernel: the memory-efficient (and flash) backward
        # accumulate with atomics, and in warn_only mode torch keeps them (an H200 run of
        # the larger reference model diverged by 1e-6 from iteration 1 with them).
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    timeout_s = cfg.checkpoint.timeouts.collective_s if cfg.checkpoint else 120.0
    if cfg.checkpoint is not None and cfg.checkpoint.elastic.num_replicas:
        from baft.pipeline.elastic import elastic_dp  # the hosts torchrun gave this job

        par = cfg.parallel
        par.num_dp = elastic_dp(cfg.checkpoint.elastic.num_replicas, par.num_pp * par.num_tp)
    mesh = init_mesh(cfg.parallel, timeout_s=timeout_s)
    trainer = Trainer(cfg, mesh)  # builds the model and protects it through baft.protect
    out = Path(cfg.out_dir)
    (out / "timeline").mkdir(parents=True, exist_ok=True)
    is_main = mesh.rank == 0
    resume = trainer.restore()
    losses = _truncate_metrics(out / "metrics.jsonl", resume) if is_main else []
    timeline_file = open(out / "timeline" / f"rank{mesh.rank}.jsonl", "a")  # noqa: SIM115
    metrics_file = open(out / "metrics.jsonl", "a") if is_main else None  # noqa: SIM115
    progress = Progress(cfg.num_iterations, enabled=is_main)
    start = time.time()
    try:
        for it in range(resume, cfg.num_iterations):
            res = trainer.train_step(it)
            m = _gather_metrics(trainer, res)
            timeline_file.write(json.dumps(res.timeline.to_json()) + "\n")
            timeline_file.flush()
            m.update(trainer.metrics)
            losses.append(m["loss"])
            if metrics_file is not None:
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
            progress.update(it + 1, m["loss"], m["iter_s"])
        # the final digest exchange is a collective too: keep it under the watchdog
        # (trainer.close() stops it), so a rank that stops here is still detected and killed
        rank_digests = trainer.rank_digests()
        trainer.close()
        digest = combine_digests(rank_digests)
    finally:
        progress.close()
        timeline_file.close()
        if metrics_file is not None:
            metrics_file.close()
    summary = {
        "iterations": cfg.num_iterations,
        "final_loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "final_state_digest": digest,
        "rank_digests": rank_digests,
        "wall_s": time.time() - start,
        "world_size": dist.get_world_size(),
        "recoveries": _read_jsonl(out / "recoveries.jsonl"),
        "config": cfg.to_dict(),
    }
    if is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _show_baft_log() -> None:
    """The reference app shows baft's log (plan, recoveries, injections, warnings) on
    stderr, one line each (rank 0 everything from INFO on, other ranks warnings and
    errors); the library itself only logs (a user's script decides)."""
    log = logging.getLogger("baft")
    if not log.handlers:
        rank = os.environ.get("RANK", "?")
        # rank 0's lines go to stdout, which the launcher shows; every rank's warnings and
        # errors to stderr, which it keeps in RUN_DIR/logs
        handler = logging.StreamHandler(sys.stdout if rank == "0" else sys.stderr)
        handler.setFormatter(logging.Formatter(f"[baft rank {rank}] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if rank == "0" else logging.WARNING)
        log.propagate = False


def process_main(body: Callable[[], object]) -> int:
    """One rank's process under torchrun (the training worker, and others built like it):
    tracebacks on a fault (and after ``$BAFT_HANG_DUMP_S`` seconds, for hangs), ``body()``, then leave
    through a barrier and tear the process group down."""
    faulthandler.enable()
    _show_baft_log()
    if os.environ.get("BAFT_HANG_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["BAFT_HANG_DUMP_S"]), exit=True)
    try:
        body()
        dist.barrier()  # leave together: a gloo peer torn down early can abort the other
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_without_finalizing()
    return 0


def _exit_without_finalizing() -> None:
    """Leave a finished rank at once, skipping the interpreter's finalization.

    There, C++ objects of torch and gloo are destroyed in no fixed order, and a rank that
    had finished every iteration sometimes aborted ("terminate called without an active
    exception", SIGABRT: seen once in a hang test's restarted attempt and once at the end
    of a measurement launch); torchrun then restarts the whole group for a job that was done.
    Everything of the run is written and closed by now; logging and stdio are flushed
    here. A live child process (a peer library's saver) keeps the normal exit, which
    joins it."""
    if multiprocessing.active_children():
        return
    faulthandler.cancel_dump_traceback_later()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = TrainConfig.from_dict(json.loads(Path(argv[0]).read_text()))
    # under `-m baft.inprocess`, a peer's failure re-enters run() in this process
    return process_main(lambda: baft_run(run, cfg))


if __name__ == "__main__":
    sys.exit(main())
