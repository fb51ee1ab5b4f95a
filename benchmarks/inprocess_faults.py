"""`baft train` with its defaults under the faults issue 42 found slow in-process: a node's
two processes killed at once (``--inject node:1,iter=N``) and a training thread hung off any
socket (``--inject hang:rank=1,iter=N``, ``--timeout 5``), each recovered in-process and,
for comparison, by the group restart (``--no-inprocess``), optionally against another
checkout of baft (``--old DIR``: its package directory's parent, run from there and
through PYTHONPATH).

Usage: ``python benchmarks/inprocess_faults.py OUT [--old DIR] [--repeats 1]``. Prints one
JSON line per run (the recovery record's attempt, generation, source, lost iterations,
phases and their sum: the downtime from the fault to the first iteration after it) and
writes them to ``OUT/runs.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

FAULTS = {
    "node loss (2 processes)": ["--inject", "node:1,iter=20"],
    "hung training thread (timeout 5 s)": ["--inject", "hang:rank=1,iter=12", "--timeout", "5"],
}


def run(out: Path, code: str, mode: str, fault: str, extra: list[str], old: str) -> dict[str, Any]:
    out = out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    if code == "old":
        env["PYTHONPATH"] = old + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "baft.cli", "train", "--out", str(out), "--iterations", "30"]
    cmd += extra + (["--no-inprocess"] if mode == "group" else [])
    cwd = old if code == "old" else None  # `-m` puts the working directory first on sys.path
    rc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, timeout=600).returncode
    recs = [json.loads(x) for x in (out / "recoveries.jsonl").read_text().splitlines()]
    r = recs[0]
    seconds = r.get("seconds", {})
    phases = dict(seconds)
    if "detect" in phases and "restart" in phases:  # a hang: detect_restart is their sum
        phases.pop("detect_restart", None)
    return {
        "code": code, "mode": mode, "fault": fault, "rc": rc, "attempt": r.get("attempt"),
        "generation": (r.get("inprocess") or {}).get("generation"), "source": r.get("source"),
        "lost_iterations": r.get("lost_iterations"), "downtime_s": round(sum(phases.values()), 3),
        "phases": seconds,
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--old", default="")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    base = Path(a.out)
    base.mkdir(parents=True, exist_ok=True)
    codes = ["new", "old"] if a.old else ["new"]
    with open(base / "runs.jsonl", "w") as f:
        for i in range(a.repeats):
            for fault, extra in FAULTS.items():
                for code in codes:
                    for mode in ("in-process", "group"):
                        if code == "old" and mode == "group":
                            continue  # the group restart did not change
                        row = run(base / f"{i}-{code}-{mode}", code, mode, fault, extra, a.old)
                        print(json.dumps(row), flush=True)
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
