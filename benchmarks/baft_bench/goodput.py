"""``baft bench goodput``: measured overhead + measured recovery + an MTBF -> training efficiency.

What a user buys is not a low per-iteration overhead but a high share of wall time spent
on useful iterations once failures are counted. Per checkpointing mode this combines

- the per-iteration overhead ratio measured by ``baft bench overhead`` (its ``--json``
  object or a ``.raw.json`` next to a results page; the paired wall ratio when present),
- the downtime and lost work per failure measured by ``baft bench recovery`` (its
  ``--json`` object, or the results page whose raw JSON block holds it); modes without a
  measurement of their own get a stated assumption (:data:`MODE_RECOVERY`),
- a failure rate per GPU from Llama 3's report (419 unexpected interruptions in 54 days
  on 16,384 H100s: about one per 3 h), scaled to the job's GPU count,

into :func:`efficiency`. The same arithmetic then runs on the simulator's numbers at
cluster sizes (``baft.sim``: iteration time, exposed checkpoint share and recovery time of
a published model layout), every such row labelled ``simulated``; modes the simulator does
not model keep their measured ratio, labelled so. Every assumed number says so in the
output.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LLAMA3_MTBF_HOURS = 3.0
"""Job-level mean time between interruptions at :data:`LLAMA3_GPUS` (419 unexpected
interruptions in 54 days: 3.1 h; rounded)."""
LLAMA3_GPUS = 16384
"""GPUs of the Llama 3 405B pre-training job the MTBF was observed on."""
MTBF_SOURCE = (
    "Llama 3 report (Dubey et al. 2024, Sec. 3.3.4): 419 unexpected interruptions in a "
    "54-day snapshot of pre-training on 16,384 H100 GPUs, about one per 3 h; taken as a "
    "constant failure rate per GPU, so the job MTBF is 3 h x 16,384 / GPUs"
)
RATIO_KEYS = ("paired_wall_ratio_vs_none", "wall_ratio_vs_none", "ratio_vs_none")
"""Overhead ratio fields of the overhead JSON, the preferred first."""
MEMORY_ROWS = ("node loss", "rank crash")
"""Recovery rows of a restore from the in-memory stores (a node loss first: most
interruptions at scale are a failed GPU or host)."""
DISK_ROWS = ("power loss, cold (evicted) cache", "power loss, warm page cache")
"""Recovery rows of a restore from disk (DCP), the cold page cache first."""
LM_ROWS = ("rank crash (lm-resiliency)",)
"""lm-resiliency's own recovery row (present when the peers extra was installed)."""


@dataclass(frozen=True, slots=True)
class ModeRecovery:
    """How a mode recovers from a failure, for the goodput model."""

    rows: tuple[str, ...]
    """Recovery scenarios whose measured downtime applies, the first present wins; empty:
    nothing the mode keeps survives the failure (no efficiency)."""
    measured_by: str
    """The mode whose restore those rows measured (``""``: this mode's own)."""
    lost_iters: float | None
    """Assumed iterations lost per failure (interval/2 + commit lag, every iteration a
    checkpoint); None: the measured row's ``lost_iterations``."""
    note: str
    """What the assumption is, in words."""


