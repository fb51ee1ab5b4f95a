"""The GPU suite: on a machine with NVIDIA GPUs, one command, about 8 minutes, one page.

    bash benchmarks/gpu_suite.sh [--minutes 8] [--out DIR] [--dry-run] [--gpus N]

Steps (each bounded by its share of ``--minutes``; a failed or timed-out step is reported
on the page, the others still run):

1. ``env``: ``nvidia-smi`` and torch's view of the devices;
2. ``copy``: the CUDA snapshot copy (``benchmarks/cuda_copy.py``): D2H GB/s into
   registered shared memory, host cost of starting it, matmul slowdown beside it, host
   xxh3 rates;
3. ``hash``: checksum rates (``benchmarks/hash_speed.py``; skipped when its ``crc32c``
   packages are missing, the xxh3 rates of step 2 stand);
4. ``overhead``: ``baft bench overhead`` on CUDA, every installed mode (peers included
   when the ``peers`` extra is installed), real compute, pp over the GPUs present (a
   power of two up to 8, one rank per GPU: NCCL allows no two ranks on one device), so
   one GPU runs one rank without a pipeline and without redundancy;
5. ``restore-ref`` / ``restore-kill``: ``baft train`` without checkpoints, and the same
   run with a rank SIGKILLed mid-run and restored from memory; the final state digests
   must be equal (a bit-exact trajectory). ``baft train`` recovers in-process by default:
   with two GPUs or more (pp=2, NCCL between the ranks) the page also says whether every
   recovery was in-process (torchrun attempt 0, a new generation): the survivor kept its
   process, only the killed one was replaced, and the NCCL groups were aborted with
   torch's abort (``baft/inprocess/child.py``'s NCCL settings).

The page goes to ``OUT/gpu-suite.md`` (default ``benchmarks/results/gpu-suite-<date>/``),
each step's log and JSON beside it. Without a GPU it stops with an error, unless
``--dry-run``, which prints the plan and runs nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SHARES = {"env": 0.03, "copy": 0.12, "hash": 0.05, "overhead": 0.50, "restore-ref": 0.10, "restore-kill": 0.17}  # fmt: skip
"""Each step's share of ``--minutes`` (together under 1: the page and cleanup need time)."""
MODEL = ["--layers", "8", "--d-model", "1024", "--heads", "16", "--seq-len", "512", "--batch", "32", "--microbatches", "4"]  # fmt: skip
"""The overhead bench's model on the GPU (1.1 GiB of state with AdamW: the GPU bounds the
iteration, as in cuda_check.sh's large runs)."""
TRAIN = ["--layers", "8", "--d-model", "512", "--heads", "8", "--seq-len", "64", "--batch", "8", "--microbatches", "4", "--iterations", "24"]  # fmt: skip
"""The restore check's model (cuda_check.sh's small one)."""
KILL_AT = 14
"""Iteration at which the restore check kills a rank."""
MIN_STEP_S = 20
"""No step gets less, whatever ``--minutes`` says."""
STORE_ROOT = "/dev/shm/baft-gpu-suite"
"""Shared-memory root of the restore check's snapshot stores (removed at the end)."""


@dataclass(slots=True)
class Step:
    """One bounded command of the suite."""

    name: str
    argv: list[str]
    timeout_s: int
    stdout: str = ""
    """File under OUT that takes the command's stdout (empty: the log)."""
    skip: str = ""
    """Why the step does not run (empty: it runs)."""
    what: str = ""


@dataclass(slots=True)
class StepResult:
    name: str
    command: str
    timeout_s: int
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    skip: str = ""
    tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out


def layout(gpus: int) -> dict[str, Any]:
    """pp and the checkpoint policy the overhead bench runs with on ``gpus`` GPUs."""
    pp = max(p for p in (1, 2, 4, 8) if p <= max(gpus, 1))
    redundancy = "xor:2" if pp >= 2 else "none"
    return {"pp": pp, "train_pp": min(pp, 2), "redundancy": redundancy}


