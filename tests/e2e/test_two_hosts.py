"""A real two-host job on one machine: a host dies and its replacement takes other ranks.

Two torchrun agents (``--nnodes 2``, c10d rendezvous on a store the test hosts, so it
outlives any agent) play two hosts: each has its own ``BAFT_HOST_ID``, loopback address
and store root. Host ``b`` (ranks 2,3) is killed with its workers mid-run and its memory
wiped; a replacement ``c`` joins. When its address sorts first torchrun gives it ranks
0,1 and the survivor ``a`` (which holds shards 0,1) now runs ranks 2,3: shards 0,1 move
from ``a``'s memory, shards 2,3 are rebuilt from the parity ``a`` holds. When it sorts
last the ranks keep their hosts. Either way the job restores from memory, loses at most
one iteration and ends bit-identical to a failure-free run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from baft.config import CheckpointConfig, StoreConfig, TimeoutConfig
from baft.plan.types import CheckpointPolicy
from baft.train.config import TrainConfig
from baft.train.launch import launch_env, prepare_run_dir
from tests.dist.runs import run_job, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
JOB = "two-hosts"


def _config(out: Path, store_root: Path | None, full_every: int = 1) -> TrainConfig:
    cfg = tiny_config(
        out, iterations=40, batch=8, num_dp=2, num_pp=2, num_microbatches=2, ranks_per_node=2
    )
    if store_root is not None:
        cfg.checkpoint = CheckpointConfig(
            policy=CheckpointPolicy(redundancy="xor:2", persist_every=0, full_every=full_every),
            profile_iters=2,
            store=StoreConfig(root=str(store_root), job_id=JOB),
            timeouts=TimeoutConfig(collective_s=20.0),
        )
        cfg.max_restarts = 3
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(cfg_path: Path, host: str | None, addr: str, port: int, log: Path) -> subprocess.Popen:
    """One torchrun agent; ``host`` None: no ``BAFT_HOST_ID`` (the detected host)."""
    env = launch_env()
    env.pop("BAFT_HOST_ID", None)
    if host is not None:
        env["BAFT_HOST_ID"] = host
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=baft-two-hosts",
        "--rdzv-conf=is_host=false,join_timeout=300",
        f"--local-addr={addr}",
        "--max-restarts=3",
        "--monitor-interval=0.1",
        "-m",
        "baft.train.worker",
        str(cfg_path),
    ]
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def _kill_host(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and every descendant (torchrun starts workers in their own
    sessions, so the agent's process group alone would leave them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, doomed = [agent.pid], []
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        todo += children.get(pid, [])
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _iterations_done(out: Path) -> int:
    """Iterations every rank finished, from the run's progress record."""
    done = []
    for r in range(4):
        try:
            done.append(int((out / "progress" / f"rank{r}").read_text()) + 1)
        except (OSError, ValueError):
            done.append(0)
    return min(done)


