"""Launch a matrix case as a user would (torchrun agents), hit it from outside, check it.

One agent (``--standalone``, two declared nodes by ``ranks_per_node``) or two agents (one
per declared node, c10d rendezvous on a store this process hosts, own store roots, with or
without ``BAFT_HOST_ID``). Faults come from outside the job: signals to worker processes
found by their ``RANK`` under the agents, store directories removed, agents killed and
the same commands launched again. :func:`run_case` returns the failures it found, each
with the commands that reproduce it.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from baft.config import CheckpointConfig, PersistConfig, StoreConfig, TimeoutConfig
from baft.model.config import ModelConfig
from baft.plan.types import CheckpointPolicy
from baft.train.config import ParallelConfig, TrainConfig
from baft.train.launch import launch_env
from tests.e2e.matrix import REDUNDANCY, Case

REPO = Path(__file__).resolve().parents[2]
USER_SCRIPT = REPO / "tests" / "e2e" / "user_script.py"
FSDP2_SCRIPT = REPO / "examples" / "fsdp2_pipeline.py"
ITERATIONS = 16
TIMEOUT_S = 10.0
"""Watchdog and collective timeout of every protected job (a hang is detected after it)."""
MAX_RESTARTS = 4
ADDRS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4", "d": "127.0.0.5", "e": "127.0.0.6"}


def microbatches(case: Case) -> int:
    return max(2, case.dims[1])


def gpt_config(
    case: Case,
    out: Path,
    store_root: Path | None,
    job_id: str = "",
    iterations: int = ITERATIONS,
    max_restarts: int = MAX_RESTARTS,
) -> TrainConfig:
    dp, pp, tp = case.dims
    interleaved = case.schedule == "interleaved-1f1b"
    cfg = TrainConfig(
        model=ModelConfig(num_layers=8 if interleaved and pp > 2 else 4, d_model=64, num_heads=4, seq_len=32),
        parallel=ParallelConfig(
            num_dp=dp, num_pp=pp, num_tp=tp, num_dp_shard=case.dp_shard, schedule=case.schedule,
            num_microbatches=microbatches(case), ranks_per_node=case.world // 2,
        ),
        num_iterations=iterations,
        global_batch=dp * case.dp_shard * microbatches(case) * 2,
        out_dir=str(out),
    )  # fmt: skip
    if store_root is not None:
        cfg.checkpoint = CheckpointConfig(
            policy=CheckpointPolicy(
                redundancy=REDUNDANCY[case.redundancy],
                persist_every=2 if case.persist == "on" else 0,
                full_every=0 if case.full_every == "auto" else int(case.full_every),
            ),
            profile_iters=2,
            store=StoreConfig(root=str(store_root), job_id=job_id),
            persist=PersistConfig(dir=str(out / "checkpoints")),
            timeouts=TimeoutConfig(collective_s=TIMEOUT_S),
        )
        cfg.max_restarts = max_restarts
    return cfg


def user_args(case: Case, out: Path, store_root: Path | None, job_id: str = "") -> list[str]:
    dp, pp, tp = case.dims
    if case.app == "fsdp2":  # the torchtitan-shaped example: its dp is FSDP2's dp_shard
        args = [str(FSDP2_SCRIPT), f"--out={out}", f"--iterations={ITERATIONS}"]
        args += [f"--dp-shard={dp}", f"--pp={pp}", f"--tp={tp}"]
    else:
        args = [str(USER_SCRIPT), f"--out={out}", f"--iterations={ITERATIONS}", f"--dp={dp}"]
    args += [f"--schedule={case.schedule}", f"--microbatches={microbatches(case)}"]
    if case.app == "user-unique":
        args.append("--unique-fqns")
    if store_root is None:
        return [*args, "--unprotected"]
    return [
        *args,
        f"--redundancy={REDUNDANCY[case.redundancy]}",
        f"--persist-every={2 if case.persist == 'on' else 0}",
        f"--full-every={0 if case.full_every == 'auto' else case.full_every}",
        f"--ranks-per-node={case.world // 2}",
        f"--store-root={store_root}",
        f"--job-id={job_id}",
        f"--timeout={TIMEOUT_S}",
    ]


def torchrun(
    nproc: int, log_dir: Path, rdzv: tuple[int, str, str] | None, max_restarts: int = MAX_RESTARTS
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if rdzv is None:
        cmd.append("--standalone")
    else:
        port, rdzv_id, addr = rdzv
        cmd += [
            "--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv_id}", "--rdzv-conf=is_host=false,join_timeout=300",
            f"--local-addr={addr}",
        ]  # fmt: skip
    return cmd + [
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        f"--log-dir={log_dir}",
        "--redirects=3",
    ]


# --- processes, found from outside ---


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found[1:]


def worker_pids(agent: subprocess.Popen) -> dict[int, int]:
    """Rank -> pid of the live workers under ``agent``."""
    out: dict[int, int] = {}
    for pid in descendants(agent.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        for var in env:
            if var.startswith(b"RANK="):
                out[int(var[5:])] = pid
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_agent(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and every descendant (workers run in their own sessions)."""
    doomed = [agent.pid, *descendants(agent.pid)]
    signal_all(doomed, signal.SIGSTOP)
    signal_all(doomed, signal.SIGKILL)
    agent.wait()


