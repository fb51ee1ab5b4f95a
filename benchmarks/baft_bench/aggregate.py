"""The overhead benchmark's numbers from its raw samples: pure functions, no processes.

The worker (:mod:`baft_bench.overhead`) records ``FIELDS`` per iteration and rank; here
they become per-mode medians, ratios against ``none`` (of medians and paired per round),
per-rank components, and the order of the modes in each round (:func:`block_order`).
"""

from __future__ import annotations

import statistics
from typing import Any

COMPONENTS = ("copy", "hash", "send", "pull", "recv_wait", "encode", "deadline_wait")
"""Protect components the engine times per version (``CheckpointEngine`` COMPONENTS)."""
PATH_BYTES = ("pull_bytes", "net_bytes")
"""Redundancy bytes a rank took in per iteration: from same-host stores, over the network."""
FIELDS = (
    "iter_s",
    "exposed_s",
    "in_bubble_s",
    "bytes",
    "cpu_s",
    "blocked_s",
    *(f"{c}_s" for c in COMPONENTS),
    *PATH_BYTES,
    "faults",
)
"""Per-iteration, per-rank values recorded for every mode: ``cpu_s`` is the process's CPU
seconds in the iteration (every thread), ``blocked_s`` the training thread's seconds in
pipeline waits (the idle time the pipeline offers), then protect seconds by component,
redundancy bytes per path and ``faults``, the process's minor page faults."""
PER_RANK = ("cpu_s", "blocked_s", *(f"{c}_s" for c in COMPONENTS), *PATH_BYTES, "faults")
"""Fields reported per rank (median over iterations)."""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize_mode(samples: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Numbers of one mode from per-iteration, per-rank samples (``FIELDS`` -> [iter][rank]).

    Iteration seconds and exposed seconds are the max over ranks (the slowest rank sets
    the pace), then the median over iterations; bytes are summed over ranks; the
    in-bubble fraction is in-bubble seconds over all checkpoint seconds, or None when the
    mode did no checkpoint work.
    """
    iter_s = [max(row) for row in samples["iter_s"]]
    exposed = [max(row) for row in samples["exposed_s"]]
    total_bubble = sum(sum(row) for row in samples["in_bubble_s"])
    total_exposed = sum(sum(row) for row in samples["exposed_s"])
    work = total_bubble + total_exposed
    q = statistics.quantiles(iter_s, n=4) if len(iter_s) >= 2 else [iter_s[0]] * 3
    return {
        "median_iter_s": _median(iter_s),
        "iqr_iter_s": q[2] - q[0],
        "exposed_s": _median(exposed),
        "in_bubble_fraction": total_bubble / work if work > 0 else None,
        "bytes_per_iter": _median([sum(row) for row in samples["bytes"]]),
        "bytes_per_rank": [_median(list(col)) for col in zip(*samples["bytes"], strict=True)],
        "num_iters": len(iter_s),
        "per_rank": {
            f: [_median(list(col)) for col in zip(*samples[f], strict=True)]
            for f in PER_RANK
            if samples.get(f)
        },
    }


def block_order(modes: list[str], block: int) -> list[str]:
    """The order of the modes in round ``block``: the rows of a Williams design (a Latin
    square balanced for carry-over), so that over ``n`` rounds (``2n`` for an odd number
    of modes) every mode follows every other one equally often. What a mode inherits from
    its predecessor (page cache, allocator state, a neighbour's leftover work) is then
    spread over all modes instead of always landing on the same one; a plain rotation
    keeps every mode behind the same predecessor."""
    n = len(modes)
    if n < 3:
        return modes[block % n :] + modes[: block % n] if n else []
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [r[::-1] for r in rows]
    return [modes[i] for i in rows[block % len(rows)]]


def block_medians(iter_s: list[list[float]], block_iters: int) -> list[float]:
    """Median iteration seconds (max over ranks) of each consecutive block."""
    per_iter = [max(row) for row in iter_s]
    return [
        statistics.median(per_iter[i : i + block_iters])
        for i in range(0, len(per_iter), block_iters)
    ]


def paired_ratio(mode: list[list[float]], none: list[list[float]], block_iters: int) -> float:
    """Median over blocks of (this mode's block median / the ``none`` block median of the
    same round): robust to load that drifts between rounds on a shared machine."""
    pairs = zip(block_medians(mode, block_iters), block_medians(none, block_iters), strict=True)
    return statistics.median(m / n for m, n in pairs)


def block_walls(iter_s: list[list[float]], block_iters: int) -> list[float]:
    """Wall seconds per iteration of each consecutive block: every rank runs a block's
    iterations back to back, so the sum of its iteration seconds is the block's wall time;
    the mean over ranks of that, over the block's iterations, is the pace training goes at.

    Unlike the median of the per-iteration max over ranks, it does not depend on where
    each rank's iteration boundary falls: pipelined ranks are coupled, and a mode that
    moves work from one iteration's end to the next's start (a commit, a wait for the
    previous stage) changes the per-iteration max without changing the throughput."""
    out = []
    for i in range(0, len(iter_s), block_iters):
        rows = iter_s[i : i + block_iters]
        per_rank = [sum(col) for col in zip(*rows, strict=True)]
        out.append(statistics.fmean(per_rank) / len(rows))
    return out


def throughput(
    mode: list[list[float]], none: list[list[float]], block_iters: int
) -> dict[str, float]:
    """Wall seconds per iteration (mean over the mode's blocks), its ratio to ``none``'s
    and the paired ratio (median over rounds of block wall over the same round's ``none``
    block wall)."""
    walls, ref = block_walls(mode, block_iters), block_walls(none, block_iters)
    return {
        "wall_per_iter_s": statistics.fmean(walls),
        "wall_ratio_vs_none": statistics.fmean(walls) / statistics.fmean(ref),
        "paired_wall_ratio_vs_none": statistics.median(
            m / n for m, n in zip(walls, ref, strict=True)
        ),
    }


def summarize(raw: dict[str, Any], machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The reported result (the ``--json`` object) from the worker's raw output."""
    modes = {name: summarize_mode(s) for name, s in raw["modes"].items()}
    ref = modes["none"]["median_iter_s"]
    none_iters = raw["modes"]["none"]["iter_s"]
    block_iters = raw["config"]["block_iters"]
    none_cpu = modes["none"]["per_rank"].get("cpu_s")
    for name, m in modes.items():
        cpu = m["per_rank"].get("cpu_s")
        if cpu and none_cpu:  # CPU the mode adds per rank and iteration, every thread
            m["per_rank"]["protect_cpu_s"] = [
                a - b for a, b in zip(cpu, none_cpu, strict=True) if a is not None and b is not None
            ]
        m["ratio_vs_none"] = m["median_iter_s"] / ref if ref else None
        m["paired_ratio_vs_none"] = paired_ratio(
            raw["modes"][name]["iter_s"], none_iters, block_iters
        )
        m.update(throughput(raw["modes"][name]["iter_s"], none_iters, block_iters))
    snapshot_s = max(raw["snapshot_s"])
    return {
        "sync_snapshot_fraction": snapshot_s / ref if ref else None,
        "compute": raw["config"]["compute"],
        "modes": modes,
        "skipped": raw.get("skipped", {}),
        "snapshot_s": snapshot_s,
        "state_bytes_per_rank": raw["state_bytes"],
        "emulated_times": raw.get("emulated_times"),
        "wall_s": raw.get("wall_s"),
        "config": raw["config"],
        "machine": machine or {},
    }