MODE_RECOVERY: dict[str, ModeRecovery] = {
    "none": ModeRecovery((), "", None, "no checkpoint: a failure loses the run so far"),
    "baft": ModeRecovery(MEMORY_ROWS, "", None, "restore from the in-memory stores"),
    "baft-full": ModeRecovery(
        MEMORY_ROWS, "baft", None, "the engine's memory restore, measured on baft's differential one"
    ),
    "naive-async": ModeRecovery(
        MEMORY_ROWS, "baft", None, "the engine's memory restore, measured on baft's"
    ),
    "lm-resiliency": ModeRecovery(
        LM_ROWS + MEMORY_ROWS, "", None, "restore from its peer replica"
    ),
    "torch-save": ModeRecovery(
        DISK_ROWS, "baft's DCP tier", 0.5,
        "restore from disk (files on storage that survives the failure); lost: half an "
        "interval of 1 iteration",
    ),
    "dcp-async": ModeRecovery(
        DISK_ROWS, "baft's DCP tier", 1.5,
        "restore from disk; lost: half an interval of 1 + 1 iteration whose async save "
        "had not finished",
    ),
    "checkfreq": ModeRecovery(
        DISK_ROWS, "baft's DCP tier", 1.5,
        "restore from disk; lost: half an interval of 1 + 1 iteration whose background "
        "persist had not finished",
    ),
    "dlrover-flash": ModeRecovery(
        (), "", None,
        "as run in the bench nothing survives a node loss (no replica, no persist)",
    ),
}  # fmt: skip
"""Per overhead-bench mode: where its downtime comes from and what it loses."""
SIM_MODES = {"baft": "differential", "baft-full": "baft", "naive-async": "naive-async", "torch-save": "sync"}  # fmt: skip
"""Bench mode -> the simulator's row that models it (``differential``: the
differential ``baft`` row; ``sync``: a synchronous write at the Young/Daly interval)."""


def job_mtbf_s(
    gpus: int, ref_mtbf_h: float = LLAMA3_MTBF_HOURS, ref_gpus: int = LLAMA3_GPUS
) -> float:
    """Seconds between failures of a job on ``gpus`` GPUs: a constant rate per GPU,
    ``1 / (ref_mtbf_h * 3600 * ref_gpus)``, times the GPU count."""
    if gpus < 1 or ref_mtbf_h <= 0 or ref_gpus < 1:
        raise ValueError(f"gpus={gpus}, ref_gpus={ref_gpus} must be >= 1, ref_mtbf_h > 0")
    return ref_mtbf_h * 3600.0 * ref_gpus / gpus


def efficiency(
    *, iter_s: float, overhead_ratio: float, downtime_s: float, lost_iters: float, mtbf_s: float
) -> dict[str, float]:
    """Expected share of wall time spent on useful iterations (first order in 1/MTBF).

    With ``T`` = ``iter_s`` (an iteration without checkpointing), ``r`` =
    ``overhead_ratio``, ``D`` = ``downtime_s`` (detect, restart, restore, replay),
    ``L`` = ``lost_iters`` (iterations redone after a failure) and ``M`` = ``mtbf_s``:

        Tc        = r * T                      iteration time with checkpointing
        cost      = D + L * Tc                 seconds one failure costs
        per_iter  = (Tc / M) * cost            expected failure seconds per iteration
        efficiency = T / (Tc + per_iter)

    Failures during a recovery and the restart's own failure rate are ignored (fine
    while ``cost`` is far below ``M``). Returns ``iter_with_ckpt_s``, ``failure_s_per_iter``
    and ``efficiency``.
    """
    if iter_s <= 0 or overhead_ratio <= 0 or mtbf_s <= 0 or downtime_s < 0 or lost_iters < 0:
        raise ValueError(
            f"iter_s={iter_s}, overhead_ratio={overhead_ratio}, mtbf_s={mtbf_s} must be > 0; "
            f"downtime_s={downtime_s}, lost_iters={lost_iters} >= 0"
        )
    tc = overhead_ratio * iter_s
    per_iter = tc / mtbf_s * (downtime_s + lost_iters * tc)
    return {
        "iter_with_ckpt_s": tc,
        "failure_s_per_iter": per_iter,
        "efficiency": iter_s / (tc + per_iter),
    }


# ------------------------------------------------------------------ inputs
def load_json(path: Path) -> dict[str, Any]:
    """A JSON file, or the last fenced ```json block of a markdown results page."""
    text = path.read_text()
    if path.suffix == ".md":
        blocks = re.findall(r"```json\n(.*?)\n```", text, flags=re.S)
        if not blocks:
            raise ValueError(f"{path}: no ```json block (pass the --json output instead)")
        text = blocks[-1]
    data: dict[str, Any] = json.loads(text)
    return data


