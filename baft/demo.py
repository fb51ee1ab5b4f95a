"""``baft demo``: the whole story on 4 CPU ranks in about two minutes.

1. A failure-free reference run (dp=2 x pp=2, 1F1B) without checkpoints.
2. The same job with per-iteration bubble-aware checkpointing (xor:2 parity across two
   simulated nodes), a SIGKILL of rank 1 in the middle of a snapshot, and the loss of
   node 1 (its ranks and its shared-memory store) a few iterations later.
3. Verification: the loss log and the digest of every rank's final model and optimizer
   state equal the reference bit for bit; a summary of overhead, bubble use and the
   recoveries with their timings; the timeline picture.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from baft.config import CheckpointConfig, TimeoutConfig
from baft.model.config import ModelConfig
from baft.plan.types import CheckpointPolicy
from baft.train.config import ParallelConfig, TrainConfig
from baft.train.launch import launch


def _config(out: Path, iterations: int, checkpoint: CheckpointConfig | None) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(),
        parallel=ParallelConfig(num_dp=2, num_pp=2, schedule="1f1b", num_microbatches=4),
        num_iterations=iterations,
        global_batch=16,
        out_dir=str(out),
        checkpoint=checkpoint,
    )


def _read(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((out / "summary.json").read_text())


def run_demo(
    out: str | Path, *, iterations: int = 30, kill_at: int = 8, node_loss_at: int = 18
) -> int:
    """Run the demo in ``out`` (a reference and a protected run); 0 when it verifies.

    ``kill_at`` is the iteration of the rank crash, ``node_loss_at`` that of the node loss;
    raises ``ValueError`` unless ``3 < kill_at < node_loss_at < iterations``.
    """
    if not 3 < kill_at < node_loss_at < iterations:
        raise ValueError(
            f"need 3 < kill_at ({kill_at}) < node_loss_at ({node_loss_at}) "
            f"< iterations ({iterations})"
        )
    console = Console()
    out = Path(out)
    console.rule("[bold]1/3 failure-free reference run (no checkpoints)")
    ref_cfg = _config(out / "reference", iterations, None)
    if launch(ref_cfg) != 0:
        console.print("[red]reference run failed")
        return 1
    inject = [f"kill:rank=1,iter={kill_at},at=snapshot", f"node:1,iter={node_loss_at}"]
    console.rule("[bold]2/3 protected run: checkpoint every iteration, crash a rank, lose a node")
    console.print(f"injecting: {', '.join(inject)}")
    ck = CheckpointConfig(
        policy=CheckpointPolicy(redundancy="xor:2", persist_every=10),
        timeouts=TimeoutConfig(collective_s=30.0),
    )
    ft_cfg = _config(out / "protected", iterations, ck)
    ft_cfg.inject = inject
    if launch(ft_cfg) != 0:
        console.print("[red]protected run failed")
        return 1
    console.rule("[bold]3/3 verification")
    return _report(console, out, *_read(out / "reference"), *_read(out / "protected"))


def _report(
    console: Console,
    out: Path,
    ref_m: list[dict[str, Any]],
    ref_s: dict[str, Any],
    ft_m: list[dict[str, Any]],
    ft_s: dict[str, Any],
) -> int:
    same_losses = [m["loss"] for m in ref_m] == [m["loss"] for m in ft_m]
    same_state = ref_s["final_state_digest"] == ft_s["final_state_digest"]
    ckpt = [m for m in ft_m if m.get("ckpt_version") is not None]
    t = Table(title="baft demo: 4 ranks (dp=2 x pp=2, 1F1B), xor:2 parity over 2 simulated nodes")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row(
        "final loss (reference / protected)",
        f"{ref_s['final_loss']:.4f} / {ft_s['final_loss']:.4f}",
    )
    t.add_row("loss log identical", "[green]yes" if same_losses else "[red]NO")
    t.add_row(
        "final model+optimizer state bit-identical", "[green]yes" if same_state else "[red]NO"
    )
    t.add_row("iterations checkpointed", f"{len(ckpt)} of {len(ft_m)}")
    if ckpt:
        bubble = statistics.median(m["in_bubble_s"] for m in ckpt)
        exposed = statistics.median(m["exposed_s"] for m in ckpt)
        t.add_row(
            "checkpoint work in bubbles / exposed (median per iteration)",
            f"{bubble * 1e3:.2f} ms / {exposed * 1e3:.2f} ms",
        )
        t.add_row("bytes snapshotted per iteration (rank 0)", f"{ckpt[-1]['bytes']['snapshot']:,}")
    ref_it = statistics.median(m["iter_s"] for m in ref_m[3:])
    ft_it = statistics.median(m["iter_s"] for m in ckpt) if ckpt else float("nan")
    t.add_row(
        "median iteration (reference / protected, separate runs)",
        f"{ref_it * 1e3:.1f} ms / {ft_it * 1e3:.1f} ms",
    )
    console.print(t)
    rt = Table(title="recoveries")
    for col in ("restored", "lost iters", "shard sources", "seconds by phase"):
        rt.add_column(col)
    for r in ft_s.get("recoveries", []):
        srcs = (
            ", ".join(f"r{k}:{v}" for k, v in sorted(r.get("sources", {}).items())) or r["source"]
        )
        secs = "  ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items())
        rt.add_row(
            f"v{r['restored_version']} ({r['source']})", str(r["lost_iterations"]), srcs, secs
        )
    console.print(rt)
    try:
        from baft.profile.timeline import read_timelines
        from baft.profile.trace import write_trace

        trace, png = write_trace(read_timelines(out / "protected"), out / "protected")
        console.print(f"timeline picture: {png}\nPerfetto trace: {trace}")
    except Exception as e:  # noqa: BLE001 - the picture is a bonus, not the verdict
        console.print(f"[yellow]timeline picture skipped: {e}")
    ok = same_losses and same_state and len(ft_s.get("recoveries", [])) == 2
    console.print("[bold green]PASS: recovered bit-exactly" if ok else "[bold red]FAIL")
    return 0 if ok else 1
