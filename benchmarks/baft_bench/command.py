"""``baft bench overhead`` behind its flags: launch, summarize, write the results page.

``measure_overhead`` launches one torchrun job (see :mod:`baft_bench.overhead`) and
summarizes its raw results; ``write_results`` writes
``benchmarks/results/overhead-<compute>-<date>.md`` with a boxplot PNG and the raw
samples next to it. The flags, the table and the JSON on stdout live in
:mod:`baft_bench.cli`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from baft_bench.aggregate import COMPONENTS, HEADLINE, pool_launches, summarize
from baft_bench.attribution import markdown
from baft_bench.overhead import (
    ALLOCATOR_ENV,
    ENGINE_MODES,
    RAW_FILE,
    OverheadConfig,
    engine_job_id,
)
from baft_bench.stats import format_ci, noise_words


def engine_import_error() -> str | None:
    """Why ``baft.engine.engine.CheckpointEngine`` cannot be imported (None when it can)."""
    try:
        from baft.engine.engine import CheckpointEngine  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def machine_info() -> dict[str, Any]:
    """nproc, RAM, CPU model and versions of this machine."""
    import torch

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": platform.processor() or platform.machine(),
        "ram_gib": None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["ram_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return info


def _clean(cfg: OverheadConfig) -> None:
    """Remove checkpoint files and engine stores a run of ``cfg`` leaves behind."""
    out = Path(cfg.out_dir)
    shutil.rmtree(out / "ckpt", ignore_errors=True)
    for mode in ENGINE_MODES:
        shutil.rmtree(out / f"engine-{mode}", ignore_errors=True)
        shutil.rmtree(Path(cfg.store_root) / engine_job_id(cfg.out_dir, mode), ignore_errors=True)
    if "dlrover-flash" in cfg.modes:  # shared memory and sockets, also after a crash
        from baft_bench.peers import clean_dlrover, dlrover_run_id

        clean_dlrover(dlrover_run_id(cfg.out_dir))


def bench_env() -> dict[str, str]:
    """The environment of a benchmark's workers: torchrun's, plus :data:`ALLOCATOR_ENV`
    (every mode pays the same for its memory; a value already set wins)."""
    from baft.train.launch import launch_env

    return {**ALLOCATOR_ENV, **launch_env()}


def _launch(cfg: OverheadConfig, timeout_s: float) -> dict[str, Any]:
    """Run the workers under torchrun; their output goes to stderr. Returns the raw JSON."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RAW_FILE).unlink(missing_ok=True)
    _clean(cfg)
    cfg_path = out / "bench-config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    world = cfg.world_size
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "--monitor-interval=0.1",
        "-m",
        "baft_bench.overhead",
        str(cfg_path),
    ]
    env = bench_env()
    env.setdefault("BAFT_HANG_DUMP_S", str(int(timeout_s)))
    try:
        # fd 2: worker output goes to stderr, so stdout carries only the result
        rc = subprocess.run(cmd, env=env, stdout=2, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"benchmark did not finish in {timeout_s:.0f} s") from None
    finally:
        _clean(cfg)
    if rc != 0 or not (out / RAW_FILE).is_file():
        raise RuntimeError(f"benchmark workers failed (exit code {rc}); see the log above")
    raw: dict[str, Any] = json.loads((out / RAW_FILE).read_text())
    return raw


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _shard_words(cfg: dict[str, Any]) -> str:
    """`` dp_shard=N (FSDP2)`` of a layout with FSDP2 stages, else nothing."""
    n = int(cfg.get("num_dp_shard", 1))
    return f" dp_shard={n} (FSDP2)" if n > 1 else ""


def _allocator_lines(mach: dict[str, Any]) -> list[str]:
    """The page line naming the malloc settings every mode ran with (when recorded)."""
    malloc = mach.get("malloc") or {}
    if not malloc:
        return []
    settings = ", ".join(f"{k}={v}" for k, v in malloc.items())
    return [
        f"- allocator (every mode): glibc with {settings} (no freed memory handed back to "
        "the kernel and faulted in again)"
    ]


