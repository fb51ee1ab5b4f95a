"""``baft bench recovery``: the same state restored from memory (baft) and from disk (DCP).

Launches of the same job (pp=2 on 2 ranks, one rank per simulated node, xor:2, a
DCP checkpoint every ``--persist-every`` committed versions; ``baft train``'s default
in-process recovery, see :mod:`baft_bench.downtime` for its comparison with the group
restart):
- ``memory``: a rank is SIGKILLed, later a node is lost (its rank and its store) — both
  restored from the in-memory stores (local shard; rebuilt from parity on the other node);
- ``disk``: a power loss wipes every store — restored from the newest DCP checkpoint;
- ``hang``: a rank freezes (SIGSTOP); detected by its peer's watchdog, then as a crash.
Each recovery's phases come from the runtime's own report. The restore phase is
inventory + transfer/decode + load; lost iterations follow from the checkpoint interval
of each approach (1 in memory, ``--persist-every`` on disk).
With ``--failures`` > 0 the same run measures the downtime per failure of in-process
recovery against the group restart (:mod:`baft_bench.downtime`, each job's final state
compared with the failure-free job's) and, when the ``peers`` extra is installed, the
same rank crash under torchft 0.2.0 and NVRx 0.4.1's in-process Wrapper on a
data-parallel job of the same model (:mod:`baft_bench.peer_arms`; ``--no-peers`` skips).
Disk restores read files that were just written, so the page cache is warm: the disk
numbers are a best case for storage. The cold disk row runs its ranks through
:mod:`baft_bench.cold_worker`, which evicts the checkpoint's files from the page cache
when a process starts, so the restarted ranks' load reads the disk.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from baft.config import CheckpointConfig, TimeoutConfig
from baft.model.config import ModelConfig
from baft.plan.types import CheckpointPolicy
from baft.train.config import ParallelConfig, TrainConfig
from baft.train.launch import WORKER, launch

RESTORE_PHASES = ("inventory", "transfer_decode", "load")


def _cfg(a: Any, out: Path, inject: list[str]) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(num_layers=a.layers, d_model=a.d_model, num_heads=8, seq_len=32),
        parallel=ParallelConfig(
            num_dp=1, num_pp=2, schedule="1f1b", num_microbatches=4, ranks_per_node=1
        ),
        num_iterations=a.iterations,
        global_batch=4,
        out_dir=str(out),
        checkpoint=CheckpointConfig(
            policy=CheckpointPolicy.parse(
                f"redundancy=xor:2,persist={a.persist_every},keep=2,full_every={a.full_every}"
            ),
            profile_iters=2,
            timeouts=TimeoutConfig(collective_s=60.0),
        ),
        inject=inject,
    )


def _run(a: Any, name: str, inject: list[str], cold: bool = False) -> list[dict[str, Any]]:
    out = Path(a.out) / name
    # cold: every rank evicts the checkpoint's pages (posix_fadvise) when its process
    # starts, so the restarted ranks' load really reads the disk
    worker = "baft_bench.cold_worker" if cold else WORKER
    rc = launch(_cfg(a, out, inject), quiet=not a.verbose, worker=worker)
    if rc != 0:
        raise RuntimeError(f"the {name} job failed; rerun with --verbose")
    summary = json.loads((out / "summary.json").read_text())
    return list(summary["recoveries"])


def _row(scenario: str, r: dict[str, Any]) -> dict[str, Any]:
    s = r["seconds"]
    return {
        "scenario": scenario,
        "source": r["source"],
        "restored_version": r["restored_version"],
        "lost_iterations": r["lost_iterations"],
        "shard_sources": r.get("sources", {}),
        "restore_s": sum(s.get(k, 0.0) for k in RESTORE_PHASES),
        "replay_steps": (r.get("replay") or {}).get("replayed_steps", 0),
        "replay_s": (r.get("replay") or {}).get("seconds", 0.0),
        "total_s": sum(s.values()),
        "seconds": s,
    }


def run_recovery(a: Any) -> int:
    kill_at, node_at = a.iterations // 3, 2 * a.iterations // 3
    mem = _run(a, "memory", [f"kill:rank=1,iter={kill_at}", f"node:1,iter={node_at}"])
    disk = _run(a, "disk", [f"power:iter={node_at}"])
    cold = _run(a, "disk-cold", [f"power:iter={node_at}"], cold=True)
    if len(mem) != 2 or len(disk) != 1 or len(cold) != 1:
        raise RuntimeError(f"expected 2 memory and 1+1 disk recoveries: {mem} / {disk} / {cold}")
    rows = [
        _row("rank crash", mem[0]),
        _row("node loss", mem[1]),
        _row("power loss, warm page cache", disk[0]),
        _row("power loss, cold (evicted) cache", cold[0]),
    ]
    rows += _hang_rows(a, kill_at)
    state = _state_bytes(Path(a.out) / "memory")
    result = {
        "state_bytes_per_rank": state,
        "persist_every": a.persist_every,
        "rows": rows,
        "restore_speedup_vs_disk": {
            f"{r['scenario']} vs {d['scenario']}": d["restore_s"] / r["restore_s"]
            for r in rows[:2]
            for d in rows[2:4]
            if r["restore_s"]
        },
    }
    result["rows"] += _peer_rows(a)
    if a.failures > 0:
        from baft_bench.downtime import downtime_rows

        result["downtime"] = downtime_rows(a, _cfg)
        if not a.no_peers:
            from baft_bench.peer_arms import peer_downtime_rows

            result["peer_downtime"], result["peers_missing"] = peer_downtime_rows(a)
    if a.json:
        print(json.dumps(result))
    else:
        print(_markdown(result, a))
    if not a.no_results:
        path = Path(a.results_dir) / f"recovery-{dt.date.today().isoformat()}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_markdown(result, a))
        print(f"[bench] wrote {path}", file=sys.stderr)  # stdout stays one JSON object
    return 0


def _peer_rows(a: Any) -> list[dict[str, Any]]:
    """lm-resiliency's restore after the same rank crash, when the peers extra is
    installed (see :mod:`baft_bench.peer_recovery`)."""
    from baft_bench.peers import missing_peers

    if missing_peers(["lm-resiliency"]):
        return []
    from baft_bench.peer_recovery import run_lm_recovery

    out = Path(a.out) / "lm-resiliency"
    return [run_lm_recovery(out, layers=a.layers, d_model=a.d_model, iterations=a.iterations, verbose=a.verbose)]  # fmt: skip


def _hang_rows(a: Any, at: int) -> list[dict[str, Any]]:
    """A rank frozen with SIGSTOP (the ``freeze`` fault) at iteration ``at``: the watchdog
    of its peer notices the silent heartbeat after ``--hang-timeout`` s; its supervisor
    replaces it, the peer recovers in-process, and it restores from memory. ``detect`` (freeze
    to the first rank that noticed) and ``restart`` replace the crash's ``detect_restart``."""
    if a.hang_timeout <= 0:
        return []
    out = Path(a.out) / "hang"
    cfg = _cfg(a, out, [f"freeze:rank=1,iter={at}"])
    assert cfg.checkpoint is not None
    cfg.checkpoint.timeouts.collective_s = a.hang_timeout
    if launch(cfg, quiet=not a.verbose) != 0:
        raise RuntimeError("the hang job failed; rerun with --verbose")
    recs = json.loads((out / "summary.json").read_text())["recoveries"]
    if len(recs) != 1 or "detect" not in recs[0]["seconds"]:
        raise RuntimeError(f"expected one recovery after a detected hang: {recs}")
    recs[0]["seconds"].pop("detect_restart", None)
    return [_row(f"rank hang (SIGSTOP, timeout {a.hang_timeout:g} s)", recs[0])]