def _wait(procs: dict[str, subprocess.Popen], timeout_s: float, logs: Path) -> None:
    deadline = time.time() + timeout_s
    for name, p in procs.items():
        try:
            rc = p.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            text = "".join((logs / f"{n}.log").read_text()[-4000:] for n in procs)
            for q in procs.values():
                if q.poll() is None:
                    _kill_host(q)
            pytest.fail(f"agent {name} ended with {rc}:\n{text}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job without failures (one standalone agent)."""
    return run_job(_config(tmp_path_factory.mktemp("ref"), None))


# replacement's address -> (ranks' hosts after the restart, each shard's (kind, stores))
CASES = {
    "sorts-first": (
        "127.0.0.1",
        {"0": "c", "1": "c", "2": "a", "3": "a"},
        {
            "0": ("remote", ["a:node0/rank0"]),
            "1": ("remote", ["a:node0/rank1"]),
            "2": ("parity", ["a:node0/rank0"]),
            "3": ("parity", ["a:node0/rank1"]),
        },
    ),
    "keeps-order": (
        "127.0.0.4",
        {"0": "a", "1": "a", "2": "c", "3": "c"},
        {
            "0": ("local", ["a:node0/rank0"]),
            "1": ("local", ["a:node0/rank1"]),
            "2": ("parity", ["a:node0/rank0"]),
            "3": ("parity", ["a:node0/rank1"]),
        },
    ),
}


def _kill_and_replace(
    tmp_path: Path, ref: dict[str, Any], full_every: int, new: str, addr: str, host_ids: bool
) -> dict[str, Any]:
    """Agents ``a`` and ``b`` (each its own store root; ``BAFT_HOST_ID`` = its name when
    ``host_ids``) train; ``b`` dies with its workers after iteration 7 and its root is
    wiped; agent ``new`` (root ``new``, address ``addr``) joins. Asserts the job restored
    from memory and ended bit-identical to ``ref``; returns the last recovery record."""
    import torch.distributed as dist

    roots = Path("/dev/shm") / f"baft-2h-{tmp_path.name}"
    out = tmp_path / "run"
    try:
        cfg_a = _config(out, roots / "a", full_every)
        cfg_a.validate()
        path_a = prepare_run_dir(cfg_a)  # clean run directory, config for host a
        paths = {"a": path_a}
        for host in ("b", "c"):
            cfg = _config(out, roots / host, full_every)
            paths[host] = out / f"config-{host}.json"
            paths[host].write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        for host in ("a", "b", "c"):
            (roots / host).mkdir(parents=True, exist_ok=True)
        port = _free_port()
        rdzv = dist.TCPStore(  # the rendezvous outlives every agent
            "127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=300)
        )
        logs = tmp_path

        def host(name: str) -> str | None:
            return name if host_ids else None

        a = _agent(paths["a"], host("a"), "127.0.0.2", port, logs / "a.log")
        b = _agent(paths["b"], host("b"), "127.0.0.3", port, logs / "b.log")
        deadline = time.time() + 240
        while _iterations_done(out) < 7 and time.time() < deadline:
            time.sleep(0.05)
            assert a.poll() is None and b.poll() is None, (logs / "a.log").read_text()[-3000:]
        assert _iterations_done(out) >= 7, "the job did not get going"
        _kill_host(b)  # host b dies with its workers and memory
        shutil.rmtree(roots / "b")
        (roots / new).mkdir(parents=True, exist_ok=True)
        c = _agent(paths[new], host(new), addr, port, logs / f"{new}2.log")
        _wait({"a": a, f"{new}2": c}, 420, logs)
        del rdzv
        recs = [json.loads(x) for x in (out / "recoveries.jsonl").read_text().splitlines()]
        last: dict[str, Any] = recs[-1]
        assert last["source"] == "memory", last["reason"]
        assert last["lost_iterations"] <= 1, last
        summary = json.loads((out / "summary.json").read_text())
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["loss"] for m in metrics] == [m["loss"] for m in ref["metrics"]]
        assert summary["final_state_digest"] == ref["summary"]["final_state_digest"]
        return last
    finally:
        shutil.rmtree(roots, ignore_errors=True)


@pytest.mark.parametrize("full_every", [1, 3], ids=["full", "differential"])
@pytest.mark.parametrize("case", list(CASES))
def test_replacement_host_restores_from_the_survivors_memory(
    tmp_path: Path, reference: dict[str, Any], case: str, full_every: int
) -> None:
    """Full snapshots and differential checkpoints (full_every=3: every payload of the
    window is found wherever its shard sits)."""
    addr, want_hosts, want_origins = CASES[case]
    last = _kill_and_replace(tmp_path, reference, full_every, "c", addr, host_ids=True)
    assert last["hosts"] == want_hosts, last
    got = {r: (o["kind"], o["stores"]) for r, o in last["origins"].items()}
    assert got == want_origins, last


def test_declared_nodes_on_one_machine_without_host_ids(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Issue 28, bug 4: the way a user tries failover before buying a second host. Two
    agents on one machine, each with its own store root, ranks_per_node=2 and no
    BAFT_HOST_ID: both detect the same host. Agent b is killed, its root wiped and the
    same command restarted. The declared nodes are the failure domains: each store root
    is its own memory, so shards 2,3 are rebuilt from the parity in a's root."""
    last = _kill_and_replace(tmp_path, reference, 1, "b", "127.0.0.3", host_ids=False)
    kinds = {r: o["kind"] for r, o in last["origins"].items()}
    assert sorted(kinds.values()) == ["local", "local", "parity", "parity"], last