def plan(a: argparse.Namespace, gpus: int) -> list[Step]:
    """The suite's steps for ``gpus`` GPUs, with their timeouts from ``a.minutes``."""
    budget = a.minutes * 60.0

    def limit(name: str) -> int:
        return max(MIN_STEP_S, int(SHARES[name] * budget))

    py, out, run = a.python, Path(a.out), Path(a.run_dir)
    lay = layout(gpus)
    ov_timeout = max(MIN_STEP_S, limit("overhead") - 15)  # the bench kills its own job first
    hash_skip = "" if all(importlib.util.find_spec(m) for m in ("crc32c", "google_crc32c")) else (
        "crc32c / google-crc32c not installed (pip install crc32c google-crc32c); the xxh3 rates of `copy` stand")  # fmt: skip
    ck = f"every=1,redundancy={lay['redundancy']},persist=0"
    train = [py, "-m", "baft.cli", "train", "--dp", "1", "--pp", str(lay["train_pp"]), "--ranks-per-node", "1", *TRAIN]  # fmt: skip
    kill_rank = lay["train_pp"] - 1
    return [
        Step(
            "env",
            [
                "sh",
                "-c",
                "nvidia-smi; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; "
                f"{shlex.quote(py)} -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())'",
            ],  # fmt: skip
            limit("env"),
            what="the machine",
        ),
        Step(
            "copy",
            [py, "benchmarks/cuda_copy.py", "--gib", "2"],
            limit("copy"),
            stdout="copy.json",
            what="D2H snapshot copy, matmul slowdown beside it, host xxh3",
        ),  # fmt: skip
        Step(
            "hash",
            [py, "benchmarks/hash_speed.py", "--repeats", "5"],
            limit("hash"),
            skip=hash_skip,
            what="checksum rates on the host",
        ),  # fmt: skip
        Step(
            "overhead",
            [
                py,
                "-m",
                "baft.cli",
                "bench",
                "overhead",
                "--pp",
                str(lay["pp"]),
                "--dp",
                "1",
                *MODEL,
                "--blocks",
                str(a.blocks),
                "--block-iters",
                "4",
                "--switch-iters",
                "1",
                "--warmup",
                "2",
                "--compute",
                "real",
                "--ranks-per-node",
                "1",
                "--checkpoint",
                ck,
                "--out",
                str(run / "overhead"),
                "--results-dir",
                str(out / "overhead"),
                "--timeout",
                str(ov_timeout),
                "--json",
            ],
            limit("overhead"),
            stdout="overhead.json",
            what="every mode, interleaved blocks, on CUDA",
        ),  # fmt: skip
        Step(
            "restore-ref",
            [*train, "--no-checkpoint", "--out", str(run / "ref")],
            limit("restore-ref"),
            what="reference run without checkpoints",
        ),  # fmt: skip
        Step(
            "restore-kill",
            [
                *train,
                "--checkpoint",
                ck,
                "--inject",
                f"kill:rank={kill_rank},iter={KILL_AT}",
                "--max-restarts",
                "2",
                "--timeout",
                "60",
                "--store-root",
                STORE_ROOT,
                "--out",
                str(run / "kill"),
            ],
            limit("restore-kill"),
            what=f"rank {kill_rank} SIGKILLed at iteration {KILL_AT}, restored from memory",
        ),  # fmt: skip
    ]


def run_step(step: Step, out: Path) -> StepResult:
    """Run one step under its timeout; stdout to its file (or the log), stderr to the log."""
    res = StepResult(step.name, shlex.join(step.argv), step.timeout_s, skip=step.skip)
    if step.skip:
        return res
    log = out / f"{step.name}.log"
    start = time.time()
    with open(log, "w") as err:
        std = open(out / step.stdout, "w") if step.stdout else None  # noqa: SIM115
        try:  # a session of its own: a timeout kills torchrun's workers too
            proc = subprocess.Popen(step.argv, stdout=std if std is not None else err, stderr=err, start_new_session=True)  # fmt: skip
            try:
                res.rc = proc.wait(timeout=step.timeout_s)
            except subprocess.TimeoutExpired:
                res.timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        except OSError as exc:
            res.rc = 127
            err.write(f"{exc}\n")
        finally:
            if std is not None:
                std.close()
    res.seconds = round(time.time() - start, 1)
    res.tail = log.read_text(errors="replace").splitlines()[-8:]
    return res


# ------------------------------------------------------------------ reading the steps
def _json(path: Path) -> dict[str, Any] | None:
    """The last JSON line of ``path`` (None when absent or unreadable)."""
    try:
        lines = [x for x in path.read_text().splitlines() if x.strip().startswith("{")]
        data: dict[str, Any] = json.loads(lines[-1])
        return data
    except (OSError, IndexError, json.JSONDecodeError):
        return None