def _state_bytes(run: Path) -> list[int]:
    data = json.loads((run / "plan_input.json").read_text())
    return [sum(n for _, n in r["layout"]["tensors"]) for r in data["ranks"]]


def _markdown(result: dict[str, Any], a: Any) -> str:
    import torch  # lazy: `baft --help` should not pay for importing torch

    cmd = (
        f"baft bench recovery --layers {a.layers} --d-model {a.d_model} "
        f"--iterations {a.iterations} --persist-every {a.persist_every} "
        f"--full-every {a.full_every} --hang-timeout {a.hang_timeout:g} --failures {a.failures}"
        + (" --no-peers" if a.no_peers else "")
    )
    lines = [
        f"# Recovery: memory (baft) vs disk (DCP) — {dt.date.today().isoformat()}",
        "",
        f"- machine: {os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}, gloo",
        f"- command: `{cmd}`",
        "- job: GPT pp=2 on 2 ranks (1F1B), one rank per simulated node, xor:2 parity, "
        f"checkpoint every iteration in memory (full_every={a.full_every}: a gradient record "
        "and a slice of the state per iteration; a memory restore replays the records since "
        f"each slice's copy), DCP every {a.persist_every} checkpoints",
        f"- state per rank (model + AdamW + RNG): {[f'{b / 2**20:.1f} MiB' for b in result['state_bytes_per_rank']]}",
        "- restore = inventory + transfer/decode + load. Disk rows: the DCP files were just "
        "written, so a warm page cache is the best case for storage; the cold row evicts "
        "them (posix_fadvise DONTNEED) before loading, so the load reads the local disk",
        "",
        "| scenario | source | restored v | lost iters | restore (s) | replay (steps, s) | all phases (s) | phases |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in r["seconds"].items())
        lines.append(
            f"| {r['scenario']} | {r['source']} | {r['restored_version']} | "
            f"{r['lost_iterations']} | {r['restore_s']:.3f} | "
            f"{r.get('replay_steps', 0)}, {r.get('replay_s', 0.0):.3f} | {r['total_s']:.2f} | {phases} |"
        )
    lines.append("")
    for k, v in result["restore_speedup_vs_disk"].items():
        lines.append(f"- restore phase, memory after a {k}: {v:.2f}x as fast as from disk")
    if result.get("downtime"):
        from baft_bench.downtime import markdown

        lines += ["", *markdown(result["downtime"])]
    if result.get("peer_downtime") or result.get("peers_missing"):
        from baft_bench.peer_arms import markdown as peer_markdown

        lines += ["", *peer_markdown(result.get("peer_downtime", []), result.get("downtime", []), result.get("peers_missing", []))]  # fmt: skip
    lines += ["", "Raw:", "```json", json.dumps(result, indent=1), "```", ""]
    return "\n".join(lines)
