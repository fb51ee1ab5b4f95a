"""The peers' rank-crash rows of ``baft bench recovery``'s downtime table: torchft 0.2.0
(:mod:`baft_bench.torchft_recovery`) and NVRx 0.4.1's in-process Wrapper
(:mod:`baft_bench.nvrx_recovery`), each on the data-parallel job of
:mod:`baft_bench.dp_job` (the recovery bench's model, whole on each of two replicas).

Per arm: one job with ``--failures`` SIGKILLs from outside and one failure-free job of the
same length; the rows (:mod:`baft_bench.peer_downtime`) carry the downtime as baft's rows
define it, when the job was back at full strength, the work done again, the batches the
job never trained on, and the final state against the failure-free job's. torchft runs
three ways: survivors go on alone (``min_replica_size=1``, its examples' setting), wait
for the replacement (``min_replica_size=2``), and through its DDP wrapper, which takes
one kill: its survivor dies with the victim (see :mod:`baft_bench.torchft_recovery`), so
the kill starts the job over.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baft_bench.downtime import GAP
from baft_bench.peer_downtime import contributions, failures, final_state, row
from baft_bench.peer_jobs import FINAL_MODEL

SCENARIO = "rank crash (SIGKILL)"
MAX_STEPS = 10_000
"""The faulted job's cap: it ends ``GAP`` steps after it is back at full strength from
its last kill (the bench writes the step); the failure-free job then runs as many."""


def installed(dist_name: str, module: str) -> str | None:
    """The installed version of ``dist_name`` when ``module`` imports here, else None."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def model_diff(a: Path, b: Path) -> dict[str, float] | None:
    """max |a - b| and ||a - b|| / ||b|| over two saved model state dicts."""
    import torch

    if not (a.is_file() and b.is_file()):
        return None
    sa, sb = torch.load(a), torch.load(b)
    diff = torch.cat([(sa[k].double() - sb[k].double()).reshape(-1) for k in sorted(sb)])
    ref = torch.cat([sb[k].double().reshape(-1) for k in sorted(sb)])
    return {"max_abs": float(diff.abs().max()), "rel_l2": float(diff.norm() / ref.norm())}


