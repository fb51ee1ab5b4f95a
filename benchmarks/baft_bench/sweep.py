"""``baft bench sweep``: the overhead bench over a set of shapes, one folder, one summary page.

Each configuration is one ``baft bench overhead`` launch with every mode (its ``--modes``
default, or ``--modes`` as given here), run as a subprocess with ``--json``; its JSON goes
to ``OUT/<name>.json``, its log to ``OUT/<name>.log``, its results page and plot under
``OUT/<name>/``. ``OUT/sweep.md`` is the summary: configuration x mode, the paired wall
ratio against ``none`` (with its confidence interval when the JSON has ``ci_low`` /
``ci_high``), the differential window K the run chose (a mode's ``k`` when present) and
the state per rank. ``--dry-run`` prints the commands and runs nothing.

The default set (:data:`SWEEP`): state size (d_model 256, 512, 768 at 8 layers, pp=2
1F1B), pp=4, dp=2, interleaved-1F1B, ZBV and FSDP2 stages (pp=2 x dp_shard=2; d_model 512). The default blocks are few
(``--blocks 4 --block-iters 2 --switch-iters 1 --warmup 1``) so the whole set fits about
30 minutes on a 2-core machine; a reportable run takes ``--blocks 8 --block-iters 4``
or more (about four times as long).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADLINE = "paired_wall_ratio_vs_none"
"""The ratio the summary shows (the overhead page's headline), with fallbacks."""
FALLBACK = ("wall_ratio_vs_none", "ratio_vs_none")


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """One launch of the sweep: a name and the overhead flags that differ from the base."""

    name: str
    what: str
    """What the configuration varies, in words."""
    flags: dict[str, str] = field(default_factory=dict)


BASE = {"--pp": "2", "--dp": "1", "--schedule": "1f1b", "--microbatches": "4", "--layers": "8", "--d-model": "512", "--batch": "4"}  # fmt: skip
"""The default shape of ``baft bench overhead`` every configuration starts from."""
SWEEP = (
    SweepConfig("size-256", "state size: d_model 256", {"--d-model": "256"}),
    SweepConfig("size-512", "state size: d_model 512 (the default shape)", {}),
    SweepConfig("size-768", "state size: d_model 768", {"--d-model": "768"}),
    SweepConfig("pp4", "pipeline depth 4", {"--pp": "4"}),
    SweepConfig(
        "dp2",
        "two data-parallel replicas (baft shards the snapshot)",
        {"--dp": "2", "--batch": "8"},
    ),  # fmt: skip
    SweepConfig(
        "interleaved", "interleaved 1F1B (smaller bubbles)", {"--schedule": "interleaved-1f1b"}
    ),  # fmt: skip
    SweepConfig("zbv", "zero-bubble V schedule", {"--schedule": "zbv"}),
    SweepConfig(
        "fsdp2",
        "FSDP2 stages: pp=2 x dp_shard=2 (each rank holds half its stage's state)",
        {"--dp-shard": "2", "--batch": "8"},
    ),  # fmt: skip
)
"""The default set of configurations."""
RUN_FLAGS = ("--blocks", "--block-iters", "--switch-iters", "--warmup", "--compute", "--modes", "--checkpoint", "--engine", "--emulated-ms", "--seed")  # fmt: skip
"""Flags of this command passed on to every launch when given."""


def launch_argv(cfg: SweepConfig, a: argparse.Namespace) -> list[str]:
    """The ``baft bench overhead`` words of one configuration (without the interpreter)."""
    flags = {**BASE, **cfg.flags}
    for flag in RUN_FLAGS:
        value = getattr(a, flag[2:].replace("-", "_"), None)
        if value not in (None, ""):
            flags[flag] = str(value)
    out = Path(a.out)
    flags["--out"] = str(Path(a.run_dir) / cfg.name)
    flags["--results-dir"] = str(out / cfg.name)
    flags["--timeout"] = f"{a.timeout:g}"
    return ["bench", "overhead", *(w for kv in flags.items() for w in kv), "--json"]


def selected(a: argparse.Namespace) -> list[SweepConfig]:
    """The configurations ``--only`` picks (all by default); ValueError names unknown ones."""
    if not a.only:
        return list(SWEEP)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    known = {c.name: c for c in SWEEP}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--only: unknown configuration(s) {unknown}; choose from {', '.join(known)}")  # fmt: skip
    return [known[n] for n in names]


def plan(a: argparse.Namespace) -> list[tuple[SweepConfig, list[str]]]:
    """Every configuration with its command words, in order."""
    return [(c, launch_argv(c, a)) for c in selected(a)]


def shown(words: list[str]) -> str:
    """A launch as a person types it."""
    return shlex.join(["baft", *words])


def run_one(cfg: SweepConfig, words: list[str], out: Path) -> dict[str, Any]:
    """Run one launch; its JSON to ``out/<name>.json``. Returns its entry of the index."""
    log = out / f"{cfg.name}.log"
    start = time.time()
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "baft.cli", *words], stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
    entry: dict[str, Any] = {"name": cfg.name, "what": cfg.what, "command": shown(words), "rc": proc.returncode, "seconds": round(time.time() - start, 1)}  # fmt: skip
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        entry["error"] = f"exit code {proc.returncode}, no JSON on stdout; see {log.name}"
        return entry
    (out / f"{cfg.name}.json").write_text(json.dumps(result) + "\n")
    entry["json"] = f"{cfg.name}.json"
    return entry