def restore_check(ref: Path, kill: Path) -> dict[str, Any]:
    """Digests of the two runs' final states and the kill run's recoveries."""
    out: dict[str, Any] = {"bit_exact": False}
    try:
        a = json.loads((ref / "summary.json").read_text())
        b = json.loads((kill / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        out["error"] = f"no summary.json: {exc}"
        return out
    recs = [{k: r.get(k) for k in ("source", "restored_version", "lost_iterations")} for r in b.get("recoveries", [])]  # fmt: skip
    out.update(ref_digest=a.get("final_state_digest"), kill_digest=b.get("final_state_digest"), recoveries=recs)  # fmt: skip
    out["bit_exact"] = bool(recs) and out["ref_digest"] is not None and out["ref_digest"] == out["kill_digest"]  # fmt: skip
    # in-process: torchrun never restarted (attempt 0) and each recovery began a generation
    # (the survivors re-entered in their processes; only the killed one was replaced)
    gens = [(r.get("inprocess") or {}).get("generation") for r in b.get("recoveries", [])]
    out["inprocess"] = bool(recs) and all(
        r.get("attempt", 0) == 0 and g for r, g in zip(b["recoveries"], gens, strict=True)
    )
    return out


def collect(out: Path, run: Path) -> dict[str, Any]:
    """What the steps left: the JSONs, the hash table, the machine, the restore check."""

    def text(name: str) -> str:
        p = out / name
        return p.read_text(errors="replace") if p.is_file() else ""

    return {
        "machine": text("env.log"),
        "copy": _json(out / "copy.json"),
        "hash": text("hash.log"),
        "overhead": _json(out / "overhead.json"),
        "restore": restore_check(run / "ref", run / "kill"),
    }


# ------------------------------------------------------------------ the page
def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _overhead_lines(ov: dict[str, Any]) -> list[str]:
    cfg = ov.get("config", {})
    lines = [
        f"pp={cfg.get('num_pp')} dp={cfg.get('num_dp')} {cfg.get('schedule')}, d_model "
        f"{cfg.get('d_model')}, state per rank "
        + ", ".join(f"{b / 2**20:.0f} MiB" for b in ov.get("state_bytes_per_rank", []))
        + f", policy `{cfg.get('checkpoint')}`",
        "",
        "| mode | median iter (ms) | paired wall ratio | CI | restores | MiB / iter |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in ov.get("modes", {}).items():
        ci = f"[{m['ci_low']:.3f}, {m['ci_high']:.3f}]" if m.get("ci_low") is not None else "-"
        lines.append(
            f"| {name} | {_f(None if m.get('median_iter_s') is None else m['median_iter_s'] * 1e3, '.1f')} "
            f"| {_f(m.get('paired_wall_ratio_vs_none'), '.3f')} | {ci} | {m.get('restores', '-')} "
            f"| {_f(m.get('bytes_per_iter', 0) / 2**20, '.1f')} |"
        )  # fmt: skip
    lines += [f"- skipped `{k}`: {v}" for k, v in ov.get("skipped", {}).items()]
    return lines


def _copy_lines(cp: dict[str, Any]) -> list[str]:
    lines = []
    for key, v in cp.items():
        if key.startswith("copy_") and isinstance(v, dict):
            lines.append(
                f"- {key[5:]}: {v.get('copy_gb_per_s')} GB/s D2H; host start {v.get('start_ms')} ms, "
                f"landed {v.get('copied_ms')} ms, hashed {v.get('hashed_ms')} ms; checksums right: {v.get('checksums_right')}"
            )  # fmt: skip
    lines.append(f"- matmul slowdown with the copy beside it: {cp.get('matmul_slowdown')}x ({cp.get('tflops_alone')} TFLOP/s alone); bytes equal: {cp.get('bytes_equal')}")  # fmt: skip
    rates = [f"{t} threads {cp[k]} GB/s" for t in (1, 4, 8) if (k := f"host_xxh3_gb_per_s_{t}_threads") in cp]  # fmt: skip
    if rates:
        lines.append("- host xxh3 over the copied bytes: " + ", ".join(rates))
    return lines


def render_page(*, date: str, argv: str, gpus: int, results: list[StepResult], data: dict[str, Any]) -> str:  # fmt: skip
    """The results page of one suite run (pure: from step results and what they left)."""
    failed = [r for r in results if not r.skip and not r.ok]
    lines = [
        f"# GPU suite ({date})",
        "",
        f"- command: `{argv}`",
        f"- GPUs seen: {gpus}; layout: {json.dumps(layout(gpus))}",
        f"- steps: {sum(r.ok for r in results)} ok, {len(failed)} failed, {sum(bool(r.skip) for r in results)} skipped",  # fmt: skip
        "",
        "## Machine",
        "",
        "```",
        data.get("machine", "").strip() or "(env step left nothing)",
        "```",
        "",
        "## Steps",
        "",
        "| step | status | seconds | limit (s) | command |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        status = f"skipped: {r.skip}" if r.skip else "ok" if r.ok else ("TIMED OUT" if r.timed_out else f"FAILED (exit {r.rc})")  # fmt: skip
        lines.append(f"| {r.name} | {status} | {r.seconds:.1f} | {r.timeout_s} | `{r.command}` |")
    for r in failed:
        lines += ["", f"Last lines of `{r.name}.log`:", "", "```", *r.tail, "```"]
    rest = data.get("restore") or {}
    lines += ["", "## Kill and restore: bit-exact?", ""]
    if "error" in rest:
        lines.append(f"- not checked: {rest['error']}")
    else:
        lines += [
            f"- **{'yes' if rest.get('bit_exact') else 'NO'}**: final state digest without checkpoints "
            f"`{rest.get('ref_digest')}`, after the kill and restore `{rest.get('kill_digest')}`",
            f"- recoveries: {json.dumps(rest.get('recoveries'))}",
            f"- in-process (survivors kept their processes, torchrun did not restart): "
            f"**{'yes' if rest.get('inprocess') else 'no'}**",
        ]  # fmt: skip
    lines += ["", "## D2H copy and hash rates", ""]
    lines += _copy_lines(data["copy"]) if data.get("copy") else ["- no copy JSON (see the steps)"]
    if data.get("hash", "").strip():
        lines += ["", "```", data["hash"].strip(), "```"]
    lines += ["", "## Checkpoint overhead on CUDA", ""]
    lines += (
        _overhead_lines(data["overhead"])
        if data.get("overhead")
        else ["- no overhead JSON (see the steps)"]
    )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ entry
def detect_gpus() -> int:
    """NVIDIA GPUs on this machine: ``nvidia-smi -L`` lines, else torch's count, else 0."""
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout  # fmt: skip
            n = sum(line.startswith("GPU ") for line in listed.splitlines())
            if n:
                return n
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_suite.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default=f"benchmarks/results/gpu-suite-{dt.date.today().isoformat()}", help="page, logs and JSONs (default %(default)s)")  # fmt: skip
    p.add_argument("--run-dir", default="runs/gpu-suite", help="run directories of the steps (default %(default)s)")  # fmt: skip
    p.add_argument("--minutes", type=float, default=8.0, help="total budget the step timeouts share (default %(default)s)")  # fmt: skip
    p.add_argument("--blocks", type=int, default=4, help="overhead blocks per mode (default %(default)s)")  # fmt: skip
    p.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: the ones present)")  # fmt: skip
    p.add_argument("--python", default=sys.executable, help="interpreter of the steps (default %(default)s)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.blocks < 1 or (a.gpus is not None and a.gpus < 1):
        p.error("--minutes must be > 0, --blocks and --gpus >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    found = detect_gpus()
    gpus = a.gpus or found
    if a.dry_run:
        steps = plan(a, gpus or 1)
        print(f"# GPU suite plan: {gpus or 1} GPU(s){'' if found else ' (none found here: planned for 1)'}, {a.minutes:g} min, page {a.out}/gpu-suite.md")  # fmt: skip
        for s in steps:
            print(f"# {s.name} (limit {s.timeout_s} s){': SKIPPED, ' + s.skip if s.skip else ''}")
            print(shlex.join(s.argv) + (f" > {a.out}/{s.stdout}" if s.stdout else ""))
        return 0
    if found == 0:
        print("gpu_suite: error: no NVIDIA GPU here (nvidia-smi -L lists none and torch sees no CUDA device); run it on a GPU machine, or pass --dry-run to see the plan", file=sys.stderr)  # fmt: skip
        return 2
    out, run = Path(a.out), Path(a.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run, ignore_errors=True)
    results = []
    for step in plan(a, min(gpus, found)):
        print(f"[gpu-suite] {step.name} (limit {step.timeout_s} s): {shlex.join(step.argv)}", flush=True)  # fmt: skip
        r = run_step(step, out)
        print(f"[gpu-suite] {step.name}: {'skipped' if r.skip else 'ok' if r.ok else 'FAILED'} ({r.seconds} s)", flush=True)  # fmt: skip
        results.append(r)
    shutil.rmtree(STORE_ROOT, ignore_errors=True)
    (out / "steps.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    argv_text = shlex.join(
        ["bash", "benchmarks/gpu_suite.sh", *(sys.argv[1:] if argv is None else argv)]
    )
    page = render_page(date=dt.date.today().isoformat(), argv=argv_text, gpus=min(gpus, found), results=results, data=collect(out, run))  # fmt: skip
    (out / "gpu-suite.md").write_text(page)
    print(f"[gpu-suite] wrote {out / 'gpu-suite.md'}")
    return 0 if all(r.ok or r.skip for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
