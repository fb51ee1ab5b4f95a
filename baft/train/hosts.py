"""``baft train --elastic MIN``: a job of simulated hosts on this machine that loses and
regains them (:func:`launch_hosts`).

Every declared node (``--ranks-per-node`` ranks) runs as a host of its own, as on a
cluster: its own torchrun agent (loopback address ``127.0.0.<i+1>``, which orders the
hosts), its own ``BAFT_HOST_ID`` and store root (``<root>/h<i>``, its memory). The agents
meet in a c10d rendezvous this process hosts (it outlives every agent), with an elastic
node range ``--nnodes MIN:N`` and the settings measured in ``docs/elastic-launch.md``: a
host lost for good is out of the rendezvous within 3 s of its last heartbeat, the
survivors start the smaller job 2 s later, and a host that comes back grows it again.
``--lose-host H:ITER[:BACK]`` kills host ``H``'s agent and every process under it once
iteration ``ITER`` is done (from the run's ``metrics.jsonl``), and starts it again, its
memory as it was, once ``BACK`` is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from baft.train.config import TrainConfig
from baft.train.launch import WORKER, _descendants, launch_env, prepare_run_dir

log = logging.getLogger("baft")

RDZV_CONF = (
    "is_host=false,join_timeout=600,last_call_timeout=2,keep_alive_interval=1,"
    "keep_alive_max_attempt=3"
)
"""Measured in ``docs/elastic-launch.md``: a heartbeat bound of 3 s (2 x 1 s splits the job
in two after a grow), a last call of 2 s (1 s may form the small world again on a grow)."""


@dataclasses.dataclass
class _Loss:
    host: int
    at: int
    back: int | None
    lost: bool = False
    returned: bool = False


def host_configs(cfg: TrainConfig, cfg_path: Path) -> list[Path]:
    """One config file per host: the run's, with the host's own store root."""
    assert cfg.checkpoint is not None
    out = []
    for i in range(cfg.num_hosts):
        c = TrainConfig.from_dict(cfg.to_dict())
        assert c.checkpoint is not None
        c.checkpoint.store.root = str(Path(cfg.checkpoint.store.root) / f"h{i}")
        path = cfg_path.with_name(f"config.h{i}.json")
        path.write_text(json.dumps(c.to_dict(), indent=2) + "\n")
        out.append(path)
    return out


def _agent_command(
    cfg: TrainConfig, cfg_path: Path, i: int, port: int, max_restarts: int, entry: list[str]
) -> list[str]:
    nproc = cfg.parallel.world_size // cfg.num_hosts
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={cfg.elastic_min_hosts}:{cfg.num_hosts}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=baft-train",
        f"--rdzv-conf={RDZV_CONF}", f"--local-addr=127.0.0.{i + 1}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
        f"--log-dir={cfg_path.parent / 'logs' / f'h{i}'}", "--redirects=3",
        *(["--tee=1"] if i == 0 else []), *entry, str(cfg_path),
    ]  # fmt: skip


def _tree(pid: int) -> set[int]:
    return {pid} | _descendants(pid)


def lose(agent: subprocess.Popen[bytes]) -> None:
    """The host is gone: its agent and every process under it stopped (no new one can
    appear), then killed; torchrun starts each worker in a session of its own, so a
    process-group kill would leave them running."""
    stopped: set[int] = set()
    while True:
        new = _tree(agent.pid) - stopped
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= new
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _done_iteration(metrics: Path) -> int:
    """The last iteration rank 0 recorded (-1 before the first)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["iteration"])
        except (ValueError, KeyError):
            continue
    return -1


def launch_elastic(cfg: TrainConfig, *, resume: bool = False, worker: str = WORKER) -> int:
    """:func:`baft.train.launch.launch` for an elastic run (``cfg.elastic_min_hosts``):
    the run directory prepared the same way, then :func:`launch_hosts`."""
    cfg.validate()
    cfg_path = prepare_run_dir(cfg, resume=resume)
    inprocess = cfg.inprocess and cfg.instrument
    entry = ["-m", "baft.inprocess", "-m", worker] if inprocess else ["-m", worker]
    return launch_hosts(cfg, cfg_path, cfg.max_restarts, entry, launch_env())


def launch_hosts(
    cfg: TrainConfig, cfg_path: Path, max_restarts: int, entry: list[str], env: dict[str, str]
) -> int:
    """Run the job on its simulated hosts to its end, losing and restarting hosts as
    ``cfg.lose_hosts`` says; returns 0 when every agent still running ended with 0."""
    import torch.distributed as dist

    rdzv = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    paths = host_configs(cfg, cfg_path)

    def start(i: int) -> subprocess.Popen[bytes]:
        cmd = _agent_command(cfg, paths[i], i, rdzv.port, max_restarts, entry)
        return subprocess.Popen(
            cmd, env={**env, "BAFT_HOST_ID": f"h{i}"}, start_new_session=True,
            stdout=None if i == 0 else subprocess.DEVNULL,
        )  # fmt: skip

    agents = {i: start(i) for i in range(cfg.num_hosts)}
    plan = [
        _Loss(int(p[0]), int(p[1]), int(p[2]) if len(p) > 2 else None)
        for p in (s.split(":") for s in cfg.lose_hosts)
    ]
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    stopping = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for a in agents.values():
            if a.poll() is None:
                a.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while any(a.poll() is None for a in agents.values()):
            done = _done_iteration(metrics)
            for loss in plan:
                if not loss.lost and done >= loss.at and not stopping:
                    log.warning("--lose-host: host h%d lost for good after iteration %d", loss.host, done)  # fmt: skip
                    lose(agents[loss.host])
                    loss.lost = True
                elif (
                    loss.lost and not loss.returned and loss.back is not None and done >= loss.back
                ):
                    log.warning("--lose-host: host h%d back after iteration %d", loss.host, done)
                    agents[loss.host] = start(loss.host)
                    loss.returned = True
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for a in agents.values():
            if a.poll() is None:
                lose(a)
    lost = {loss.host for loss in plan if loss.lost and not loss.returned}
    codes = [a.returncode for i, a in agents.items() if i not in lost]
    return next((c for c in codes if c), 0)