def overhead_summary(data: dict[str, Any]) -> dict[str, Any]:
    """The overhead bench's summary: as given (``--json``), or computed from raw samples."""
    first: dict[str, Any] = next(iter(data.get("modes", {}).values()), {})
    if "iter_s" in first and "median_iter_s" not in first:
        from baft_bench.aggregate import summarize

        return summarize(data)
    return data


def overhead_ratio(m: dict[str, Any]) -> tuple[float, str, float | None, float | None]:
    """(ratio, its field, ci_low, ci_high) of one mode of the overhead summary."""
    for key in RATIO_KEYS:
        if m.get(key) is not None:
            return float(m[key]), key, m.get("ci_low"), m.get("ci_high")
    raise ValueError(f"overhead JSON mode has none of {RATIO_KEYS}")


def recovery_row(recovery: dict[str, Any], scenarios: tuple[str, ...]) -> dict[str, Any] | None:
    """The first row of ``recovery`` (``baft bench recovery --json``) named in ``scenarios``."""
    rows = {r["scenario"]: r for r in recovery.get("rows", [])}
    return next((rows[s] for s in scenarios if s in rows), None)


def row_downtime_s(row: dict[str, Any]) -> float:
    """All phases of a recovery row (detect/restart, rendezvous, restore, first iteration)
    plus the replay of differential records when its phases do not hold it."""
    replay = 0.0 if "replay" in row.get("seconds", {}) else float(row.get("replay_s", 0.0))
    return float(row["total_s"]) + replay


# ------------------------------------------------------------------ measured
@dataclass(slots=True)
class ModeInputs:
    """One mode's inputs to :func:`efficiency`, each with where it comes from."""

    mode: str
    overhead_ratio: float
    overhead_source: str
    downtime_s: float | None
    downtime_source: str
    lost_iters: float | None
    lost_source: str
    ci: tuple[float, float] | None = None
    """The overhead ratio's confidence interval, when the overhead JSON has one."""
    reason: str = ""
    """Why no efficiency is given (empty when one is)."""


def _restores_failed(m: dict[str, Any]) -> bool:
    value = m.get("restores")
    return value is False or (isinstance(value, str) and value.lower() == "no")


def mode_inputs(mode: str, m: dict[str, Any], recovery: dict[str, Any]) -> ModeInputs:
    """The measured and assumed inputs of ``mode`` (its overhead-summary entry ``m``)."""
    ratio, key, lo, hi = overhead_ratio(m)
    ci = (float(lo), float(hi)) if lo is not None and hi is not None else None
    inp = ModeInputs(mode, ratio, f"measured ({key})", None, "", None, "", ci)
    spec = MODE_RECOVERY.get(mode)
    if spec is None or not spec.rows:
        inp.reason = spec.note if spec else f"no recovery model for mode {mode!r}"
        return inp
    if _restores_failed(m):
        inp.reason = "its newest checkpoint did not restore in the overhead bench"
        return inp
    row = recovery_row(recovery, spec.rows)
    if row is None:
        inp.reason = f"the recovery JSON has none of the rows {list(spec.rows)}"
        return inp
    inp.downtime_s = row_downtime_s(row)
    own = not spec.measured_by and (mode != "lm-resiliency" or row["scenario"] in LM_ROWS)
    by = "" if own else f" of {spec.measured_by or 'baft'}, assumed the same for {mode}"
    inp.downtime_source = f"measured: recovery row '{row['scenario']}'{by}"
    if spec.lost_iters is None:
        inp.lost_iters = float(row["lost_iterations"])
        inp.lost_source = f"measured: recovery row '{row['scenario']}'"
    else:
        inp.lost_iters = spec.lost_iters
        inp.lost_source = f"assumed: {spec.note}"
    return inp


