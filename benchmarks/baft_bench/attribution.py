"""Where a mode's overhead goes, per rank: the attribution page's numbers (pure).

From one overhead bench result (``baft bench overhead --json``: every mode in one run,
per-rank means per iteration, :mod:`baft_bench.threads` for the per-thread times), a
mode's extra wall time per iteration over ``none`` on each rank splits into:

- ``main_cpu``: the training thread's own extra CPU (baft's hooks at slots, the version's
  start and commit, copies it runs inline);
- ``main_runq``: the training thread's extra run-queue delay (runnable, no core free:
  the wake-up latency other threads' work adds after each wait);
- ``exposed_wait``: the training thread waiting for checkpoint work at the optimizer step
  (the deadline wait for copies, the drain of the protect worker, receives not landed);
- ``pipeline_wait``: its extra waits in the pipeline (a slower neighbour stage);
- ``residual``: the rest (waits for the GIL, sleeps that overran; not measured directly).

Beside them, CPU the mode spends off the training thread: ``baft_threads`` (the protect
worker, the copy thread, the receive thread) and ``other_threads`` (gloo's transport and
device loops, torch's pool). The first four parts are measured; the page states how much
of the total they cover.
"""

from __future__ import annotations

from typing import Any

PARTS = ("main_cpu", "main_runq", "exposed_wait", "pipeline_wait", "residual")
DETAIL = ("main_sys",)
"""Inside ``main_cpu``: its kernel-mode share (system calls, softirqs charged to it)."""
BESIDE = ("baft_threads", "other_threads")


def attribute(result: dict[str, Any], mode: str, ref: str = "none") -> list[dict[str, float]]:
    """Per rank, milliseconds per iteration of ``mode``'s overhead over ``ref``."""
    a = result["modes"][mode]["per_rank_mean"]
    b = result["modes"][ref]["per_rank_mean"]

    def d(field: str, r: int) -> float:
        return (a[field][r] - b[field][r]) * 1e3

    rows = []
    for r in range(len(a["iter_s"])):
        total = d("iter_s", r)
        parts = {
            "main_cpu": d("main_cpu_s", r),
            "main_runq": d("main_runq_s", r),
            "exposed_wait": d("exposed_s", r),
            "pipeline_wait": d("blocked_s", r),
        }
        parts["residual"] = total - sum(parts.values())
        rows.append(
            {
                "rank": float(r),
                "overhead": total,
                **parts,
                "main_sys": d("main_sys_s", r) if "main_sys_s" in a else 0.0,
                "baft_threads": d("baft_cpu_s", r),
                "other_threads": d("other_cpu_s", r),
                "measured_share": (total - parts["residual"]) / total if total else 1.0,
            }
        )
    return rows


def markdown(result: dict[str, Any], modes: list[str], ref: str = "none") -> str:
    """One table row per (mode, rank): ms per iteration over ``ref``."""
    head = ["mode", "rank", "overhead", *PARTS, *DETAIL, *BESIDE, "measured share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in modes:
        for row in attribute(result, m, ref):
            cells = [m, str(int(row["rank"]))]
            cells += [f"{row[k]:+.1f}" for k in ("overhead", *PARTS, *DETAIL, *BESIDE)]
            cells.append(f"{row['measured_share']:.0%}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
