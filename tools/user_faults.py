"""User-style fault checks from outside, both launches, compared bit for bit.

tests/e2e/user_script.py (4 ranks, dp=2 x pp=2, BatchNorm, a sampler in ``state=``,
DataLoader workers, work after ``ft.close()``) under plain torchrun, with and without
``-m baft.inprocess``; from another process at a random iteration and delay: kill -9 of a
training process (group restart and in-process), SIGSTOP (in-process), SIGTERM to
torchrun with the store root wiped and a relaunch, kill -9 of a rank's supervisor
(in-process: torchrun restarts the group); each final state against the same
script run ``--unprotected``. About 4 minutes on 2 cores.

    .venv/bin/python tools/user_faults.py [SEED]
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
SCRIPT = str(REPO / "tests/e2e/user_script.py")
BASE = Path(os.environ.get("BAFT_USER_FAULTS_DIR", "/tmp/baft-user-faults"))
shutil.rmtree(BASE, ignore_errors=True)
BASE.mkdir()
ENV = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=str(REPO))
ITERS = 30
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else int(time.time()))


def cmd(out, store, inprocess, protected=True):
    entry = ["-m", "baft.inprocess", SCRIPT] if inprocess else [SCRIPT]
    args = [
        f"--out={out}",
        f"--iterations={ITERS}",
        "--dp=2",
        "--ranks-per-node=2",
        "--sleep=0.1",
        "--loader-workers=2",
        "--after-close=3",
        "--timeout=5",
        f"--store-root={store}",
    ]
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        f"--log-dir={out}/logs",
        "--redirects=3",
        *entry,
        *args,
        *([] if protected else ["--unprotected"]),
    ]


def done(out):
    v = []
    for r in range(4):
        try:
            v.append(int((out / "progress" / f"rank{r}").read_text()))
        except Exception:
            v.append(-1)
    return min(v) + 1


def workers(pid):
    kids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
            kids.setdefault(int(f[1]), []).append(int(stat.parent.name))
        except OSError:
            pass
    todo, out = [pid], []
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    res = []
    for p in out[1:]:
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
            cl = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if comm.startswith("baft-rank") or (
            b"user_script.py" in cl
            and b"baft.inprocess" not in cl
            and b"torch.distributed.run" not in cl
            and comm.startswith("python")
        ):
            res.append(p)
    return res


def supervisors(pid):
    """torchrun's own workers under ``-m baft.inprocess``: each rank's supervisor."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def same(a, b):
    return all(
        json.loads((a / f"state.rank{r}.json").read_text())
        == json.loads((b / f"state.rank{r}.json").read_text())
        for r in range(4)
    )


ref = BASE / "ref"
assert (
    subprocess.run(
        cmd(ref, BASE / "shm-ref", False, False), env=ENV, capture_output=True
    ).returncode
    == 0
)
results = {}
for name, inprocess, sig in [
    ("group-kill", False, signal.SIGKILL),
    ("inproc-kill", True, signal.SIGKILL),
    ("inproc-stop", True, signal.SIGSTOP),
    ("group-sigterm", False, signal.SIGTERM),
    ("inproc-supervisor-kill", True, signal.SIGKILL),  # a rank's supervisor, not its child
]:
    out, store = BASE / name, BASE / f"shm-{name}"
    agent = subprocess.Popen(
        cmd(out, store, inprocess), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    at = rng.randint(9, 20)
    delay = rng.uniform(0, 0.3)
    while done(out) < at and agent.poll() is None:
        time.sleep(0.01)
    time.sleep(delay)
    if sig == signal.SIGTERM:
        agent.send_signal(signal.SIGTERM)
        rc1 = agent.wait(120)
        shutil.rmtree(store, ignore_errors=True)  # the host's memory is gone with the preemption
        agent = subprocess.Popen(
            cmd(out, store, inprocess),
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    else:
        pick = supervisors if name.endswith("supervisor-kill") else workers
        victim = rng.choice(pick(agent.pid))
        os.kill(victim, sig)
    rc = agent.wait(300)
    recs = (
        [json.loads(x) for x in (out / "recoveries.jsonl").read_text().splitlines()]
        if (out / "recoveries.jsonl").exists()
        else []
    )
    results[name] = dict(
        at=at,
        delay=round(delay, 3),
        rc=rc,
        bit_identical=rc == 0 and same(out, ref),
        recoveries=[
            (
                r.get("source"),
                r.get("lost_iterations"),
                r.get("attempt"),
                (r.get("inprocess") or {}).get("generation"),
            )
            for r in recs
        ],
        after_close=sorted(p.name for p in out.glob("after_close.rank*")),
    )
    print(name, results[name], flush=True)
    shutil.rmtree(store, ignore_errors=True)