# ------------------------------------------------------------------ the page
def _ratio(m: dict[str, Any]) -> str:
    value = next((m[k] for k in (HEADLINE, *FALLBACK) if m.get(k) is not None), None)
    if value is None:
        return "-"
    text = f"{value:.3f}"
    if m.get("ci_low") is not None and m.get("ci_high") is not None:
        text += f" [{m['ci_low']:.3f}, {m['ci_high']:.3f}]"
    return text


def chosen_k(result: dict[str, Any]) -> str:
    """The differential window K each mode reports (``k``), e.g. ``baft 8``; ``-`` if none."""
    ks = [f"{name} {m['k']}" for name, m in result["modes"].items() if m.get("k") is not None]
    return ", ".join(ks) or "-"


def render_page(entries: list[dict[str, Any]], results: dict[str, dict[str, Any]], *, date: str, argv: str) -> str:  # fmt: skip
    """The summary page of a sweep from each launch's entry and JSON (pure)."""
    modes: list[str] = []
    for r in results.values():
        modes += [m for m in r["modes"] if m not in modes]
    ci = any(m.get("ci_low") is not None for r in results.values() for m in r["modes"].values())
    lines = [
        f"# Overhead sweep ({date})",
        "",
        f"- command: `{argv}`",
        f"- cells: {HEADLINE} (median over rounds of a block's wall time over the same "
        "round's `none` block)"
        + (", [ci_low, ci_high] its confidence interval" if ci else "")
        + "; K: the differential window each mode chose (`k` in its JSON)",
        "- every launch's own page, plot and raw samples are in the folder of its name; "
        "its JSON next to it",
        "",
        "| configuration | what | state MiB / rank | none wall ms | "
        + " | ".join(modes)
        + " | K |",
        "|---|---|---|---|" + "---|" * len(modes) + "---|",
    ]
    for e in entries:
        got = results.get(e["name"])
        if got is None:
            lines.append(f"| {e['name']} | {e['what']} | FAILED: {e.get('error', 'not run')} |")
            continue
        r = got
        state = ", ".join(f"{b / 2**20:.0f}" for b in r.get("state_bytes_per_rank", []))
        none = r["modes"].get("none", {})
        wall = none.get("wall_per_iter_s") or none.get("median_iter_s")
        cells = [_ratio(r["modes"][m]) if m in r["modes"] else "-" for m in modes]
        lines.append(
            f"| [{e['name']}]({e['name']}/) | {e['what']} | {state} | "
            f"{'-' if wall is None else f'{wall * 1e3:.0f}'} | "
            + " | ".join(cells)
            + f" | {chosen_k(r)} |"
        )
    lines += ["", "Commands (one launch each):", "", "```bash"]
    lines += [e["command"] for e in entries] + ["```", ""]
    skipped = {f"{e['name']}: {m}": why for e in entries for m, why in results.get(e["name"], {}).get("skipped", {}).items()}  # fmt: skip
    lines += [f"- skipped {k}: {v}" for k, v in skipped.items()]
    return "\n".join(lines) + "\n"