def _at(inp: ModeInputs, iter_s: float, mtbf_s: float, gpus: int) -> dict[str, Any]:
    """One mode's efficiency on ``gpus`` GPUs (None with a reason when it has none)."""
    out: dict[str, Any] = {"gpus": gpus, "mtbf_h": mtbf_s / 3600.0, "efficiency": None}
    if inp.reason or inp.downtime_s is None or inp.lost_iters is None:
        return out
    args = {"iter_s": iter_s, "downtime_s": inp.downtime_s, "lost_iters": inp.lost_iters, "mtbf_s": mtbf_s}  # fmt: skip
    out.update(efficiency(overhead_ratio=inp.overhead_ratio, **args))
    if inp.ci is not None:  # a higher ratio gives a lower efficiency
        out["efficiency_ci"] = [
            efficiency(overhead_ratio=inp.ci[1], **args)["efficiency"],
            efficiency(overhead_ratio=inp.ci[0], **args)["efficiency"],
        ]
    return out


def measured_goodput(
    overhead: dict[str, Any],
    recovery: dict[str, Any],
    *,
    gpus: list[int],
    ref_mtbf_h: float = LLAMA3_MTBF_HOURS,
    ref_gpus: int = LLAMA3_GPUS,
) -> dict[str, Any]:
    """Per mode of the overhead summary: its inputs and its efficiency on the bench's own
    rank count (ranks taken as GPUs) and on each of ``gpus`` (the measured iteration and
    recovery held, only the failure rate scaled)."""
    summary = overhead_summary(overhead)
    cfg = summary.get("config", {})
    world = int(cfg.get("num_pp", 1)) * int(cfg.get("num_dp", 1))
    none = summary["modes"]["none"]
    iter_s = float(none.get("wall_per_iter_s") or none["median_iter_s"])
    sizes = [world] + [g for g in gpus if g != world]
    rows = []
    for mode, m in summary["modes"].items():
        inp = mode_inputs(mode, m, recovery)
        at = [_at(inp, iter_s, job_mtbf_s(g, ref_mtbf_h, ref_gpus), g) for g in sizes]
        rows.append({**asdict(inp), "by_gpus": at})
    return {
        "label": "measured",
        "compute": summary.get("compute"),
        "bench_ranks": world,
        "iter_s": iter_s,
        "config": cfg,
        "persist_every": recovery.get("persist_every"),
        "modes": rows,
    }


# ------------------------------------------------------------------ simulated
def _sim_row(name: str, sim: dict[str, Any]) -> dict[str, Any]:
    return sim["differential"]["mode"] if name == "differential" else sim["modes"][name]


def simulated_inputs(mode: str, measured: ModeInputs, sim: dict[str, Any]) -> ModeInputs:
    """``mode``'s inputs at the simulated scale: the simulator's exposed share, interval
    and recovery for the modes it models; the measured ratio held constant otherwise
    (downtime: the simulator's memory or disk recovery, lost work: as measured/assumed)."""
    it = float(sim["iteration_s"])
    inp = ModeInputs(mode, measured.overhead_ratio, "", None, "", None, "", measured.ci, measured.reason)  # fmt: skip
    if measured.reason:
        return inp
    if mode in SIM_MODES:
        r = _sim_row(SIM_MODES[mode], sim)
        replay = float(r.get("replay_s", 0.0))
        inp.overhead_ratio = 1.0 + float(r["exposed_fraction"])
        inp.overhead_source = f"simulated ({SIM_MODES[mode]} row, interval {r['interval_iters']})"
        inp.ci = None
        inp.downtime_s = float(r["recovery_s"]) + replay
        inp.downtime_source = "simulated (assumed restart + state over NIC/storage + H2D" + (" + replay)" if replay else ")")  # fmt: skip
        inp.lost_iters = (float(r["expected_lost_s"]) - float(r["recovery_s"]) - replay) / it
        inp.lost_source = "simulated (interval/2 + commit lag)"
        return inp
    disk = MODE_RECOVERY[mode].rows == DISK_ROWS
    src = sim["modes"]["sync" if disk else "baft"]
    inp.overhead_source = "MEASURED ratio held constant (the simulator has no model of it)"
    inp.downtime_s = float(src["recovery_s"])
    inp.downtime_source = f"simulated ({'disk' if disk else 'memory'} recovery)"
    inp.lost_iters = measured.lost_iters
    inp.lost_source = measured.lost_source
    return inp