def error_lines(out: Path, pattern: str = r"^(\w+Error)\b.*") -> list[str]:
    """The distinct exception lines (``XxxError: ...``) of a job's worker logs."""
    seen: list[str] = []
    for log in sorted(out.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if re.match(pattern, line) and f"{log.name}: {line[:200]}" not in seen:
                seen.append(f"{log.name}: {line[:200]}")
    return seen


def replay_check(a: Any, got: dict[str, Any]) -> dict[str, Any]:
    """Replays the faulted job in this process from its records (which replicas' rows
    each committed step averaged: :func:`baft_bench.peer_downtime.contributions`); a
    replay that ends on the job's digest shows the difference from the failure-free job
    is exactly the rows it dropped. Not for a job that went back (started over)."""
    from baft_bench.dp_job import DPJob, replay, state_digest

    try:
        schedule = contributions(got["attempts"], replicas=2)
    except ValueError as e:
        return {"matches": None, "why_not": str(e)}
    module, opt = replay(DPJob(layers=a.layers, d_model=a.d_model), schedule)
    digest = state_digest(module, opt)
    return {
        "matches": digest in {f["digest"] for f in got["finals"]},
        "digest": digest,
        "steps_without_a_replica": [s for s, who, _ in schedule if len(who) < 2],
    }


def _arm(
    a: Any, name: str, mode: str, run: Callable[..., dict[str, Any]], kills: int,
    config: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    out = Path(a.out) / f"downtime-{name}"
    common = {"layers": a.layers, "d_model": a.d_model, "gap": GAP, "seed": 20261207}
    got = run(out / "faulted", kills=kills, steps=MAX_STEPS, **common)
    steps = got["steps"]
    ref = run(out / "failure-free", kills=0, steps=steps, **common)
    recs = failures(got["kills"], got["attempts"], got["ready"], replicas=2)
    final = final_state(got["finals"], ref["finals"], None)
    if not final["bit_identical"]:
        final["model_diff"] = model_diff(out / "faulted" / FINAL_MODEL, out / "failure-free" / FINAL_MODEL)  # fmt: skip
        final["replay"] = replay_check(a, got)
    return row(
        SCENARIO, mode, recs, final=final, steps=steps, config=config,
        errors=error_lines(out / "faulted"), kills=got["kills"],
    )  # fmt: skip


def peer_downtime_rows(a: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The peers' rows, and a line per peer that is not installed here."""
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    n = a.failures
    ft = installed("torchft", "torchft")
    if ft is None:
        missing.append("torchft: not installed (`pip install -e 'benchmarks[peers]'`)")
    else:
        from baft_bench import torchft_recovery as tf

        cfg = {"lighthouse": {**tf.LIGHTHOUSE, "heartbeat_timeout_ms": 5000}, "pg": "ProcessGroupGloo", "transport": "PGTransport"}  # fmt: skip
        arms = (
            ("manager", 1, "Manager.allreduce", n),
            ("manager", 2, "Manager.allreduce, min_replica_size=2", n),
            ("ddp", 1, "its DistributedDataParallel", 1),
        )
        for sync, least, label, kills in arms:
            run = _bind(tf.run_job, grad_sync=sync, min_replicas=least)
            name = f"torchft-{sync}" + ("" if least == 1 else f"-min{least}")
            rows.append(_arm(a, name, f"torchft {ft} ({label})", run, kills, {**cfg, "grad_sync": sync, "min_replica_size": least}))  # fmt: skip
    nv = installed("nvidia-resiliency-ext", "nvidia_resiliency_ext")
    if nv is None:
        missing.append("NVRx: not installed (`pip install -e 'benchmarks[peers]'`)")
    else:
        from baft_bench import nvrx_recovery as nx

        cfg = {"wrapper_s": nx.WRAPPER_S, "processes": f"{nx.ACTIVE} active + {n} reserve"}
        rows.append(_arm(a, "nvrx", f"NVRx {nv} Wrapper (reserve rank, state broadcast)", nx.run_job, n, cfg))  # fmt: skip
    return rows, missing


def _bind(fn: Callable[..., dict[str, Any]], **fixed: Any) -> Callable[..., dict[str, Any]]:
    return lambda *args, **kw: fn(*args, **kw, **fixed)


def markdown(
    rows: list[dict[str, Any]], baft: list[dict[str, Any]], missing: list[str]
) -> list[str]:
    """The peers' section: their columns, and their downtime against baft's rank crash."""
    lines = [
        "## The peers after the same rank crash: torchft and NVRx's in-process Wrapper",
        "",
        "Their job: the same GPT, AdamW and data, whole on each of two data-parallel "
        "replicas (global batch 4 = 2 rows per replica), not pp=2: both protect DP "
        "replicas. Downtime as above (the kill to the first step committed after it); "
        "full strength: to the first step both replicas trained; lost iters: steps "
        "computed again; dropped: steps committed without the killed replica's rows "
        "(its half of the global batch never trained on); replaced: survivor processes "
        "that died too; final: the faulted job's final state against the same job's "
        "without a kill.",
        "",
        "| mode | n | downtime median (s) | [min, max] | full strength median (s) | restore (s) | lost iters | dropped | replaced | final = failure-free |",  # fmt: skip
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r["final"]
        full = r["full_strength_median_s"]
        verdict = "bit-identical" if f["bit_identical"] else "differs"
        if f.get("model_diff"):
            verdict += f" (max abs {f['model_diff']['max_abs']:.2e}, rel L2 {f['model_diff']['rel_l2']:.2e})"
        if not f["replicas_agree"]:
            verdict += "; replicas differ"
        rep = f.get("replay") or {}
        if rep.get("matches") is not None:
            verdict += f"; replay without the dropped rows: {'bit-identical' if rep['matches'] else 'differs'}"
        lines.append(
            f"| {r['mode']} | {r['failures']} | {r['downtime_median_s']:.2f} | "
            f"[{r['downtime_min_s']:.2f}, {r['downtime_max_s']:.2f}] | "
            f"{'-' if full is None else f'{full:.2f}'} | {r['restore_median_s']:.3f} | "
            f"{r['lost_iterations']} | {r['dropped_batches']} | {r['survivors_replaced']} | {verdict} |"
        )
    crash = next((b for b in baft if b["scenario"] == SCENARIO and b["mode"] == "in-process"), None)
    if crash is not None:
        lines.append("")
        for r in rows:
            ratio = r["downtime_median_s"] / crash["downtime_median_s"]
            lines.append(
                f"- {r['mode']}: downtime (median) {ratio:.2f}x baft's in-process recovery"
            )
    for m in missing:
        lines.append(f"- {m}")
    return lines
