"""Launch a matrix case as a user would (torchrun agents), hit it from outside, check it.

One agent (``--standalone``, two declared nodes by ``ranks_per_node``) or two agents (one
per declared node, c10d rendezvous on a store this process hosts, own store roots, with or
without ``BAFT_HOST_ID``), each running the case's entry under its ``launch``: ``-m
baft.inprocess`` before it (a supervisor per rank, holding the training process it forks,
named ``baft-rankR``) or the entry itself (torchrun's group restart). Faults come from
outside the job, where a user's would: signals to the training processes (the workers
found by their ``RANK`` under the agents, or the supervisors' ``baft-rankR`` children),
a node's every process killed and its store directory removed, agents killed and the same
commands launched again. :func:`run_case` returns the failures it found, each with the
commands that reproduce it.
"""

from __future__ import annotations

import contextlib
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
ITERATIONS = 20
"""Iterations of every matrix job. A fault lands after iteration 7..12 (:func:`inject`);
with 16 the user script's small model once ran its last four iterations before the
harness's kill landed (CI, 2026-12-07): rank 1 died in ``close()``, rank 0 had ended,
and the victim's agent waited 300 s for a rendezvous that could not come. Eight
iterations of margin keep the fault inside training."""
TIMEOUT_S = 10.0
"""Watchdog and collective timeout of every protected job (a hang is detected after it)."""
MAX_RESTARTS = 4
ADDRS = {name: f"127.0.0.{i}" for i, name in enumerate("abcdefgh", start=2)}
"""Agents' addresses: a and b start a two-agent job, the rest replace lost hosts."""
MARK = "BAFT_MX_JOB"
"""Environment variable naming the job in every process it starts (to reap stray ones)."""


def entry(case: Case) -> list[str]:
    """What comes before the app's entry in the torchrun command: the supervisor
    (``-m baft.inprocess``) or nothing (group restart)."""
    return ["-m", "baft.inprocess"] if case.launch == "inprocess" else []


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


