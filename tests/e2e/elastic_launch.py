"""Launch an elastic multi-host job on one machine, lose a host for good, bring it back.

A library for the elastic-shrink tests (issue 39), plus the measurement that chose its
defaults (``python -m tests.e2e.elastic_launch``, see ``docs/elastic-launch.md``).

Each "host" is one torchrun agent with its own loopback address and ``BAFT_HOST_ID``,
started in its own session; the c10d rendezvous lives in a store this process hosts
(:func:`start_rendezvous`), so it outlives every agent, and every agent is told not to host
it (``is_host=false``). With ``--nnodes 1:2`` the job runs on both hosts, goes on on the
survivor alone when a host is lost for good (:func:`lose_host`: the agent and every
process under it SIGKILLed), and grows back when the host's agent is started again.

torchrun orders the hosts by address (a node's ``(addr, pid, local id)``, compared as
strings): the host at ``127.0.0.1`` gets ranks ``0..nproc-1``.

Note: torchrun starts every worker in a session of its own, so ``os.killpg`` of the
agent's group alone would leave the workers running; :func:`lose_host` kills the agent's
whole process tree (and anything carrying its mark that escaped it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from baft.train.launch import _descendants
from tests.e2e.jobs import _environ

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "e2e" / "elastic_probe.py"

# --- the settings -------------------------------------------------------------------
# Measured with ``python -m tests.e2e.elastic_launch`` (2 CPU cores shared with other
# work, load 4-6, torch 2.13 CPU; docs/elastic-launch.md has every run): with these
# defaults a host killed at a random moment -> the survivor iterating with world 2 in
# 7.23 s median [6.80, 7.99] over 5 runs (its all-reduce fails 0.04 s after the kill, its
# agent restarts at 0.58 s, the rendezvous completes at 4.88 s, the new workers import
# torch and iterate 2.25 s later); the host's agent started again -> world 4 in 6.94 s
# [6.34, 7.20] (torch's defaults: 15 s to forget the lost host + 30 s of last call).

LAST_CALL_S = 2
"""``last_call_timeout`` (integer seconds, torch's default 30): how long a round that has
``min_nodes`` waits for more before it completes. A shrink waits it out in full (the
survivor is alone). 1 s shrank in 6.48 s [5.97, 6.87] (3 runs) instead of 7.23 s, but the
returning host joined the grow's round 0.47-0.74 s after the survivor (it polls the
rendezvous once a second), so with 1 s a late poll forms the 1-host world again (one more
membership restart); 2 s leaves a second of margin. At a job's start a host whose agent
joins more than this after the first one's is left out of the first world (it comes in
through a membership restart, measured): :func:`wait_for_world` the full world before
injecting anything."""
KEEP_ALIVE_INTERVAL_S = 1
"""``keep_alive_interval`` (integer seconds, torch's default 5): how often each agent
writes its heartbeat into the rendezvous state."""
KEEP_ALIVE_MAX_ATTEMPT = 3
"""``keep_alive_max_attempt`` (torch's default 3): a node whose heartbeat is older than
``interval x attempts`` (here 3 s, torch's default 15 s) is dead and removed; the lost
host's node must go before the survivor can form a new round, so this bounds a shrink's
rendezvous from below. **Never 2 with an interval of 1**: right after every round an
agent's own heartbeat is 2.03-2.05 s old (its join loop's last beat, then the first tick
of its timer one interval after the round), and a node that finds its own heartbeat
expired removes itself and never beats again; when that empties the rendezvous, the host
that comes back forms a world of its own beside the running one (two worlds of one job,
2 runs of 2; :func:`split_brain`). 3 leaves ~1 s for an agent's stall; an agent stalled
longer (seen once here: 20 s, every process of the host) drops out the same way. Across
real hosts the bound also absorbs clock skew (heartbeats carry the writer's wall time)."""
JOIN_TIMEOUT_S = 600
"""``join_timeout`` (torch's default): how long a node may wait to join. Not on a
shrink's path (``min_nodes`` = 1 is always met)."""
MONITOR_INTERVAL_S = 0.1
"""``--monitor-interval`` (torchrun's default): how often the agent looks at its workers
and, while they are healthy, at the rendezvous's waiting nodes (a grow; that read is
cached for 1 s). The agent saw its workers fail 0.43-0.67 s after the kill, the time the
failed workers take to exit, so a shorter interval gains nothing."""
MAX_RESTARTS = 3
"""``--max-restarts``: a host loss costs every surviving agent one (its workers FAILED:
``TORCHELASTIC_RESTART_COUNT`` 0 -> 1); a grow (a membership change) costs none, and the
returning host's workers start at 0 (restart counts differ within one world)."""


def rdzv_conf(
    *,
    last_call_s: int = LAST_CALL_S,
    keep_alive_interval_s: int = KEEP_ALIVE_INTERVAL_S,
    keep_alive_max_attempt: int = KEEP_ALIVE_MAX_ATTEMPT,
    join_timeout_s: int = JOIN_TIMEOUT_S,
) -> str:
    """The ``--rdzv-conf`` of every agent (the rendezvous is hosted by the test)."""
    return (
        f"is_host=false,join_timeout={join_timeout_s},last_call_timeout={last_call_s},"
        f"keep_alive_interval={keep_alive_interval_s},"
        f"keep_alive_max_attempt={keep_alive_max_attempt}"
    )


RDZV_CONF = rdzv_conf()
RDZV_DEBUG = (
    "import logging, sys; from torch.distributed.run import main; "
    "logging.getLogger('torch.distributed.elastic.rendezvous').setLevel(logging.DEBUG); "
    "sys.argv[0] = 'torchrun'; main()"
)
MARK = "BAFT_ELASTIC_AGENT"
"""In every process an agent starts: a token per agent launch (finds escaped processes)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_rendezvous(port: int | None = None) -> tuple[int, Any]:
    """The rendezvous store, hosted here so that it outlives every agent: ``(port,
    store)``; keep ``store`` referenced for the job's life."""
    import torch.distributed as dist

    for _ in range(20):
        p = port or free_port()
        try:
            store = dist.TCPStore(
                "127.0.0.1", p, is_master=True, multi_tenant=True,
                timeout=timedelta(seconds=300), wait_for_workers=False,
            )  # fmt: skip
            return p, store
        except (RuntimeError, OSError):
            if port is not None:
                raise
    raise RuntimeError("no free port for the rendezvous store")


def agent_command(
    script_args: list[str],
    *,
    addr: str,
    port: int,
    nnodes: str = "1:2",
    nproc: int = 2,
    inprocess: bool = False,
    rdzv_id: str = "baft-elastic",
    rdzv_conf: str = RDZV_CONF,
    max_restarts: int = MAX_RESTARTS,
    monitor_interval: float = MONITOR_INTERVAL_S,
    rdzv_debug: bool = False,
) -> list[str]:
    """One host's torchrun command; ``script_args`` = the script and its arguments.
    ``rdzv_debug``: the agent also logs the rendezvous's every decision (joins, rounds,
    heartbeats, nodes removed as dead), which torchrun's ``LOGLEVEL`` does not reach."""
    launcher = ["-m", "torch.distributed.run"]
    if rdzv_debug:
        launcher = ["-c", RDZV_DEBUG]
    return [
        sys.executable, *launcher,
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={rdzv_conf}", f"--local-addr={addr}",
        f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval}",
        *(["-m", "baft.inprocess"] if inprocess else []),
        *[str(a) for a in script_args],
    ]  # fmt: skip


def agent_env(host_id: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    out = dict(os.environ)
    out.update(
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # else gloo reads stale peers after a restart
        OMP_NUM_THREADS="1",
        LOGLEVEL="INFO",  # the agent's restarts and rendezvous rounds (read by agent_events)
        TORCH_CPP_LOG_LEVEL="ERROR",
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    out.update(env or {})
    out["BAFT_HOST_ID"] = host_id
    out[MARK] = f"{host_id}-{uuid.uuid4().hex[:12]}"
    return out


def start_agent(
    script_args: list[str],
    *,
    host_id: str,
    addr: str,
    port: int,
    log: Path,
    env: Mapping[str, str] | None = None,
    nnodes: str = "1:2",
    nproc: int = 2,
    inprocess: bool = False,
    rdzv_id: str = "baft-elastic",
    rdzv_conf: str = RDZV_CONF,
    max_restarts: int = MAX_RESTARTS,
    monitor_interval: float = MONITOR_INTERVAL_S,
    rdzv_debug: bool = False,
) -> subprocess.Popen[bytes]:
    """Start one host: a torchrun agent in its own session, output (agent and workers)
    appended to ``log``. ``inprocess``: the workers run under ``-m baft.inprocess``."""
    cmd = agent_command(
        script_args, addr=addr, port=port, nnodes=nnodes, nproc=nproc, inprocess=inprocess,
        rdzv_id=rdzv_id, rdzv_conf=rdzv_conf, max_restarts=max_restarts,
        monitor_interval=monitor_interval, rdzv_debug=rdzv_debug,
    )  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = agent_env(host_id, env)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd, env=full_env, stdout=f, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
        )  # fmt: skip
    proc.host_id = host_id  # type: ignore[attr-defined]
    proc.mark = full_env[MARK]  # type: ignore[attr-defined]
    return proc


# --- losing a host ---


def descendants(pid: int) -> list[int]:
    """``pid``'s live process tree below it (the launcher's walk of /proc)."""
    return sorted(_descendants(pid))


def marked(mark: str) -> list[int]:
    """Every process whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    me = os.getpid()
    return [
        int(p.name)
        for p in Path("/proc").glob("[0-9]*")
        if int(p.name) != me and needle in (_environ(int(p.name)) or [])
    ]


def host_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """The agent, every process under it and every process carrying its mark."""
    pids = {proc.pid, *descendants(proc.pid)}
    mark = getattr(proc, "mark", None)
    if mark:
        pids |= set(marked(mark))
    return sorted(pids)


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _stop_tree(proc: subprocess.Popen[bytes]) -> set[int]:
    """SIGSTOP the agent and every process of its host until no new one appears (a
    stopped process cannot fork); returns them."""
    stopped: set[int] = set()
    for _ in range(10):
        new = set(host_pids(proc)) - stopped
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        stopped |= new
    return stopped


def lose_host(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> float:
    """The host is lost for good: its agent and every process under it are stopped
    (SIGSTOP, until no new one appears), then SIGKILLed at once; reaps the agent.
    Returns the wall time of the SIGKILL (the loss). The kernel closes the dead
    processes' sockets, so the peers' collectives fail at once (a crashed host's OS
    does the same; a host that loses power or its network does not: :func:`freeze_host`)."""
    stopped = _stop_tree(proc) | set(getattr(proc, "frozen", ()))
    t = time.time()
    _signal(stopped, signal.SIGKILL)
    proc.wait(timeout_s)
    return t


def freeze_host(proc: subprocess.Popen[bytes]) -> float:
    """The host stops answering (power or network lost): its agent and every process
    under it are SIGSTOPped and stay so, their sockets open, so the peers' collectives
    block until their timeouts. :func:`lose_host` ends them later. Returns the wall
    time of the freeze."""
    proc.frozen = _stop_tree(proc)  # type: ignore[attr-defined]
    return time.time()


def stop_job(out: Path) -> None:
    """Ask the probe's ranks to finish (they all stop after the next all-reduce)."""
    (out / "STOP").touch()


def exit_codes(
    procs: Mapping[str, subprocess.Popen[bytes]], timeout_s: float
) -> dict[str, int | None]:
    """Each agent's status within ``timeout_s`` in all (None: still running)."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, int | None] = {}
    for name, p in procs.items():
        try:
            out[name] = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out[name] = None
    return out


# --- waiting and reading ---


def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float,
    *,
    poll_s: float = 0.05,
    alive: Iterable[subprocess.Popen[bytes]] = (),
    what: str = "condition",
) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); raises
    TimeoutError after ``timeout_s``, RuntimeError when an ``alive`` agent exits."""
    alive = list(alive)
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        for p in alive:
            if p.poll() is not None:
                raise RuntimeError(f"agent {getattr(p, 'host_id', p.pid)} exited {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(poll_s)


def wait_for_file(path: Path, timeout_s: float, **kw: Any) -> Path:
    return wait_until(lambda: path if path.exists() else None, timeout_s, what=str(path), **kw)


def wait_for_line(path: Path, pattern: str, timeout_s: float, **kw: Any) -> str:
    """The first line of ``path`` matching the regex ``pattern``."""
    rx = re.compile(pattern)

    def find() -> str | None:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return None
        return next((ln for ln in text.splitlines() if rx.search(ln)), None)

    return wait_until(find, timeout_s, what=f"line /{pattern}/ in {path}", **kw)


_TAILS: dict[Path, tuple[int, bytes, list[dict[str, Any]]]] = {}
"""Per probe file: bytes read, an unfinished last line, the records so far (each file is
parsed once, however often a wait polls it)."""


def _records(out: Path) -> Iterator[dict[str, Any]]:
    """Every probe record of the job, file by file (new lines parsed once)."""
    for path in sorted(out.glob("*.jsonl")):
        offset, partial, recs = _TAILS.get(path, (0, b"", []))
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        lines = (partial + data).split(b"\n")
        for line in lines[:-1]:
            with contextlib.suppress(ValueError):
                recs.append(json.loads(line))
        _TAILS[path] = (offset + len(data), lines[-1], recs)
        yield from recs


def read_probe(out: Path) -> list[dict[str, Any]]:
    """Every probe record of the job, oldest first."""
    return sorted(_records(out), key=lambda r: r["t"])


def world_iterating(out: Path, world: int, after: float = 0.0) -> float | None:
    """When every rank of a ``world``-rank world had finished an iteration in it after
    ``after`` (the last rank's first such iteration), or None."""
    first: dict[int, float] = {}
    for r in _records(out):
        if r["event"] == "iter" and r["world"] == world and r["t"] > after:
            first[r["rank"]] = min(r["t"], first.get(r["rank"], r["t"]))
    return max(first.values()) if len(first) == world else None


def split_brain(out: Path, after: float = 0.0) -> list[str]:
    """Pairs of hosts whose rank 0 iterated at the same time after ``after`` (two worlds
    of one job: a rendezvous that lost every node formed a second one, see
    :data:`KEEP_ALIVE_MAX_ATTEMPT`); empty when the job was one world throughout. Rank 0
    may move between hosts (a restart takes seconds): two hosts count as concurrent when
    both iterated as rank 0 in at least two of the same whole seconds."""
    seconds: dict[str, set[int]] = {}
    for r in _records(out):
        if r["event"] == "iter" and r["rank"] == 0 and r["t"] > after:
            seconds.setdefault(r["host"], set()).add(int(r["t"]))
    hosts = sorted(seconds)
    return [
        f"{h} and {k}"
        for i, h in enumerate(hosts)
        for k in hosts[i + 1 :]
        if len(seconds[h] & seconds[k]) >= 2
    ]


def wait_for_world(
    out: Path, world: int, after: float = 0.0, timeout_s: float = 120.0, **kw: Any
) -> float:
    """Wait until every rank of a ``world``-rank world iterates (see
    :func:`world_iterating`); returns when."""
    kw.setdefault("poll_s", 0.1)
    return float(
        wait_until(
            lambda: world_iterating(out, world, after), timeout_s, what=f"world {world}", **kw
        )
    )


_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ (\S+)\] (.*)$")
AGENT_EVENTS = {
    "rendezvous": "Rendezvous'ing worker group",
    "joined": "Rendezvous complete for workers",
    "started": "Starting worker group",
    "failed": r"Worker group (FAILED|UNHEALTHY)",
    "membership": r"Detected \d+ new nodes",
    "closing": "closing signal",
    "finished": "worker group successfully finished",
}


def agent_events(log: Path) -> list[dict[str, Any]]:
    """The agent's milestones from its log (``LOGLEVEL=INFO``), oldest first: ``{"t",
    "event", "text"}`` with ``event`` a key of :data:`AGENT_EVENTS`; ``joined`` also
    carries the round's ``group_rank``, ``group_world_size`` and ``restart_count``."""
    year = datetime.now().year
    out: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    for line in log.read_text(errors="replace").splitlines():
        m = _GLOG.match(line)
        if not m:
            continue
        month, day, hms, _, text = m.groups()
        if last is not None and last["event"] == "joined":
            kv = re.match(r"\s+(restart_count|group_rank|group_world_size)=(\d+)", text)
            if kv:
                last[kv.group(1)] = int(kv.group(2))
        for event, rx in AGENT_EVENTS.items():
            if re.search(rx, text):
                t = datetime.strptime(f"{year}-{month}-{day} {hms}", "%Y-%m-%d %H:%M:%S.%f")
                last = {"t": t.timestamp(), "event": event, "text": text.strip()}
                out.append(last)
                break
    return out


def first_after(events: list[dict[str, Any]], event: str, after: float) -> float | None:
    return next((e["t"] for e in events if e["event"] == event and e["t"] > after), None)


# --- the measurement (python -m tests.e2e.elastic_launch) ---

ADDR = {"a": "127.0.0.1", "b": "127.0.0.2"}


def trial(
    root: Path,
    *,
    inprocess: bool,
    conf: str,
    seed: int,
    env: Mapping[str, str] | None = None,
    probe_args: tuple[str, ...] = (),
    rdzv_debug: bool = False,
    loss: str = "kill",
    lose: str = "b",
) -> dict[str, Any]:
    """One shrink-and-grow: hosts a and b up (world 4), host ``lose`` lost for good at a
    random moment (``loss``: "kill", :func:`lose_host`, or "freeze",
    :func:`freeze_host`), the other goes on alone (world 2), the lost host's agent
    started again with the same command (world 4), stop."""
    keep = "a" if lose == "b" else "b"
    rng = random.Random(seed)
    out, logs = root / "probe", root / "logs"
    out.mkdir(parents=True)
    port, store = start_rendezvous()
    args = [str(PROBE), "--out", str(out), *(["--inprocess"] if inprocess else []), *probe_args]
    kw: dict[str, Any] = {
        "port": port, "inprocess": inprocess, "rdzv_conf": conf, "env": env,
        "rdzv_debug": rdzv_debug,
    }  # fmt: skip
    agents: dict[str, subprocess.Popen[bytes]] = {}
    res: dict[str, Any] = {"seed": seed, "loadavg": round(os.getloadavg()[0], 2)}
    lost: subprocess.Popen[bytes] | None = None
    try:
        t0 = time.time()
        for h in ("a", "b"):
            agents[h] = start_agent(args, host_id=h, addr=ADDR[h], log=logs / f"{h}.log", **kw)
        res["start_s"] = wait_for_world(out, 4, timeout_s=180, alive=agents.values()) - t0
        time.sleep(rng.uniform(1.0, 4.0))  # a random moment (and heartbeat phase)
        lost = agents.pop(lose)
        t_kill = lose_host(lost) if loss == "kill" else freeze_host(lost)
        t_shrunk = wait_for_world(out, 2, after=t_kill, timeout_s=180, alive=[agents[keep]])
        res["shrink_s"] = t_shrunk - t_kill
        res["shrink"] = phases(out, logs / f"{keep}.log", t_kill, t_shrunk, hosts={keep})
        time.sleep(rng.uniform(1.0, 3.0))
        if loss == "freeze":
            lose_host(lost)  # the frozen host is gone for good before it comes back
        t_back = time.time()
        back = logs / f"{lose}2.log"
        agents[lose] = start_agent(args, host_id=lose, addr=ADDR[lose], log=back, **kw)
        t_grown = wait_for_world(out, 4, after=t_back, timeout_s=180, alive=agents.values())
        res["grow_s"] = t_grown - t_back
        res["grow"] = phases(out, logs / f"{keep}.log", t_back, t_grown, hosts={"a", "b"})
        back_ev = agent_events(back)
        res["grow"]["back_waiting"] = _rel(first_after(back_ev, "rendezvous", t_back), t_back)
        res["split_brain"] = split_brain(out)
        res["ranks_after_shrink"] = ranks(out, t_shrunk, 2)
        res["ranks_after_grow"] = ranks(out, t_grown, 4)
        res["restart_count_after_shrink"] = restart_counts(out, t_shrunk, 2)
        res["restart_count_after_grow"] = restart_counts(out, t_grown, 4)
        stop_job(out)
        res["exit_codes"] = exit_codes(agents, 120)
    finally:
        for p in [*agents.values(), *([lost] if lost is not None else [])]:
            if p.poll() is None:
                lose_host(p)
        del store
    return res


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def phases(
    out: Path, agent_log: Path, t0: float, t_end: float, hosts: set[str]
) -> dict[str, float | None]:
    """When each step of a shrink or grow happened, in seconds after ``t0``: the
    survivor's all-reduce failed (``detected``), its agent saw its workers fail
    (``agent_failed``) or saw a waiting node (``agent_membership``), the round completed
    (``rendezvous_done``), the new workers started Python (``proc_start``), imported torch
    (``torch_imported``), had their process group (``group_up``) and iterated (``end``)."""
    ev = agent_events(agent_log)
    recs = [r for r in read_probe(out) if t0 < r["t"] <= t_end + 0.5 and r["host"] in hosts]
    starts = [r for r in recs if r["event"] == "start" and r["t"] <= t_end]
    failed = [r["t"] for r in recs if r["event"] == "failed"]
    new = [r for r in starts if r.get("t_proc", 0) > t0]
    return {
        "detected": _rel(min(failed), t0) if failed else None,
        "agent_failed": _rel(first_after(ev, "failed", t0), t0),
        "agent_membership": _rel(first_after(ev, "membership", t0), t0),
        "rendezvous_done": _rel(first_after(ev, "joined", t0), t0),
        "proc_start": _rel(min(r["t_proc"] for r in new), t0) if new else None,
        "torch_imported": _rel(max(r["t_import"] for r in new), t0) if new else None,
        "group_up": _rel(max(r["t"] for r in starts), t0) if starts else None,
        "end": round(t_end - t0, 3),
    }


def ranks(out: Path, after: float, world: int) -> dict[str, list[int]]:
    """Host -> the ranks it ran in a ``world``-rank world from about ``after`` on."""
    got: dict[str, set[int]] = {}
    for r in read_probe(out):
        if r["event"] == "iter" and r["world"] == world and r["t"] >= after - 1.0:
            got.setdefault(r["host"], set()).add(r["rank"])
    return {h: sorted(v) for h, v in sorted(got.items())}


def restart_counts(out: Path, after: float, world: int) -> dict[str, int]:
    """Host -> its workers' ``TORCHELASTIC_RESTART_COUNT`` in that world."""
    got: dict[str, int] = {}
    for r in read_probe(out):
        if r["event"] == "iter" and r["world"] == world and r["t"] >= after - 1.0:
            got.setdefault(r["host"], r["restart_count"])
    return got


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    def stat(values: list[float]) -> dict[str, float] | None:
        v = [x for x in values if x is not None]
        if not v:
            return None
        return {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                "max": round(max(v), 2), "n": len(v)}  # fmt: skip

    ok = [r for r in results if "grow_s" in r]
    out: dict[str, Any] = {
        "trials": len(results),
        "completed": len(ok),
        "shrink_s": stat([r["shrink_s"] for r in results if "shrink_s" in r]),
        "grow_s": stat([r["grow_s"] for r in ok]),
    }
    for what in ("shrink", "grow"):
        keys = {k for r in results if what in r for k in r[what]}
        out[what] = {k: stat([r[what].get(k) for r in results if what in r]) for k in sorted(keys)}
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="measure shrink and grow of a two-host job")
    p.add_argument("--out", type=Path, default=Path("/tmp/baft-elastic"))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--inprocess", action="store_true")
    p.add_argument("--last-call", type=int, default=LAST_CALL_S)
    p.add_argument("--keep-alive-interval", type=int, default=KEEP_ALIVE_INTERVAL_S)
    p.add_argument("--keep-alive-max-attempt", type=int, default=KEEP_ALIVE_MAX_ATTEMPT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for every agent")
    p.add_argument("--probe-arg", action="append", default=[])
    p.add_argument("--rdzv-debug", action="store_true", help="log every rendezvous decision")
    p.add_argument("--loss", choices=["kill", "freeze"], default="kill")
    p.add_argument("--lose", choices=["a", "b"], default="b", help="a: rank 0's host")
    a = p.parse_args(argv)
    conf = rdzv_conf(
        last_call_s=a.last_call,
        keep_alive_interval_s=a.keep_alive_interval,
        keep_alive_max_attempt=a.keep_alive_max_attempt,
    )
    env = dict(kv.split("=", 1) for kv in a.env)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = []
    for i in range(a.trials):
        root = a.out / f"{stamp}-{'inproc' if a.inprocess else 'plain'}-{i}"
        try:
            res = trial(
                root, inprocess=a.inprocess, conf=conf, seed=a.seed + i, env=env,
                probe_args=tuple(a.probe_arg), rdzv_debug=a.rdzv_debug,
                loss=a.loss, lose=a.lose,
            )  # fmt: skip
        except (TimeoutError, RuntimeError) as e:
            res = {"seed": a.seed + i, "error": str(e)}
        res["dir"] = str(root)
        results.append(res)
        print(json.dumps(res), flush=True)
    summary = {
        "conf": conf, "inprocess": a.inprocess, "env": env, "loss": a.loss, "lose": a.lose,
        "probe_args": a.probe_arg, **summarize(results),
    }  # fmt: skip
    print(json.dumps(summary, indent=1))
    (a.out / f"{stamp}-summary.json").write_text(
        json.dumps({"summary": summary, "results": results}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