def iterations_done(out: Path, world: int) -> int:
    done = []
    for r in range(world):
        try:
            done.append(int((out / "progress" / f"rank{r}").read_text()) + 1)
        except (OSError, ValueError):
            done.append(0)
    return min(done)


# --- one launch of a case ---


@dataclass
class Job:
    """The agents of one case: ``hosts`` maps host name -> (store root, its command)."""

    case: Case
    out: Path
    root: Path
    env: dict[str, str]
    commands: dict[str, list[str]] = field(default_factory=dict)
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    rdzv: Any = None
    port: int | None = None
    launches: int = 0
    iterations: int = ITERATIONS
    max_restarts: int = MAX_RESTARTS
    log: list[str] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        return f"mx-{self.case.seed:08x}"

    def command(self, host: str, port: int | None) -> list[str]:
        c, out = self.case, self.out
        two = c.hosts != "one"
        nproc = c.world // 2 if two else c.world
        rdzv = (port, f"mx{self.launches}", ADDRS[host]) if two and port else None
        head = torchrun(nproc, out / f"logs-{host}-{self.launches}", rdzv, self.max_restarts)
        store = self.root / host
        if c.app == "gpt":
            cfg = gpt_config(c, out, store, self.job_id, self.iterations, self.max_restarts)
            cfg.validate()
            path = out / f"config-{host}.json"
            path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            return [*head, "-m", "baft.train.worker", str(path)]
        return [*head, *user_args(c, out, store, self.job_id)]

    def start(self, hosts: list[str]) -> None:
        port = None
        if self.case.hosts != "one":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            import torch.distributed as dist

            self.port = port
            self.rdzv = dist.TCPStore(  # outlives every agent
                "127.0.0.1", port, is_master=True, multi_tenant=True,
                timeout=timedelta(seconds=300),
            )  # fmt: skip
        for host in hosts:
            self.spawn(host, port)

    def spawn(self, host: str, port: int | None) -> None:
        (self.root / host).mkdir(parents=True, exist_ok=True)
        cmd = self.command(host, port)
        env = dict(self.env)
        if self.case.hosts == "hostid":
            env["BAFT_HOST_ID"] = f"mx-{host}"
        self.commands[f"{host}#{self.launches}"] = cmd
        prefix = f"BAFT_HOST_ID=mx-{host} " if "BAFT_HOST_ID" in env else ""
        self.log.append(f"agent {host}: {prefix}{shlex.join(cmd)}")
        with open(self.out / f"agent-{host}-{self.launches}.log", "w") as f:
            self.agents[host] = subprocess.Popen(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=REPO,
            )  # fmt: skip

    def wait(self, timeout_s: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout_s
        rcs: dict[str, int | None] = {}
        for host, agent in self.agents.items():
            try:
                rcs[host] = agent.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rcs[host] = None
        for agent in self.agents.values():
            if agent.poll() is None:
                kill_agent(agent)
        return rcs

    def workers(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for agent in self.agents.values():
            out.update(worker_pids(agent))
        return out

    def tail(self, chars: int = 3000) -> str:
        """The agents' output and the end of every worker log that has a traceback."""
        texts = []
        for log in sorted(self.out.glob("agent-*.log")):
            texts.append(f"--- {log.name}\n{log.read_text()[-chars:]}")
        for log in sorted(self.out.glob("logs-*/**/*.log")):
            text = log.read_text(errors="replace")
            if "Traceback" in text:
                texts.append(f"--- {log.relative_to(self.out)}\n{text[-chars:]}")
        return "\n".join(texts)


def start_job(case: Case, out: Path, root: Path) -> Job:
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    out.mkdir(parents=True)
    job = Job(case=case, out=out, root=root, env=launch_env())
    job.start(["a"] if case.hosts == "one" else ["a", "b"])
    return job


def wait_for(job: Job, iterations: int, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while iterations_done(job.out, job.case.world) < iterations:
        if time.monotonic() > deadline or any(a.poll() is not None for a in job.agents.values()):
            raise RuntimeError(f"the job did not reach iteration {iterations}")
        time.sleep(0.005)


def relaunch(job: Job, hosts: list[str]) -> None:
    """The same commands again after the whole job went down (a new rendezvous round)."""
    job.launches += 1
    job.agents = {}
    job.start(hosts)


def inject(job: Job, rng: random.Random, stopped: list[int]) -> str:
    """The case's fault at a random moment from iteration 7..10 on (10..12 with
    differential checkpoints possible: ``full_every=auto`` may pick k=8, and a version is
    rebuildable from memory only once the first rotation is a whole window old, 2
    profiled + 8 iterations; before that a restore falls back to DCP or starts over by
    design); returns what it did (a stopped worker's pid is added to ``stopped``, for the
    caller to clean up)."""
    c = job.case
    at = rng.randint(7, 10) if c.full_every == "1" else rng.randint(10, 12)
    wait_for(job, at)
    time.sleep(rng.uniform(0.0, 0.03))
    workers = job.workers()
    victim = rng.randrange(c.world)
    if c.fault in ("kill", "hang"):
        sig = signal.SIGKILL if c.fault == "kill" else signal.SIGSTOP
        signal_all([workers[victim]], sig)
        stopped.append(workers[victim])
        return f"{c.fault} rank {victim} (pid {workers[victim]}) after iteration {at}"
    if c.fault == "node":
        if c.hosts == "one":  # ranks of declared node 1 stop, lose their memory, die
            ranks = range(c.world // 2, c.world)
            pids = [workers[r] for r in ranks if r in workers]
            signal_all(pids, signal.SIGSTOP)
            shutil.rmtree(job.root / "a" / job.job_id / "node1", ignore_errors=True)
            signal_all(pids, signal.SIGKILL)
            return f"node 1 (ranks {list(ranks)}) lost after iteration {at}"
        kill_agent(job.agents.pop("b"))
        shutil.rmtree(job.root / "b", ignore_errors=True)
        job.spawn("c", job.port)
        return f"host b lost (agent and workers killed, store wiped), replacement c joined after iteration {at}"
    hosts = sorted(job.agents)
    if c.fault == "power":
        for agent in job.agents.values():
            kill_agent(agent)
    else:  # sigterm: torchrun stops its workers, they flush to DCP and exit
        for agent in job.agents.values():
            agent.send_signal(signal.SIGTERM)
        for agent in job.agents.values():
            try:
                agent.wait(120)
            except subprocess.TimeoutExpired:
                kill_agent(agent)
    shutil.rmtree(job.root, ignore_errors=True)  # every host's memory is gone
    if c.hosts != "one":
        job.rdzv = None
    relaunch(job, hosts)
    return f"{c.fault} after iteration {at}: every store wiped, same commands relaunched"


# --- results ---


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def gpt_result(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    metrics = read_jsonl(out / "metrics.jsonl")
    return {
        "losses": {m["iteration"]: m["loss"] for m in metrics},
        "iterations": [m["iteration"] for m in metrics],
        "state": {
            "rank_digests": summary["rank_digests"],
            "final": summary["final_state_digest"],
        },
    }


def user_result(out: Path, world: int) -> dict[str, Any]:
    losses: dict[int, float] = {}
    for path in sorted(out.glob("losses.attempt*.json")):
        losses.update({int(k): v for k, v in json.loads(path.read_text()).items()})
    state = {r: json.loads((out / f"state.rank{r}.json").read_text()) for r in range(world)}
    return {"losses": losses, "iterations": sorted(losses), "state": state}


def reference(case: Case, out: Path, iterations: int = ITERATIONS) -> dict[str, Any]:
    """The same training without baft (``--no-checkpoint`` / ``--unprotected``)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if case.app == "gpt":
        from baft.train.launch import prepare_run_dir

        cfg = gpt_config(case, out, None, iterations=iterations)
        cfg.validate()
        cmd = [*torchrun(case.world, out / "logs", None), "-m", "baft.train.worker"]
        cmd.append(str(prepare_run_dir(cfg)))
    else:
        cmd = [*torchrun(case.world, out / "logs", None), *user_args(case, out, None)]
    with open(out / "agent.log", "w") as f:
        rc = subprocess.run(
            cmd, env=launch_env(), stdout=f, stderr=subprocess.STDOUT, cwd=REPO
        ).returncode
    if rc != 0:
        raise RuntimeError(
            f"reference failed ({rc}): {shlex.join(cmd)}\n{(out / 'agent.log').read_text()[-3000:]}"
        )
    return gpt_result(out) if case.app == "gpt" else user_result(out, case.world)


def check(case: Case, job: Job, rcs: dict[str, int | None], ref: dict[str, Any]) -> list[str]:
    """What is wrong with the finished job (empty: bit-identical, recovered as expected)."""
    problems: list[str] = []
    recs = read_jsonl(job.out / "recoveries.jsonl")
    sources = [r.get("source") for r in recs]
    if case.fault == "power" and case.persist == "off":
        # nothing durable and every memory gone: a loud refusal, never a silent start over
        if all(rc == 0 for rc in rcs.values()):
            problems.append(f"power loss without DCP ended with rc 0 (recoveries {sources})")
        elif not any(m in job.tail(100_000) for m in ("refusing to start over", "nothing can")):
            problems.append("power loss without DCP failed without saying nothing can be restored")
        return problems
    if any(rc != 0 for rc in rcs.values()):
        return [f"agents ended with {rcs}"]
    problems += check_training(case, job, ref, ITERATIONS)
    if not recs:
        problems.append("no recovery was recorded")
    if case.fault in ("kill", "node", "hang"):
        if any(s != "memory" for s in sources):
            problems.append(
                "recoveries not all from memory: "
                f"{[(r.get('source'), r.get('reason')) for r in recs]}"
            )
    elif recs and recs[-1].get("source") != "disk":
        problems.append(
            f"the relaunch restored from {recs[-1].get('source')}, not DCP: "
            f"{recs[-1].get('reason')}"
        )
    elif case.fault == "sigterm" and recs and recs[-1].get("lost_iterations") != 0:
        problems.append(f"the SIGTERM flush lost iterations: {recs[-1]}")
    return problems


def check_training(case: Case, job: Job, ref: dict[str, Any], iterations: int) -> list[str]:
    """Losses and every rank's final state against the unprotected run's."""
    try:
        got = gpt_result(job.out) if case.app == "gpt" else user_result(job.out, case.world)
    except (OSError, KeyError, ValueError) as e:
        return [f"results missing: {e!r}"]
    problems: list[str] = []
    if case.app == "gpt" and got["iterations"] != list(range(iterations)):
        problems.append(f"iterations logged {got['iterations']}")
    diff = [i for i, v in got["losses"].items() if ref["losses"].get(i) != v]
    if diff:
        problems.append(f"losses differ from the unprotected run at iterations {diff}")
    if got["state"] != ref["state"]:
        if case.app == "gpt":
            digests = ref["state"]["rank_digests"]
            bad = sorted(k for k, v in got["state"]["rank_digests"].items() if digests.get(k) != v)
        else:
            bad = sorted(r for r in got["state"] if got["state"][r] != ref["state"][r])
        problems.append(f"final state differs from the unprotected run on {bad}")
    return problems


def repro(case: Case, job: Job | None) -> str:
    lines = [
        f"reproduce: BAFT_MATRIX_CASE={case.id} .venv/bin/pytest -q tests/e2e/test_matrix.py -k test_case"
    ]
    if job is not None:
        lines += [f"  {x}" for x in job.log]
    return "\n".join(lines)


def run_case(case: Case, tmp: Path, ref: dict[str, Any]) -> tuple[list[str], str]:
    """Run ``case`` once: (problems, description with the commands that reproduce it)."""
    rng = random.Random(case.seed)
    root = Path("/dev/shm") / f"baft-mx-{tmp.name}"
    job = start_job(case, tmp / "run", root)
    stopped: list[int] = []
    did = "nothing"
    try:
        try:
            did = inject(job, rng, stopped)
        except RuntimeError as e:
            rcs = job.wait(1)
            return [f"fault not delivered: {e} (agents {rcs})\n{job.tail()}"], did
        rcs = job.wait(360)
        problems = check(case, job, rcs, ref)
        if problems:
            recs = read_jsonl(job.out / "recoveries.jsonl")
            problems += [
                f"recovery: {r.get('source')} v{r.get('restored_version')} {r.get('sources')}: "
                f"{r.get('reason')}"
                for r in recs
            ]
            problems.append(job.tail())
        return problems, f"fault: {did}\n{repro(case, job)}"
    finally:
        for agent in job.agents.values():
            if agent.poll() is None:
                kill_agent(agent)
        if case.fault == "hang":  # the watchdog should have killed it already
            signal_all(stopped, signal.SIGKILL)
        job.rdzv = None
        shutil.rmtree(root, ignore_errors=True)