def user_args(
    case: Case, out: Path, store_root: Path | None, job_id: str = "", iterations: int = ITERATIONS
) -> list[str]:
    dp, pp, tp = case.dims
    if case.app == "fsdp2":  # the torchtitan-shaped example: its dp is FSDP2's dp_shard
        args = [str(FSDP2_SCRIPT), f"--out={out}", f"--iterations={iterations}"]
        args += [f"--dp-shard={dp}", f"--pp={pp}", f"--tp={tp}"]
    else:
        args = [str(USER_SCRIPT), f"--out={out}", f"--iterations={iterations}", f"--dp={dp}"]
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
    nproc: int,
    log_dir: Path,
    rdzv: tuple[int, str, str] | None,
    max_restarts: int = MAX_RESTARTS,
    redirect: bool = True,
) -> list[str]:
    """The agent's command. ``redirect``: workers write to files under ``log_dir``, one
    directory per restart (else into the agent's output: their exits race the agent's
    differently, as a user's plain ``torchrun`` does)."""
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
    cmd += [f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
    return cmd + ([f"--log-dir={log_dir}", "--redirects=3"] if redirect else [])


# --- processes, found from outside ---


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launched job and every process under it (a SIGKILLed torchrun agent
    leaves its workers behind), then reap it."""
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


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


def _environ(pid: int) -> list[bytes] | None:
    """A live process's environment (None: gone, a zombie or not readable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return None if state == "Z" else env


def rank_pids(agent: subprocess.Popen) -> dict[int, list[int]]:
    """Rank -> every live process under ``agent`` started with that ``RANK`` (a worker
    and what it started: under ``baft.inprocess`` the supervisor, its forkserver and
    the training process)."""
    out: dict[int, list[int]] = {}
    for pid in descendants(agent.pid):
        for var in _environ(pid) or []:
            if var.startswith(b"RANK="):
                out.setdefault(int(var[5:]), []).append(pid)
    return out


def worker_pids(agent: subprocess.Popen) -> dict[int, int]:
    """Rank -> pid of the live workers under ``agent``."""
    return {r: pids[-1] for r, pids in rank_pids(agent).items()}


def training_pids(root: int) -> dict[int, int]:
    """Rank -> pid of the live training processes under ``root`` that ``baft.inprocess``
    supervisors forked (named ``baft-rankR``; not their own children, which inherit the
    name)."""
    named: dict[int, tuple[int, int]] = {}
    for pid in descendants(root):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm.startswith("baft-rank") and stat[0] != "Z":
            named[pid] = (int(comm[len("baft-rank") :]), int(stat[1]))
    return {rank: pid for pid, (rank, ppid) in named.items() if ppid not in named}


def reap(mark: str) -> list[int]:
    """SIGKILL every process whose environment has ``MARK=mark`` (what a job left behind
    when its agents were gone: a supervisor's orphaned forkserver or training process)."""
    needle = f"{MARK}={mark}".encode()
    doomed = [
        int(p.name)
        for p in Path("/proc").glob("[0-9]*")
        if int(p.name) != os.getpid() and needle in (_environ(int(p.name)) or [])
    ]
    signal_all(doomed, signal.SIGSTOP)
    signal_all(doomed, signal.SIGKILL)
    return doomed


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
    inject: list[str] = field(default_factory=list)
    """Faults the job injects itself (``ft.inject``: ``baft train --inject``, the user
    script's ``--inject``), for points no outside signal can aim at."""
    redirect: bool = True
    """Workers' output to files (``--redirects=3``), or into the agent's log."""
    extra_args: list[str] = field(default_factory=list)
    """More arguments to the user script (``--after-close=S``...)."""
    before: dict[int, int] = field(default_factory=dict)
    """The training processes (rank -> pid) just before the fault."""
    victims: list[int] = field(default_factory=list)
    """The ranks whose training process the fault killed or stopped."""
    seen: dict[int, set[int]] = field(default_factory=dict)
    """Rank -> every training process seen from the fault to the job's end (:meth:`wait`
    with ``watch``)."""

    @property
    def job_id(self) -> str:
        return f"mx-{self.case.seed:08x}"

    @property
    def inprocess(self) -> bool:
        return self.case.launch == "inprocess"

    def command(self, host: str, port: int | None) -> list[str]:
        c, out = self.case, self.out
        two = c.hosts != "one"
        nproc = c.world // 2 if two else c.world
        rdzv = (port, f"mx{self.launches}", ADDRS[host]) if two and port else None
        logs = out / f"logs-{host}-{self.launches}"
        head = torchrun(nproc, logs, rdzv, self.max_restarts, self.redirect)
        store = self.root / host
        if c.app == "gpt":
            cfg = gpt_config(c, out, store, self.job_id, self.iterations, self.max_restarts)
            cfg.inject = list(self.inject)
            cfg.validate()
            path = out / f"config-{host}.json"
            path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            return [*head, *entry(c), "-m", "baft.train.worker", str(path)]
        args = user_args(c, out, store, self.job_id, self.iterations)
        args += [*self.extra_args, *(f"--inject={f}" for f in self.inject)]
        return [*head, *entry(c), *args]

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
        env[MARK] = self.root.name
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

    def wait(self, timeout_s: float, watch: bool = False) -> dict[str, int | None]:
        """The agents' exit codes (None: killed after ``timeout_s``). ``watch``: meanwhile
        note every training process seen (:attr:`seen`), every 0.1 s."""
        deadline = time.monotonic() + timeout_s
        while watch and time.monotonic() < deadline:
            if all(a.poll() is not None for a in self.agents.values()):
                break
            for rank, pid in self.workers().items():
                self.seen.setdefault(rank, set()).add(pid)
            time.sleep(0.1)
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
        """Rank -> pid of each live training process: torchrun's workers, or under
        ``inprocess`` the processes the supervisors forked."""
        out: dict[int, int] = {}
        for agent in self.agents.values():
            out.update(training_pids(agent.pid) if self.inprocess else worker_pids(agent))
        return out

    def commands_hosts(self) -> set[str]:
        """Every host name an agent was started as (a lost host's name is not reused)."""
        return {key.split("#")[0] for key in self.commands}

    def host_of(self, rank: int) -> str:
        """The agent whose processes run ``rank`` now."""
        for host, agent in self.agents.items():
            if rank in rank_pids(agent):
                return host
        raise RuntimeError(f"no agent runs rank {rank}")

    def lose_host(self, lost: str, new: str) -> None:
        """``lost`` dies (its agent and every process under it, its store wiped) and a
        replacement agent ``new`` joins with the same command."""
        kill_agent(self.agents.pop(lost))
        shutil.rmtree(self.root / lost, ignore_errors=True)
        self.spawn(new, self.port)

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
    caller to clean up).

    kill and hang hit a training process (under ``inprocess`` the supervisor's child,
    not the supervisor). node and node0 lose the declared node without rank 0 or rank
    0's: every process of its ranks (supervisors, forkservers, training processes) with
    one agent, which survives; with two agents the host running that rank, agent
    included, whose replacement joins with the same command. Either way its store is
    wiped."""
    c = job.case
    at = rng.randint(7, 10) if c.full_every == "1" else rng.randint(10, 12)
    wait_for(job, at)
    time.sleep(rng.uniform(0.0, 0.03))
    workers = job.workers()
    victim = rng.randrange(c.world)
    if c.fault in ("kill", "hang"):
        if victim not in workers:
            raise RuntimeError(f"no training process of rank {victim} found: {workers}")
        job.before, job.victims = workers, [victim]
        sig = signal.SIGKILL if c.fault == "kill" else signal.SIGSTOP
        signal_all([workers[victim]], sig)
        stopped.append(workers[victim])
        return f"{c.fault} rank {victim} (pid {workers[victim]}) after iteration {at}"
    if c.fault in ("node", "node0"):
        node = 0 if c.fault == "node0" else 1
        if c.hosts == "one":  # the node's ranks stop, lose their memory, die
            ranks = range(node * c.world // 2, (node + 1) * c.world // 2)
            procs = rank_pids(job.agents["a"])
            pids = [p for r in ranks for p in procs.get(r, [])]
            signal_all(pids, signal.SIGSTOP)
            shutil.rmtree(job.root / "a" / job.job_id / f"node{node}", ignore_errors=True)
            signal_all(pids, signal.SIGKILL)
            return f"node {node} (ranks {list(ranks)}: pids {pids}) lost after iteration {at}"
        rank0 = job.host_of(0)
        lost = rank0 if node == 0 else next(h for h in sorted(job.agents) if h != rank0)
        new = next(h for h in ADDRS if h not in job.agents and h not in job.commands_hosts())
        job.lose_host(lost, new)
        return (
            f"host {lost} ({'rank 0' if node == 0 else 'not rank 0'}) lost (agent and every "
            f"process under it killed, store wiped), replacement {new} joined after iteration {at}"
        )
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
        args = user_args(case, out, None, iterations=iterations)
        cmd = [*torchrun(case.world, out / "logs", None), *args]
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
    if case.fault in ("kill", "node", "node0", "hang"):
        if any(s != "memory" for s in sources):
            problems.append(
                "recoveries not all from memory: "
                f"{[(r.get('source'), r.get('reason')) for r in recs]}"
            )
        if job.inprocess:
            problems += check_inprocess(case, job, recs)
        if case.fault in ("kill", "hang"):
            problems += check_suspects(job, set(job.victims))
    elif recs and recs[-1].get("source") != "disk":
        problems.append(
            f"the relaunch restored from {recs[-1].get('source')}, not DCP: "
            f"{recs[-1].get('reason')}"
        )
    elif case.fault == "sigterm" and recs and recs[-1].get("lost_iterations") != 0:
        problems.append(f"the SIGTERM flush lost iterations: {recs[-1]}")
    return problems


def generation(rec: dict[str, Any]) -> int:
    """The in-process generation a recovery record names (0: not an in-process one)."""
    return int((rec.get("inprocess") or {}).get("generation", 0))


def check_inprocess(case: Case, job: Job, recs: list[dict[str, Any]]) -> list[str]:
    """Under ``baft.inprocess``: a killed or frozen training process is replaced in
    place (every record in-process, no group restart) while the survivors keep their
    processes; a lost node may also fall back to torchrun's group restart."""
    problems: list[str] = []
    how = [(r.get("attempt"), r.get("inprocess")) for r in recs]
    if case.fault in ("kill", "hang"):
        if any(generation(r) < 1 or r.get("attempt") != 0 for r in recs):
            problems.append(f"not recovered in-process: (attempt, inprocess) {how}")
        moved = {
            r: sorted(job.seen.get(r, set()))
            for r, pid in job.before.items()
            if r not in job.victims and job.seen.get(r, set()) - {pid}
        }
        if moved:
            problems.append(
                f"survivors did not keep their processes: before {job.before}, seen {moved}"
            )
        if any(not job.seen.get(v, set()) - {job.before[v]} for v in job.victims):
            problems.append(
                f"no replacement seen for ranks {job.victims}: before {job.before}, seen {job.seen}"
            )
    elif any(generation(r) < 1 and int(r.get("attempt", 0)) < 1 for r in recs):
        problems.append(f"neither in-process nor a group restart: (attempt, inprocess) {how}")
    return problems