def render_markdown(result: dict[str, Any], *, command: str, date: str, plot: str | None) -> str:
    """The results page: date, machine, command, table of raw numbers and ratios, plot."""
    emulated = result["compute"] == "emulated"
    tag = " (EMULATED compute)" if emulated else ""
    cfg, mach = result["config"], result["machine"]
    lines = [
        f"# Checkpoint overhead, side by side{tag}",
        "",
        f"- date: {date}",
        f"- machine: {mach.get('nproc')} CPUs ({mach.get('cpu_model')}), "
        f"{mach.get('ram_gib')} GiB RAM, torch {mach.get('torch')}, python {mach.get('python')}; "
        f"1-min load average {mach.get('load_before', '?')} before, "
        f"{mach.get('load_after', '?')} after (other jobs share the machine)",
        f"- command: `{command}`",
        *_allocator_lines(mach),
        f"- layout: pp={cfg['num_pp']} dp={cfg['num_dp']}{_shard_words(cfg)} {cfg['schedule']}, "
        f"{cfg['num_microbatches']} microbatches, {cfg['num_layers']} layers, "
        f"d_model={cfg['d_model']}, seq_len={cfg['seq_len']}, batch={cfg['global_batch']}",
        *_design_lines(result),
        "- state per rank (model + AdamW): "
        + ", ".join(f"{b / 2**20:.1f} MiB" for b in result["state_bytes_per_rank"]),
        f"- sync_snapshot_fraction: {_fmt(result['sync_snapshot_fraction'], '.3f')} "
        f"(one synchronous copy_ of the state, {result['snapshot_s'] * 1e3:.1f} ms, "
        "over the median `none` iteration)",
        "",
        f"| mode{tag} | median iter (ms) | IQR (ms) | ratio vs none [95% CI] | paired ratio "
        "| wall ms / iter | wall ratio | paired wall ratio "
        "| exposed ckpt (ms) | in-bubble fraction | MiB protected / iter | disk saves / iter "
        "| iterations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in result["modes"].items():
        lines.append(
            f"| {name}{' (EMULATED)' if emulated else ''} | {_fmt(m['median_iter_s'], '.1f', 1e3)} "
            f"| {_fmt(m['iqr_iter_s'], '.1f', 1e3)} | {_ratio_cell(m, 'ratio_vs_none')} "
            f"| {_ratio_cell(m, 'paired_ratio_vs_none')} "
            f"| {_fmt(m.get('wall_per_iter_s'), '.1f', 1e3)} "
            f"| {_ratio_cell(m, 'wall_ratio_vs_none')} "
            f"| {_ratio_cell(m, 'paired_wall_ratio_vs_none')} "
            f"| {_fmt(m['exposed_s'], '.1f', 1e3)} | {_fmt(m['in_bubble_fraction'], '.2f')} "
            f"| {_fmt(m['bytes_per_iter'], '.1f', 2**-20)} "
            f"| {_fmt(m.get('disk_saves_per_iter'), '.2f')} | {m['num_iters']} |"
        )
    lines.append("")
    lines += _noise_lines(result)
    lines += _extra_lines(result)
    lines += _component_lines(result)
    lines += _attribution_lines(result)
    for name, why in result.get("skipped", {}).items():
        lines.append(f"- skipped `{name}`: {why}")
    lines += _protection_lines(list(result["modes"]))
    if emulated and result.get("emulated_times"):
        t = result["emulated_times"]
        lines.append(
            "- EMULATED: per-stage forward/backward sleeps (ms) "
            + (
                "fixed by --emulated-ms"
                if cfg.get("emulated_ms")
                else "calibrated on the real model"
            )
            + ": "
            + ", ".join(
                f"stage {i}: {f * 1e3:.1f}/{b * 1e3:.1f}"
                for i, (f, b) in enumerate(zip(t["fwd"], t["bwd"], strict=True))
            )
        )
    lines += [
        "- ratio vs none: ratio of medians (per iteration, the max over ranks); paired "
        "ratio: median over rounds of the block median over the `none` block median of the "
        "same round (robust to drifting load). Every ratio shows `value x [low, high]`: "
        "the 95% percentile bootstrap interval over rounds (rounds resampled with "
        "replacement within each launch, 2000 resamples, seeded).",
        "- wall ms / iter: the pace (each rank runs a block's iterations back to back: its "
        "block wall time over the block's iterations, mean over ranks, mean over blocks); "
        "wall ratio: that over `none`'s; paired wall ratio: median over rounds of the block "
        "wall over the same round's `none` block wall. This is the throughput a run pays; "
        "the per-iteration max also moves when a mode only shifts where ranks' iteration "
        "boundaries fall.",
        "- exposed: main-thread checkpoint seconds outside pipeline waits (max over ranks); "
        "in-bubble fraction: share of main-thread checkpoint seconds spent inside waits, as "
        "each mode reports it (naive-async counts its background copy thread there).",
        "- Timings on a shared 2-core machine are noisy: compare modes within this run only.",
        "",
    ]
    if plot:
        lines += [f"![iteration times per mode]({plot})", ""]
    return "\n".join(lines)


def _ratio_cell(m: dict[str, Any], name: str) -> str:
    """A ratio with its interval: ``1.015x [1.004, 1.027]``."""
    low, high = (m.get("ci") or {}).get(name) or (None, None)
    return format_ci(m.get(name), low, high)


def _design_lines(result: dict[str, Any]) -> list[str]:
    """How many launches and rounds, and how balanced the order of the modes was."""
    cfg = result["config"]
    per_launch = result.get("launch_rounds") or [cfg["num_blocks"]]
    design = result.get("design") or {}
    launches = (
        "one launch"
        if len(per_launch) == 1
        else f"{len(per_launch)} launches, each a fresh torchrun job, of "
        + "/".join(str(r) for r in per_launch)
        + " rounds, pooled"
    )
    return [
        f"- rounds: {sum(per_launch)} ({launches}), each round one block of "
        f"{cfg['block_iters']} measured iterations per mode, interleaved, each round in "
        f"another order (Williams design: {design.get('note', 'balance not recorded')}); "
        f"{cfg['num_switch_iters']} unmeasured after each switch; before its first block "
        "each engine mode ran unmeasured through its profile, plan and one re-plan",
    ]


def _noise_lines(result: dict[str, Any]) -> list[str]:
    """Per mode in words: is its difference to `none` and to naive-async resolved?"""
    lines = []
    for name, m in result["modes"].items():
        if name == "none" or m.get("ci_low") is None:
            continue
        parts = [
            f"vs `none` {format_ci(m.get(HEADLINE), m.get('ci_low'), m.get('ci_high'))}: "
            + noise_words(m.get("ci_low"), m.get("ci_high"))
        ]
        for ref, v in (m.get("vs") or {}).items():
            if ref != "none":
                parts.append(
                    f"vs `{ref}` {format_ci(v['paired_wall_ratio'], v['ci_low'], v['ci_high'])}: "
                    + noise_words(v["ci_low"], v["ci_high"])
                )
        launches = m.get("per_launch") or []
        if launches:
            parts.append(
                "per launch "
                + ", ".join(format_ci(x[HEADLINE], x["ci_low"], x["ci_high"]) for x in launches)
            )
        lines.append(f"- `{name}` (paired wall ratio): " + "; ".join(parts))
    if not lines:
        return []
    return ["Is the difference resolved? (paired wall ratio, 95% CI over rounds)", "", *lines, ""]


def _mib(values: Any) -> str:
    """Per-rank bytes as MiB, ``/``-separated; ``-`` when not measured."""
    if not isinstance(values, list) or not values:
        return "-"
    return " / ".join(_fmt(v, ".0f", 2**-20) for v in values)


def _extra_lines(result: dict[str, Any]) -> list[str]:
    """Memory per rank, whether the newest checkpoint restores, the transport and K per
    mode, and the peer libraries' versions: when the run recorded them."""
    modes = result["modes"]
    keys = ("memory", "restores", "transport", "k")
    lines = []
    versions = result.get("peer_versions") or {}
    ks = {n: m["k"] for n, m in modes.items() if m.get("k") is not None}
    if versions or ks:
        lines.append(
            "- peer library versions: "
            + (", ".join(f"{lib} {v}" for lib, v in versions.items()) or "none recorded")
            + "; K (full_every) chosen: "
            + (", ".join(f"`{n}` {k}" for n, k in ks.items()) or "not recorded")
        )
    if any(k in m for m in modes.values() for k in keys):
        lines += [
            "",
            "Memory per rank (MiB, rank 0 / rank 1 / ...), restore check and transport:",
            "",
            "| mode | peak RSS MiB | shared memory MiB | CUDA peak MiB | restores | transport | K |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, m in modes.items():
            mem = m.get("memory") or {}
            lines.append(
                f"| {name} | {_mib(mem.get('rss_peak_bytes'))} | {_mib(mem.get('shm_bytes'))} "
                f"| {_mib(mem.get('cuda_peak_bytes'))} | {m.get('restores') or '-'} "
                f"| {m.get('transport') or '-'} | {m.get('k') if m.get('k') is not None else '-'} |"
            )
    return [*lines, ""] if lines else []


def _rank_value(per: dict[str, Any], field: str, rank: int, scale: float) -> str:
    values = per.get(field) or []
    return _fmt(values[rank] if rank < len(values) else None, ".1f", scale)


def _component_lines(result: dict[str, Any]) -> list[str]:
    """Per rank and iteration: where protect time goes, next to the idle time offered."""
    rows = []
    for name, m in result["modes"].items():
        per = m.get("per_rank") or {}
        if not per.get("cpu_s"):
            continue
        for rank in range(len(per["cpu_s"])):
            cells = [
                _rank_value(per, f, rank, scale)
                for f, scale in [
                    ("blocked_s", 1e3),
                    ("protect_cpu_s", 1e3),
                    *((f"{c}_s", 1e3) for c in COMPONENTS),
                    ("pull_bytes", 2**-20),
                    ("net_bytes", 2**-20),
                    ("faults", 1e-3),
                ]
            ]
            rows.append(f"| {name} | {rank} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "Per rank and iteration (medians): the idle time the pipeline offers (`blocked`), "
        "the CPU the mode adds over `none` (every thread of the rank's process), protect "
        "seconds by component (wall seconds on the thread doing it; `copy` includes hashing "
        "where the copier hashes on the way) and redundancy MiB taken in per path "
        "(same-host store pull vs network), and the process's minor page faults (thousands).",
        "",
        "| mode | rank | blocked ms | added CPU ms | "
        + " | ".join(f"{c} ms" for c in COMPONENTS)
        + " | pulled MiB | network MiB | page faults (k) |",
        "|---|---|---|---|" + "---|" * len(COMPONENTS) + "---|---|---|",
        *rows,
        "",
    ]


def _attribution_lines(result: dict[str, Any]) -> list[str]:
    """Where each mode's overhead goes on each rank (:mod:`baft_bench.attribution`)."""
    modes = [
        m for m, v in result["modes"].items()
        if m != "none" and "main_cpu_s" in (v.get("per_rank_mean") or {})
    ]  # fmt: skip
    if "none" not in result["modes"] or not modes:
        return []
    return [
        "Attribution (means, ms per iteration over `none`): the training thread's own CPU "
        "(`main_cpu`, of it in the kernel `main_sys`, e.g. loopback TCP charged to it), its "
        "run-queue delay, its waits for checkpoint work at the step, its extra pipeline "
        "waits, the residual (GIL waits, overrun sleeps); beside them the CPU of baft's "
        "threads and of the others (gloo, torch). A neighbour's slowdown shows on a rank as "
        "pipeline wait, so read `pipeline_wait + residual` together across ranks.",
        "",
        markdown(result, modes),
        "",
    ]


def _protection_lines(modes: list[str]) -> list[str]:
    """What each peer mode's snapshot survives, when the run compared peers."""
    from baft_bench.peers import PROTECTS

    peers = [m for m in modes if m in PROTECTS]
    if not peers:
        return []
    lines = ["- what each mode's per-iteration copy survives, as run here:"]
    if "baft" in modes:
        lines.append(
            "  - `baft`: process crash: yes (shared-memory store outlives the process); "
            "loss of a node: yes with cross-node redundancy (see --checkpoint); "
            "power loss: only from its DCP persists (`persist=` in --checkpoint)"
        )
    lines += [f"  - `{m}`: {PROTECTS[m]}" for m in peers]
    return lines


def plot_iterations(raw: dict[str, Any], path: Path, *, title: str) -> None:
    """Boxplot of iteration seconds (max over ranks) per mode, as a PNG (every launch's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = pool_launches(raw)["modes"]
    names = list(modes)
    data = [[max(row) * 1e3 for row in modes[n]["iter_s"]] for n in names]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.set_ylabel("iteration time (ms, max over ranks)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(
    result: dict[str, Any], raw: dict[str, Any], results_dir: Path, command: str
) -> Path:
    """Write ``overhead-<compute>-<date>.md``, its PNG and the raw samples
    (``.raw.json``) under ``results_dir``."""
    date = _dt.date.today().isoformat()
    results_dir.mkdir(parents=True, exist_ok=True)
    from baft_bench.modes import PEER_MODES

    peers = any(m in PEER_MODES for m in result["modes"])  # own page, beside the plain one
    policy = str(result["config"].get("checkpoint", ""))
    variant = next(  # a non-default redundancy gets its own page (default: xor:2)
        (
            "-" + part.split("=", 1)[1].replace(":", "").replace("+", "p")
            for part in policy.split(",")
            if part.startswith("redundancy=") and part != "redundancy=xor:2"
        ),
        "",
    )
    stem = f"{'peers-' if peers else ''}overhead-{result['compute']}{variant}-{date}"
    tag = " (EMULATED)" if result["compute"] == "emulated" else ""
    plot_iterations(raw, results_dir / f"{stem}.png", title=f"iteration time per mode{tag}")
    (results_dir / f"{stem}.raw.json").write_text(json.dumps(raw) + "\n")
    page = render_markdown(result, command=command, date=date, plot=f"{stem}.png")
    path = results_dir / f"{stem}.md"
    path.write_text(page)
    return path


def measure_overhead(
    cfg: OverheadConfig, *, timeout_s: float, launches: int = 1
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the benchmark of ``cfg`` in ``launches`` torchrun jobs, one after the other
    (each a fresh job), and pool their rounds; returns ``(summary, raw)``. ``raw`` is the
    job's raw output for one launch, ``{"config": ..., "launches": [raw, ...]}`` for
    several (every launch's samples kept; :func:`baft_bench.aggregate.pool_launches`).

    Engine modes are left out (with a note on stderr, and under ``skipped`` in the raw
    results) when ``baft.engine.engine`` cannot be imported. Raises ``RuntimeError`` when
    a job fails or runs past ``timeout_s`` (per launch).
    """
    engine_modes = [m for m in cfg.modes if m in ENGINE_MODES]
    why = engine_import_error() if engine_modes else None
    if why is not None:
        for m in engine_modes:
            print(f"[bench] note: skipping {m} (baft.engine.engine unavailable: {why})", file=sys.stderr)  # fmt: skip
        cfg.modes = [m for m in cfg.modes if m not in engine_modes]
    load_before = os.getloadavg()[0]
    raws = []
    for i in range(launches):
        print(
            f"[bench] overhead: launch {i + 1}/{launches}, modes {', '.join(cfg.modes)}, "
            f"{cfg.total_iterations()} iterations on {cfg.world_size} ranks "
            f"({cfg.compute} compute) -> {cfg.out_dir}",
            file=sys.stderr,
            flush=True,
        )
        one = _launch(cfg, timeout_s)
        if why is not None:
            one.setdefault("skipped", {}).update({m: f"import failed: {why}" for m in engine_modes})  # fmt: skip
        raws.append(one)
    raw = raws[0] if launches == 1 else {"config": cfg.to_dict(), "launches": raws}
    machine = machine_info()
    machine["load_before"] = round(load_before, 2)
    machine["load_after"] = round(os.getloadavg()[0], 2)
    env = bench_env()
    machine["malloc"] = {k: env[k] for k in ALLOCATOR_ENV}
    return summarize(raw, machine), raw