def simulated_goodput(
    measured: list[ModeInputs],
    *,
    gpus: list[int],
    preset: str = "llama2-70b",
    hardware: str = "h100",
    redundancy: str = "xor:2",
    restart_s: float = 60.0,
    storage_gbps: float = 0.5,
    ref_mtbf_h: float = LLAMA3_MTBF_HOURS,
    ref_gpus: int = LLAMA3_GPUS,
) -> list[dict[str, Any]]:
    """Per cluster size: the simulator's scenario and every mode's efficiency there."""
    from baft.plan.types import CheckpointPolicy
    from baft.sim.command import evaluate
    from baft.sim.presets import build_scenario

    out = []
    for g in gpus:
        mtbf = job_mtbf_s(g, ref_mtbf_h, ref_gpus)
        sim = evaluate(
            build_scenario(preset, hardware, g),
            CheckpointPolicy(redundancy=redundancy),
            mtbf_s=mtbf,
            storage_Bps=storage_gbps * 1e9,
            restart_s=restart_s,
        )
        rows = []
        for inp in measured:
            s = simulated_inputs(inp.mode, inp, sim)
            rows.append({**asdict(s), **_at(s, float(sim["iteration_s"]), mtbf, g)})
        out.append({
            "label": "simulated",
            "gpus": g,
            "preset": preset,
            "hardware": hardware,
            "layout": sim["layout"],
            "iteration_s": sim["iteration_s"],
            "bubble_fraction": sim["bubble_fraction"],
            "mtbf_h": mtbf / 3600.0,
            "modes": rows,
        })  # fmt: skip
    return out


