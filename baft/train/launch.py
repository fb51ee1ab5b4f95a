"""Launch a training job with torchrun (standalone, one process per rank).

Sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that elastic restarts on gloo do not reuse
stale peer addresses, and one compute thread per rank (two threads per rank on a 2-core
box made pipelines 3-6x slower).

SIGTERM to the launcher (a scheduler's preemption, a wrapper's ``kill``) goes on to
torchrun, which passes it to the workers: they agree, flush the newest state to DCP and
exit. The launcher returns only once torchrun and every worker are gone (bounded, see
:func:`run_agent`), with the workers' verdict: 0 when a DCP checkpoint holds every
finished iteration, non-zero otherwise. A wrapper that waits for ``baft train`` may then
read the checkpoint at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from baft.config import default_job_id
from baft.train.config import TrainConfig

log = logging.getLogger("baft")

AGENT_GRACE_S = 30.0
"""How long torchrun waits for its workers after passing a signal on, before SIGKILL."""


WORKER = "baft.train.worker"
"""The module torchrun runs on every rank: ``python -m WORKER CONFIG_JSON``."""


def torchrun_command(
    cfg_path: Path,
    nproc: int,
    max_restarts: int = 0,
    worker: str = WORKER,
    *,
    inprocess: bool = False,
) -> list[str]:
    """torchrun for the workers of ``cfg_path``'s run. Worker output goes to
    ``RUN_DIR/logs/`` (a crashed rank's peers' stack traces stay off the console); stdout
    is also shown (rank 0's progress and its one line per plan, failure and recovery).
    ``worker``: another entry module taking the same argument (one that wraps
    :func:`baft.train.worker.main`). ``inprocess``: every rank runs under its supervisor
    (``-m baft.inprocess``), which replaces a failed worker while the others stay."""
    entry = ["-m", "baft.inprocess", "-m", worker] if inprocess else ["-m", worker]
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
        *entry,
        str(cfg_path),
    ]


def launch_env() -> dict[str, str]:
    env = dict(os.environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOGLEVEL", "ERROR")  # torchrun: one line per failed worker
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # in-process recovery: the reference app's modules come with the forkserver's imports
    env.setdefault(
        "BAFT_INPROCESS_PRELOAD", "baft.train.trainer"
    )  # not the worker: runpy runs it as __main__
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
            ck.store.job_id = ck.store.job_id or default_job_id(cfg.out_dir)
            ck.persist.dir = ck.persist.dir or str(out / "checkpoints")
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
    for sized in out.glob("plan_input.w*.json"):  # every world size's saved inputs
        sized.unlink(missing_ok=True)
    shutil.rmtree(out / "timeline", ignore_errors=True)
    shutil.rmtree(out / "progress", ignore_errors=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    if ck is not None:
        ck.store.job_id = ck.store.job_id or default_job_id(cfg.out_dir)
        ck.persist.dir = ck.persist.dir or str(out / "checkpoints")
        shutil.rmtree(Path(ck.store.root) / ck.store.job_id, ignore_errors=True)
        for i in range(cfg.num_hosts if cfg.elastic_min_hosts else 0):  # the hosts' memories
            shutil.rmtree(Path(ck.store.root) / f"h{i}" / ck.store.job_id, ignore_errors=True)
        shutil.rmtree(ck.persist.dir, ignore_errors=True)
    path = out / "config.json"
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path


def launch(
    cfg: TrainConfig,
    *,
    max_restarts: int | None = None,
    quiet: bool = False,
    resume: bool = False,
    worker: str = WORKER,
) -> int:
    """Run the job to completion; returns torchrun's exit code. ``resume``: continue the
    run directory's job instead of starting a new one. ``worker``: the entry module of
    every rank (see :func:`torchrun_command`)."""
    cfg.validate()
    cfg_path = prepare_run_dir(cfg, resume=resume)
    if max_restarts is None:
        max_restarts = cfg.max_restarts if cfg.checkpoint else 0
    inprocess = cfg.inprocess and cfg.checkpoint is not None and cfg.instrument
    if cfg.elastic_min_hosts:  # a host per declared node: baft.train.hosts launches it
        raise ValueError("an elastic run launches through baft.train.hosts.launch_elastic")
    cmd = torchrun_command(
        cfg_path, cfg.parallel.world_size, max_restarts, worker, inprocess=inprocess
    )
    stdout = subprocess.DEVNULL if quiet else None
    ck = cfg.checkpoint
    flush_s = ck.timeouts.flush_s if ck is not None else 0.0
    return run_agent(
        cmd,
        stdout=stdout,
        wait_s=AGENT_GRACE_S + flush_s + 30.0,
        verdict=lambda: _flush_verdict(cfg),
    )


def run_agent(
    cmd: list[str],
    *,
    stdout: int | None = None,
    wait_s: float = 90.0,
    verdict: Callable[[], bool] = lambda: False,
) -> int:
    """Run torchrun ``cmd`` to its end; returns its exit code, or after a SIGTERM the
    workers' verdict.

    A SIGTERM to this process is passed on to torchrun (which passes it to its workers,
    waits up to 30 s and then kills them), and this process waits for torchrun and every
    process under it for at most ``wait_s`` seconds, then kills what is left. It returns
    0 when torchrun succeeded or, torchrun having exited on the signal, ``verdict()``
    says the workers' flush holds every finished iteration; else torchrun's code, or
    128 + SIGTERM."""
    agent = subprocess.Popen(cmd, env=launch_env(), stdout=stdout)
    stopping = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        if agent.poll() is None and not stopping.is_set():
            stopping.set()
            log.warning(
                "SIGTERM: passed on to the workers; waiting up to %.0f s for them to flush "
                "and exit",
                wait_s,
            )
            agent.send_signal(signum)

    installed = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, forward) if installed else None
    try:
        rc = _wait_agent(agent, stopping, wait_s)
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
    if not stopping.is_set() or rc == 0:
        return rc
    if verdict():
        log.warning("SIGTERM: the workers flushed and exited; the checkpoint is complete")
        return 0
    log.error(
        "SIGTERM: the workers exited without a checkpoint of every finished iteration "
        "(torchrun exit code %d)",
        rc,
    )
    return rc if rc > 0 else 128 + signal.SIGTERM


def _wait_agent(agent: subprocess.Popen[bytes], stopping: threading.Event, wait_s: float) -> int:
    """torchrun's exit code once it and every process under it are gone; after a
    forwarded signal at most ``wait_s`` seconds, then what is left is killed."""
    while True:
        try:
            agent.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if stopping.is_set():
                break
    deadline = time.monotonic() + wait_s
    tree = _descendants(agent.pid)
    while agent.poll() is None and time.monotonic() < deadline:
        tree |= _descendants(agent.pid)
        time.sleep(0.05)
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.05)
    left = [p for p in tree if _alive(p)]
    if agent.poll() is None or left:
        log.error(
            "SIGTERM: torchrun or %d worker(s) still running after %.0f s: killing them",
            len(left),
            wait_s,
        )
        for pid in left:
            _kill(pid)
        agent.kill()
    return agent.wait()


def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _flush_verdict(cfg: TrainConfig) -> bool:
    """Whether the run's newest complete DCP checkpoint holds every iteration a rank
    finished (what a SIGTERM flush writes)."""
    from baft.recover.report import progress_seen
    from baft.store.disk import latest_version

    ck = cfg.checkpoint
    if ck is None or not ck.persist.dir:
        return False
    latest = latest_version(ck.persist.dir)
    return latest is not None and latest >= progress_seen(Path(cfg.out_dir))
