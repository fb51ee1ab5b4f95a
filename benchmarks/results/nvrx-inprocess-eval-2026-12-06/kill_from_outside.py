"""Outside measurement: `baft train` (defaults), SIGKILL one worker from another process,
time kill -> each survivor's exit, and kill -> the next finished iteration (metrics.jsonl
line appended after the restart). Usage: python measure.py OUT KILLS [RANK] [--iterations N]"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
kills = int(sys.argv[2])
victim_rank = int(sys.argv[3]) if len(sys.argv) > 3 else 1
iters = int(os.environ.get("ITERS", "400"))


def workers() -> dict[int, int]:
    """rank -> pid of the live workers (pgrep -f baft.train.worker)."""
    r = subprocess.run(["pgrep", "-f", "baft.train.worker"], capture_output=True, text=True)
    found = {}
    for pid in map(int, r.stdout.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" in cmd or str(out).encode() not in cmd:
            continue
        for e in env:
            if e.startswith(b"RANK="):
                found[int(e[5:])] = pid
    return found


def lines() -> list[dict]:
    try:
        return [
            json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()
        ]
    except (OSError, json.JSONDecodeError):
        return []


env = dict(os.environ)
job = subprocess.Popen(
    [
        "baft",
        "train",
        "--out",
        str(out),
        "--iterations",
        str(iters),
        "--max-restarts",
        str(kills + 1),
    ],
    stdout=subprocess.DEVNULL,
    stderr=open(out.parent / (out.name + ".stderr"), "w"),
    env=env,
)
results = []
try:
    for k in range(kills):
        # wait until 4 workers are up and 5 iterations finished since they started
        while True:
            w = workers()
            ls = lines()
            if (
                len(w) == 4
                and ls
                and ls[-1]["iteration"]
                >= (
                    results[-1]["resumed_at"] + 8
                    if results
                    else int(os.environ.get("START_AT", "20"))
                )
            ):
                break
            if job.poll() is not None:
                raise SystemExit(f"job ended early rc={job.returncode}")
            time.sleep(0.1)
        before = lines()
        last_it = before[-1]["iteration"]
        iter_s = before[-1]["iter_s"]
        survivors = {r: p for r, p in w.items() if r != victim_rank}
        t0 = time.monotonic()
        os.kill(w[victim_rank], signal.SIGKILL)
        gone: dict[int, float] = {}
        if os.environ.get("DUMP"):
            for delay in (0.3, 1.0, 2.5):
                while time.monotonic() - t0 < delay:
                    time.sleep(0.01)
                for r, p in survivors.items():
                    d = subprocess.run(
                        ["/tmp/h4/nvrx/bin/py-spy", "dump", "--native", "--pid", str(p)],
                        capture_output=True,
                        text=True,
                    )
                    print(
                        f"--- t={delay} rank {r} pid {p}\n{d.stdout[-3000:]}{d.stderr[-300:]}",
                        file=sys.stderr,
                        flush=True,
                    )
        first_iter = None
        final = None
        while first_iter is None and time.monotonic() - t0 < 120:
            for r, p in survivors.items():
                if r not in gone and not Path(f"/proc/{p}").exists():
                    gone[r] = time.monotonic() - t0
                # a zombie counts as exited
                elif r not in gone:
                    try:
                        st = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
                        if st == "Z":
                            gone[r] = time.monotonic() - t0
                    except OSError:
                        gone[r] = time.monotonic() - t0
            if len(gone) == len(survivors) and final is None:
                final = lines()  # what the old group wrote, complete
            if final is not None:
                ls = lines()
                if ls and ls != final[: len(ls)]:  # a line the restarted group wrote
                    first_iter = (time.monotonic() - t0, ls[-1]["iteration"])
            time.sleep(0.01)
        res = {
            "t0_monotonic": round(t0, 3),
            "kill": k,
            "victim": victim_rank,
            "killed_after_iter": last_it,
            "iter_s": iter_s,
            "survivors_exit_s": {r: round(t, 2) for r, t in sorted(gone.items())},
            "kill_to_next_iter_s": round(first_iter[0], 2) if first_iter else None,
            "next_iter": first_iter[1] if first_iter else None,
            "minus_one_iter_s": round(first_iter[0] - iter_s, 2) if first_iter else None,
        }
        res["resumed_at"] = first_iter[1] if first_iter else last_it
        results.append(res)
        print(json.dumps(res), flush=True)
finally:
    job.send_signal(signal.SIGTERM)
    try:
        job.wait(timeout=90)
    except subprocess.TimeoutExpired:
        job.kill()