def run_sweep(a: argparse.Namespace) -> int:
    """``baft bench sweep``: print the plan (``--dry-run``) or run it and write the page."""
    try:
        launches = plan(a)
    except ValueError as exc:
        print(f"baft bench sweep: error: {exc}", file=sys.stderr)
        return 2
    if a.dry_run:
        for _, words in launches:
            print(shown(words))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    entries, results = [], {}
    for cfg, words in launches:
        print(f"[sweep] {cfg.name}: {shown(words)}", file=sys.stderr, flush=True)
        entry = run_one(cfg, words, out)
        entries.append(entry)
        if "json" in entry:
            results[cfg.name] = json.loads((out / entry["json"]).read_text())
        print(f"[sweep] {cfg.name}: {entry.get('error', 'ok')} ({entry['seconds']} s)", file=sys.stderr)  # fmt: skip
    (out / "sweep.json").write_text(json.dumps(entries, indent=1) + "\n")
    page = render_page(entries, results, date=dt.date.today().isoformat(), argv=command_line(a))
    (out / "sweep.md").write_text(page)
    print(f"[sweep] wrote {out / 'sweep.md'}", file=sys.stderr)
    return 0 if len(results) == len(entries) else 1


def command_line(a: argparse.Namespace) -> str:
    """The ``baft bench sweep`` command of ``a``."""
    words = ["baft", "bench", "sweep", "--out", a.out, "--run-dir", a.run_dir]
    for flag in ("--only", *RUN_FLAGS):
        value = getattr(a, flag[2:].replace("-", "_"), None)
        if value not in (None, ""):
            words += [flag, str(value)]
    return shlex.join(words + ["--timeout", f"{a.timeout:g}"])


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``sweep`` on ``baft bench``'s subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "sweep",
        help="the overhead bench over state sizes, pp=4, dp=2, interleaved, zbv and FSDP2 (pp=2 x dp_shard=2): one page",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--out", default=f"benchmarks/results/sweep-{dt.date.today().isoformat()}", help="folder of the JSONs, logs, pages and sweep.md (default %(default)s)")  # fmt: skip
    add("--run-dir", default="runs/bench-sweep", help="run directories of the launches (default %(default)s)")  # fmt: skip
    add("--only", default="", metavar="NAMES", help=f"comma-separated subset of {', '.join(c.name for c in SWEEP)}")  # fmt: skip
    add("--blocks", type=int, default=4, help="blocks per mode (default %(default)s; 8 for a reportable run)")  # fmt: skip
    add("--block-iters", type=int, default=2, help="iterations per block (default %(default)s; 4 for a reportable run)")  # fmt: skip
    add("--switch-iters", type=int, default=1, help="(default %(default)s)")
    add("--warmup", type=int, default=1, help="(default %(default)s)")
    add("--compute", choices=("real", "emulated"), default="real", help="(default %(default)s)")
    add("--emulated-ms", default="", help="passed on to every launch (one pair per stage: differs by shape)")  # fmt: skip
    add("--modes", default="", help="passed on (default: every installed mode)")
    add("--checkpoint", default="", help="passed on (default: the overhead bench's)")
    add("--engine", default="", help="passed on")
    add("--seed", type=int, default=None, help="passed on")
    add("--timeout", type=float, default=1200.0, help="per launch, seconds (default %(default)s)")
    add("--dry-run", action="store_true", help="print the commands, run nothing")
    p.set_defaults(func=run_sweep)
    return p