# ------------------------------------------------------------------ output
def assumptions(a: Any) -> dict[str, Any]:
    """Every assumed number of a ``goodput`` run, as printed with its results."""
    return {
        "mtbf": MTBF_SOURCE,
        "ref_mtbf_h": a.mtbf_hours,
        "ref_gpus": a.mtbf_gpus,
        "efficiency": "T / (r*T + (r*T / MTBF) * (D + L*r*T)); T: iteration without "
        "checkpointing, r: overhead ratio, D: downtime per failure, L: iterations lost",
        "measured rows": "the bench's iteration time, ratio and recovery held, only the "
        "failure rate scaled to each GPU count (bench ranks taken as GPUs)",
        "modes": {m: s.note for m, s in MODE_RECOVERY.items()},
        "simulated": f"baft.sim on {a.preset} / {a.hardware}, redundancy {a.redundancy}, "
        f"restart {a.restart_s:g} s, storage {a.storage_gbps:g} GB/s per GPU (assumed)",
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _eff(at: dict[str, Any]) -> str:
    ci = at.get("efficiency_ci")
    s = _pct(at["efficiency"])
    return f"{s} [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else s


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_markdown(result: dict[str, Any], command: str) -> str:
    """The section a results page can take as it is: tables, then every assumption."""
    meas = result["measured"]
    sizes = [at["gpus"] for at in meas["modes"][0]["by_gpus"]]
    head = " | ".join(f"efficiency @ {g} GPUs (MTBF {at['mtbf_h']:.3g} h)" for g, at in zip(sizes, meas["modes"][0]["by_gpus"], strict=True))  # fmt: skip
    lines = [
        "## Goodput: overhead and failures together",
        "",
        f"- command: `{command}`",
        f"- measured: `none` iteration {meas['iter_s'] * 1e3:.1f} ms ({meas['compute']} compute, "
        f"{meas['bench_ranks']} ranks); efficiency = useful iteration time / (iteration with "
        "checkpointing + expected failure seconds per iteration)",
        "",
        f"| mode | overhead ratio | downtime / failure (s) | lost iters / failure | {head} |",
        "|---|---|---|---|" + "---|" * len(sizes),
    ]
    for r in meas["modes"]:
        ci = f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r.get("ci") else ""
        lines.append(
            f"| {r['mode']} | {r['overhead_ratio']:.3f}{ci} | {_num(r['downtime_s'], '.2f')} "
            f"| {_num(r['lost_iters'], '.1f')} | "
            + " | ".join(_eff(at) for at in r["by_gpus"])
            + " |"
        )
    lines += ["", "Where each measured row's numbers come from:", ""]
    for r in meas["modes"]:
        src = r["reason"] or f"ratio {r['overhead_source']}; downtime {r['downtime_source']}; lost {r['lost_source']}"  # fmt: skip
        lines.append(f"- `{r['mode']}`: {src}")
    for sc in result.get("simulated", []):
        lay = sc["layout"]
        lines += [
            "",
            f"### SIMULATED: {sc['preset']} on {sc['gpus']} {sc['hardware']} GPUs "
            f"(dp/pp/tp {lay['dp']}/{lay['pp']}/{lay['tp']}, {lay['schedule']}), "
            f"iteration {sc['iteration_s']:.2f} s, bubbles {sc['bubble_fraction']:.1%}, "
            f"MTBF {sc['mtbf_h']:.2f} h",
            "",
            "| mode | overhead ratio | ratio from | downtime (s) | lost iters | efficiency (simulated) |",
            "|---|---|---|---|---|---|",
        ]
        for r in sc["modes"]:
            lines.append(
                f"| {r['mode']} | {r['overhead_ratio']:.4f} | {r['overhead_source'] or r['reason']} "
                f"| {_num(r['downtime_s'], '.1f')} | {_num(r['lost_iters'], '.1f')} | {_eff(r)} |"
            )
    lines += ["", "Assumptions:", ""]
    for k, v in result["assumptions"].items():
        if isinstance(v, dict):
            lines += [f"- {k}:"] + [f"  - `{m}`: {t}" for m, t in v.items()]
        else:
            lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def render_text(result: dict[str, Any]) -> str:
    """A plain-text table for the terminal (the markdown has the sources)."""
    meas = result["measured"]
    sizes = [at["gpus"] for at in meas["modes"][0]["by_gpus"]]
    lines = [f"MEASURED (none iteration {meas['iter_s'] * 1e3:.1f} ms; MTBF scaled per GPU)"]
    lines.append(f"{'mode':<14}{'ratio':>8}{'down s':>9}{'lost':>6}" + "".join(f"{f'@{g}':>10}" for g in sizes))  # fmt: skip
    for r in meas["modes"]:
        lines.append(
            f"{r['mode']:<14}{r['overhead_ratio']:8.3f}{_num(r['downtime_s'], '9.2f'):>9}"
            f"{_num(r['lost_iters'], '6.1f'):>6}"
            + "".join(f"{_pct(at['efficiency']):>10}" for at in r["by_gpus"])  # fmt: skip
        )
    for sc in result.get("simulated", []):
        lines.append(f"SIMULATED {sc['preset']}/{sc['hardware']} {sc['gpus']} GPUs, iteration {sc['iteration_s']:.2f} s, MTBF {sc['mtbf_h']:.2f} h")  # fmt: skip
        for r in sc["modes"]:
            held = " (measured ratio held)" if r["overhead_source"].startswith("MEASURED") else ""
            lines.append(f"  {r['mode']:<14}{r['overhead_ratio']:8.4f}{_pct(r['efficiency']):>10}{held}")  # fmt: skip
    lines.append("assumed numbers: see --markdown or --json (assumptions)")
    return "\n".join(lines)


def command_line(a: Any) -> str:
    """The ``baft bench goodput`` command that reproduces ``a``."""
    import shlex

    words = ["baft", "bench", "goodput", "--overhead", a.overhead, "--recovery", a.recovery,
             "--gpus", a.gpus, "--mtbf-hours", f"{a.mtbf_hours:g}", "--mtbf-gpus", str(a.mtbf_gpus)]  # fmt: skip
    if a.no_sim:
        words.append("--no-sim")
    else:
        words += ["--preset", a.preset, "--hardware", a.hardware, "--redundancy", a.redundancy,
                  "--restart-s", f"{a.restart_s:g}", "--storage-gbps", f"{a.storage_gbps:g}"]  # fmt: skip
    return shlex.join(words)


def parse_gpus(text: str) -> list[int]:
    """``1024,4096,16384`` -> [1024, 4096, 16384] (ValueError names a bad entry)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: expected comma-separated GPU counts") from None
    if not out or min(out) < 1:
        raise ValueError(f"--gpus {text!r}: expected GPU counts >= 1")
    return out


def run_goodput(a: Any) -> int:
    """``baft bench goodput``: read the two JSONs, compute, print and write."""
    try:
        gpus = parse_gpus(a.gpus)
        overhead, recovery = load_json(Path(a.overhead)), load_json(Path(a.recovery))
        measured = measured_goodput(overhead, recovery, gpus=gpus, ref_mtbf_h=a.mtbf_hours, ref_gpus=a.mtbf_gpus)  # fmt: skip
        result: dict[str, Any] = {"measured": measured, "assumptions": assumptions(a)}
        if not a.no_sim:
            inputs = [ModeInputs(**{k: v for k, v in r.items() if k != "by_gpus"}) for r in measured["modes"]]  # fmt: skip
            result["simulated"] = simulated_goodput(
                inputs, gpus=gpus, preset=a.preset, hardware=a.hardware,
                redundancy=a.redundancy, restart_s=a.restart_s, storage_gbps=a.storage_gbps,
                ref_mtbf_h=a.mtbf_hours, ref_gpus=a.mtbf_gpus,
            )  # fmt: skip
    except (OSError, ValueError, KeyError) as exc:
        print(f"baft bench goodput: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if a.markdown:
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown).write_text(render_markdown(result, command_line(a)))
        print(f"[bench] wrote {a.markdown}", file=sys.stderr)
    print(json.dumps(result) if a.json else render_text(result))
    return 0


def add_parser(sub: Any) -> Any:
    """Register ``goodput`` on ``baft bench``'s subparsers."""
    import argparse

    p = sub.add_parser(
        "goodput",
        help="training efficiency per mode: measured overhead + recovery, an MTBF, simulated scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--overhead", required=True, metavar="FILE", help="`baft bench overhead --json` output (or a .raw.json)")  # fmt: skip
    add("--recovery", required=True, metavar="FILE", help="`baft bench recovery --json` output (or its results page)")  # fmt: skip
    add("--gpus", default="1024,4096,16384", help="cluster sizes (default %(default)s)")
    add("--mtbf-hours", type=float, default=LLAMA3_MTBF_HOURS, help="job MTBF at --mtbf-gpus (default %(default)s, Llama 3)")  # fmt: skip
    add("--mtbf-gpus", type=int, default=LLAMA3_GPUS, help="GPUs of that job (default %(default)s)")  # fmt: skip
    add("--preset", default="llama2-70b", help="simulated model (default %(default)s)")
    add("--hardware", default="h100", help="simulated accelerator (default %(default)s)")
    add("--redundancy", default="xor:2", help="simulated redundancy (default %(default)s)")
    add("--restart-s", type=float, default=60.0, help="simulated restart + rendezvous (default %(default)s)")  # fmt: skip
    add("--storage-gbps", type=float, default=0.5, help="simulated storage GB/s per GPU (default %(default)s)")  # fmt: skip
    add("--no-sim", action="store_true", help="measured rows only")
    add("--markdown", default="", metavar="FILE", help="write the results-page section here")
    add("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_goodput)
    return p
