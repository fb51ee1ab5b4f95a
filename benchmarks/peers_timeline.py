"""Per-rank timelines of the peer comparison: where each mode's checkpoint work lands.

    .venv/bin/python benchmarks/peers_timeline.py [--compute real] [--iters 4]
        [--modes none,naive-async,baft-full,baft --name modes]

One torchrun launch (pp=2, the ``baft bench overhead`` default model and flags), the modes
none, baft, lm-resiliency and dlrover-flash one after another on the same trainer (each
warmed up first, the engine profiled and planned), ``--iters`` recorded iterations per
mode. Every mode's main-thread checkpoint work is an event in the iteration's timeline
(baft's tasks in bubbles green, exposed work red; lm-resiliency's save inside
``optimizer.step()`` and DLRover's after it, red); background threads (baft's worker,
lm-resiliency's replication) show only as longer compute and waits. Writes
``benchmarks/results/peers-timeline-<compute>-<date>.png`` (the last two recorded
iterations of each mode, one panel per mode) and prints per-mode medians.
Needs the peers extra (``pip install -e 'benchmarks[peers]'``) for the peer modes; ``--modes`` picks
others (any ``baft bench overhead`` mode) and ``--name`` the PNG's prefix
(``<name>-timeline-<compute>-<date>.png``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ["none", "baft", "lm-resiliency", "dlrover-flash"]


def worker(cfg_path: str) -> None:
    import torch
    import torch.distributed as dist

    from baft.pipeline.mesh import init_mesh
    from baft.train.trainer import Trainer
    from baft.train.worker import process_main
    from baft_bench.overhead import (
        OverheadConfig,
        _build_modes,
        _close,
        _switch,
        calibrate_emulated,
    )

    spec = json.loads(Path(cfg_path).read_text())
    bcfg = OverheadConfig.from_dict(spec["bench"])

    def body() -> None:
        torch.set_num_threads(1)
        cfg = bcfg.train_config()
        mesh = init_mesh(cfg.parallel)
        if bcfg.compute == "emulated":
            cfg.compute = "emulated"
            cfg.emulated_times = bcfg.fixed_emulated_times() or calibrate_emulated(cfg, mesh)
        trainer = Trainer(cfg, mesh)
        it = 0
        for _ in range(bcfg.num_warmup):
            trainer.run_step(it)
            it += 1
        hooks, skipped = _build_modes(bcfg, cfg, mesh, trainer)
        if skipped:
            raise RuntimeError(f"modes could not be built: {skipped}")
        for mode, h in hooks.items():
            num = bcfg.num_warmup
            if callable(getattr(h, "start", None)):
                h.start(it)
                num += getattr(getattr(h, "ck", None), "profile_iters", 0)
            _switch(trainer, h, True)
            for _ in range(num):
                trainer.run_step(it)
                it += 1
            lines = []
            for _ in range(spec["iters"]):
                lines.append(json.dumps(trainer.run_step(it).timeline.to_json()))
                it += 1
            _switch(trainer, h, False)
            out = Path(bcfg.out_dir) / "timelines" / mode / "timeline"
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{mesh.rank}.jsonl").write_text("\n".join(lines) + "\n")
            dist.barrier()
        for h in hooks.values():
            _close(h)

    process_main(body)


def _draw(run: Path, path: Path, title: str, modes: list[str]) -> dict[str, float]:
    """One panel per mode (the last two recorded iterations); median iteration ms."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from baft.profile.timeline import read_timelines
    from baft.profile.trace import _COLOR, _draw_rank

    fig = Figure(figsize=(14, 2.2 * len(modes)), dpi=110)
    FigureCanvasAgg(fig)
    medians = {}
    width = 0.0
    panels = []
    for mode in modes:
        records = read_timelines(run / "timelines" / mode)
        medians[mode] = 1e3 * statistics.median(
            max(rs[i].iter_s for rs in records.values()) for i in range(len(records[0]))
        )
        chosen = {r: list(rs)[-2:] for r, rs in records.items()}
        origin = min(x.t0 for rs in chosen.values() for x in rs)
        end = max((x.t0 - origin + x.iter_s) * 1e3 for rs in chosen.values() for x in rs)
        width = max(width, end)
        panels.append((mode, chosen, origin, end))
    for i, (mode, chosen, origin, end) in enumerate(panels):
        ax = fig.add_subplot(len(modes), 1, i + 1)
        for row, recs in enumerate(chosen.values()):
            _draw_rank(ax, row, recs, origin, end)
        ax.set_yticks(range(len(chosen)))
        ax.set_yticklabels([f"rank {r}" for r in chosen], fontsize=8)
        ax.set_ylim(len(chosen) - 0.45, -0.65)
        ax.set_xlim(0, width * 1.005)
        ax.set_title(f"{mode}: median iteration {medians[mode]:.0f} ms", fontsize=9, loc="left")
        ax.grid(axis="x", color="#cccccc", lw=0.4)
    fig.axes[-1].set_xlabel("ms since the first of two iterations (black ticks: iteration starts)")
    fig.suptitle(title, fontsize=10)
    fig.legend(
        handles=[
            Patch(facecolor=_COLOR["compute"], label="compute"),
            Patch(facecolor=_COLOR["wait"], edgecolor="#777777", hatch="////", label="wait"),
            Patch(facecolor=_COLOR["ckpt"], label="checkpoint work in a wait"),
            Patch(facecolor=_COLOR["exposed"], label="checkpoint work on the main thread"),
        ],
        loc="lower center",
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path)
    return medians


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--compute", choices=("real", "emulated"), default="real")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes, in order")
    p.add_argument("--name", default="peers", help="PNG name prefix")
    p.add_argument("--emulated-ms", default="", help="fixed emulated stage times, as bench's")
    p.add_argument(
        "--checkpoint",
        default="every=1,redundancy=xor:2,persist=0",
        help="the engine modes' checkpoint spec, as bench's",
    )
    p.add_argument("--out", default="runs/peers-timeline")
    p.add_argument("--results-dir", default="benchmarks/results")
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return 0
    from baft_bench.command import _clean, bench_env
    from baft_bench.overhead import OverheadConfig

    modes = [m for m in a.modes.split(",") if m]
    bcfg = OverheadConfig(
        modes=modes,
        compute=a.compute,
        out_dir=a.out,
        emulated_ms=a.emulated_ms,
        checkpoint=a.checkpoint,
    )
    bcfg.validate()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "peers-timeline.json"
    cfg_path.write_text(json.dumps({"bench": bcfg.to_dict(), "iters": a.iters}) + "\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--monitor-interval=0.1", __file__, "--worker", str(cfg_path),
    ]  # fmt: skip
    load = os.getloadavg()[0]
    start = time.time()
    _clean(bcfg)
    try:
        rc = subprocess.run(cmd, env=bench_env(), check=False).returncode
    finally:
        _clean(bcfg)
    if rc != 0:
        print(f"timeline job failed (exit code {rc})", file=sys.stderr)
        return 1
    tag = " (EMULATED compute)" if a.compute == "emulated" else ""
    png = Path(a.results_dir) / f"{a.name}-timeline-{a.compute}-{dt.date.today().isoformat()}.png"
    medians = _draw(out, png, f"where each mode's checkpoint work lands, pp=2{tag}", modes)
    print(json.dumps({"png": str(png), "median_iter_ms": medians, "load_before": load,
                      "load_after": os.getloadavg()[0], "wall_s": time.time() - start}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
