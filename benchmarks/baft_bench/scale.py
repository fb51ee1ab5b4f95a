"""``baft bench scale``: simulated (not measured) checkpoint cost on cluster presets.

Runs the pure simulator (``baft simulate``) on a few public model/cluster layouts and
writes one results page: per preset, the iteration time, bubble fraction, and for each
mode (baft = bubble-aware, naive-async, sync) the exposed share of the iteration, the
checkpoint interval and the expected work lost per failure, with every assumption.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from baft.plan.types import CheckpointPolicy
from baft.sim.command import evaluate
from baft.sim.presets import build_scenario

SCENARIOS = (
    ("llama2-34b", "h100", 512),
    ("llama2-70b", "h100", 1024),
    ("llama2-13b", "a100", 256),
    ("gpt3-175b", "h100", 4096),
    ("llama2-34b", "mi250x", 512),
)


def run_scale(a: Any) -> int:
    policy = CheckpointPolicy(redundancy=a.redundancy)
    results: list[dict[str, Any]] = []
    for preset, hw, gpus in SCENARIOS:
        scn = build_scenario(preset, hw, gpus)
        r = evaluate(
            scn,
            policy,
            mtbf_s=a.mtbf_hours * 3600,
            storage_Bps=a.storage_gbps * 1e9,
            restart_s=60.0,
        )
        results.append(r)
    text = _markdown(results, a)
    if a.json:
        print(json.dumps({"simulated": True, "results": results}))
    else:
        print(text)
    if not a.no_results:
        path = Path(a.results_dir) / f"scale-simulated-{dt.date.today().isoformat()}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"[bench] wrote {path}", file=sys.stderr)  # stdout stays one JSON object
    return 0


def _markdown(results: list[dict[str, Any]], a: Any) -> str:
    lines = [
        f"# SIMULATED checkpoint cost at cluster scale — {dt.date.today().isoformat()}",
        "",
        "Predictions of baft's discrete-event simulator, not measurements.",
        f"- command: `baft bench scale --redundancy {a.redundancy} --mtbf-hours {a.mtbf_hours} "
        f"--storage-gbps {a.storage_gbps}`",
        "",
        "| preset | hw | GPUs | dp/pp/tp | iteration (s) | bubble | mode | exposed | interval | lost per failure (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lay = r["layout"]
        for mode, m in r["modes"].items():
            lines.append(
                f"| {r['preset']} | {r['hardware']} | {r['gpus']} | {lay['dp']}/{lay['pp']}/{lay['tp']} | "
                f"{r['iteration_s']:.2f} | {r['bubble_fraction']:.1%} | {mode} | "
                f"{m['exposed_fraction']:.3%} | {m['interval_iters']} | {m['expected_lost_s']:.0f} |"
            )
    lines += [
        "",
        "Assumptions (first scenario; per-hardware constants in baft/sim/presets.py):",
        "```json",
        json.dumps(results[0]["assumptions"], indent=1),
        "```",
        "",
    ]
    return "\n".join(lines)