def check_suspects(job: Job, hit: set[int]) -> list[str]:
    """The watchdogs' hang records name only ranks in ``hit`` (a hang is attributed to the
    rank that froze, never to a healthy one)."""
    hangs = read_jsonl(job.out / "hangs.jsonl")
    wrong = [h for h in hangs if h.get("suspect") is not None and h["suspect"] not in hit]
    return [
        f"a watchdog named rank {h['suspect']} (the fault hit {sorted(hit)}): rank "
        f"{h.get('detected_by')} attempt {h.get('attempt')} generation {h.get('generation')}: "
        f"{h.get('reason')}"
        for h in wrong
    ]


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
        rcs = job.wait(360, watch=job.inprocess and case.fault in ("kill", "hang"))
        problems = check(case, job, rcs, ref)
        if problems:
            recs = read_jsonl(job.out / "recoveries.jsonl")
            problems += [
                f"recovery: {r.get('source')} v{r.get('restored_version')} {r.get('sources')} "
                f"(attempt {r.get('attempt')}, in-process {r.get('inprocess')}): {r.get('reason')}"
                for r in recs
            ]
            problems.append(job.tail())
        return problems, f"fault: {did}\n{repro(case, job)}"
    finally:
        if case.fault == "hang":  # the watchdog should have killed it already
            signal_all(stopped, signal.SIGKILL)
        stop_job(job)


def stop_job(job: Job) -> None:
    """Whatever of ``job`` still runs is killed (agents, processes that escaped them), its
    rendezvous store closed and its store root removed."""
    for agent in job.agents.values():
        if agent.poll() is None:
            kill_agent(agent)
    reap(job.root.name)
    job.rdzv = None
    shutil.rmtree(job.root, ignore_errors=True)
