"""The overhead benchmark's numbers from its raw samples: pure functions, no processes.

The worker (:mod:`baft_bench.overhead`) records ``FIELDS`` per iteration and rank; here
they become per-mode medians, ratios against ``none`` (of medians and paired per round),
per-rank components, and the order of the modes in each round (:func:`block_order`).
Every ratio comes with a bootstrap confidence interval over rounds
(:mod:`baft_bench.stats`); the rounds of several launches are pooled
(:func:`pool_launches`).
"""

from __future__ import annotations

import statistics
from typing import Any

from baft_bench.stats import (
    LEVEL,
    RESAMPLES,
    SEED,
    Statistic,
    bootstrap_ci,
    design_summary,
    inside_noise,
    median_of_ratios,
    ratio_of_means,
    ratio_of_medians,
    round_order,
)
from baft_bench.threads import FIELDS as THREAD_FIELDS

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
    "disk_saves",
    *THREAD_FIELDS,
)
"""Per-iteration, per-rank values recorded for every mode: ``cpu_s`` is the process's CPU
seconds in the iteration (every thread), ``blocked_s`` the training thread's seconds in
pipeline waits (the idle time the pipeline offers), then protect seconds by component,
redundancy bytes per path, ``faults``, the process's minor page faults, ``disk_saves``,
the disk checkpoints the mode started (baft-persist passes over a due version while its
previous save still writes), then the
CPU and run-queue seconds per thread group (:mod:`baft_bench.threads`)."""
PER_RANK = (
    "cpu_s",
    "blocked_s",
    *(f"{c}_s" for c in COMPONENTS),
    *PATH_BYTES,
    "faults",
    *THREAD_FIELDS,
)
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
        "disk_saves_per_iter": statistics.fmean(max(r) for r in samples["disk_saves"])
        if samples.get("disk_saves")
        else 0.0,
        "per_rank": {
            f: [_median(list(col)) for col in zip(*samples[f], strict=True)]
            for f in PER_RANK
            if samples.get(f)
        },
        "per_rank_mean": {  # means add up (the attribution's parts sum to its total)
            f: [statistics.fmean(col) for col in zip(*samples[f], strict=True)]
            for f in ("iter_s", "exposed_s", *PER_RANK)
            if samples.get(f)
        },
    }


def block_order(modes: list[str], block: int) -> list[str]:
    """The order of the modes in round ``block``: the rows of a Williams design (a Latin
    square balanced for carry-over, :func:`baft_bench.stats.williams_design`), so that over
    ``n`` rounds (``2n`` for an odd number of modes) every mode follows every other one
    equally often. What a mode inherits from its predecessor (page cache, allocator state,
    a neighbour's leftover work) is then spread over all modes instead of always landing
    on the same one; a plain rotation keeps every mode behind the same predecessor."""
    return round_order(modes, block)


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


EXTRA_MODE_KEYS = ("memory", "restores", "restores_detail", "transport", "k", "note")
"""Per-mode facts the worker may record next to the samples (memory per rank, whether the
newest checkpoint restores, the redundancy transport, the ``full_every`` chosen): passed
through to the result, merged over launches by :func:`merge_extra`."""
REFERENCES = ("none", "naive-async")
"""Modes every other mode's paired wall ratio is compared against, when they ran."""
RATIOS: dict[str, tuple[Statistic, str]] = {
    "ratio_vs_none": (ratio_of_medians, "iters"),
    "paired_ratio_vs_none": (median_of_ratios, "block_medians"),
    "wall_ratio_vs_none": (ratio_of_means, "walls"),
    "paired_wall_ratio_vs_none": (median_of_ratios, "walls"),
}
"""Each ratio against ``none``: its statistic over rounds and the per-round values it
takes (see :func:`per_round`)."""
HEADLINE = "paired_wall_ratio_vs_none"
"""The ratio the page leads with; its interval is also ``ci_low``/``ci_high``."""


def launch_rounds(raw: dict[str, Any]) -> int:
    """Rounds one launch's raw output holds (blocks of ``none``, the last one possibly
    short)."""
    return -(-len(raw["modes"]["none"]["iter_s"]) // raw["config"]["block_iters"])


def _merge_lists(values: list[Any]) -> Any:
    """Element-wise max of per-rank lists (None where every launch has None)."""
    if not all(isinstance(v, list) for v in values):
        return values[0]
    cols = zip(*values, strict=True)
    return [max((x for x in col if x is not None), default=None) for col in cols]


def merge_extra(key: str, values: list[Any]) -> Any:
    """One launch's value of ``key`` (:data:`EXTRA_MODE_KEYS`) from every launch's: the
    peak of memory per rank, ``no`` if any launch's checkpoint failed to restore, the one
    transport or K when the launches agree (else every launch's, ``/``-joined or listed)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    if key == "memory" and all(isinstance(v, dict) for v in values):
        names = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge_lists([v.get(k) for v in values]) for k in names}
    distinct = list(dict.fromkeys(str(v) for v in values))
    if len(distinct) == 1:
        return values[0]
    if key == "restores":
        return "no" if "no" in distinct else "/".join(distinct)
    return "/".join(distinct) if key == "transport" else values


def with_facts(raw: dict[str, Any]) -> dict[str, Any]:
    """One launch's raw output with the worker's ``mode_facts`` (transport, K, note,
    memory, restores: :mod:`baft_bench.facts`) moved next to each mode's samples."""
    facts = raw.get("mode_facts") or {}
    if not facts:
        return raw
    modes = {m: {**s, **(facts.get(m) or {})} for m, s in raw["modes"].items()}
    return {**raw, "modes": modes}


def pool_launches(raw: dict[str, Any]) -> dict[str, Any]:
    """One launch's raw output, with ``launch_rounds`` added; or several launches'
    (``{"config": ..., "launches": [raw, ...]}``) as one: the samples of every mode that
    ran in every launch, launch after launch (a mode missing from a launch goes to
    ``skipped``), ``launch_rounds`` the rounds per launch, per-rank snapshot seconds the
    median over launches, the extra per-mode facts merged (:func:`merge_extra`)."""
    launches = raw.get("launches")
    if not launches:
        return {**with_facts(raw), "launch_rounds": [launch_rounds(raw)]}
    launches = [with_facts(r) for r in launches]
    first = launches[0]
    names = [m for m in first["modes"] if all(m in r["modes"] for r in launches)]
    skipped: dict[str, str] = {}
    for r in launches:
        skipped.update(r.get("skipped", {}))
    for m in dict.fromkeys(m for r in launches for m in r["modes"]):
        if m not in names:
            skipped[m] = "not measured in every launch; left out of the pooled numbers"
    modes: dict[str, dict[str, Any]] = {}
    for m in names:
        per = [r["modes"][m] for r in launches]
        pooled: dict[str, Any] = {
            f: [row for p in per for row in p[f]] for f in FIELDS if all(f in p for p in per)
        }
        for key in EXTRA_MODE_KEYS:
            if any(key in p for p in per):
                pooled[key] = merge_extra(key, [p.get(key) for p in per])
        modes[m] = pooled
    snapshot = [
        statistics.median(col) for col in zip(*(r["snapshot_s"] for r in launches), strict=True)
    ]
    return {
        **{k: v for k, v in first.items() if k not in ("modes", "skipped", "snapshot_s")},
        "config": raw.get("config", first["config"]),
        "modes": modes,
        "skipped": skipped,
        "snapshot_s": snapshot,
        "wall_s": sum(r.get("wall_s") or 0.0 for r in launches),
        "launch_rounds": [launch_rounds(r) for r in launches],
        "launch_emulated_times": [r.get("emulated_times") for r in launches],
    }


def per_round(iter_s: list[list[float]], block_iters: int) -> dict[str, list[Any]]:
    """One mode's values per round: block walls (the pace, :func:`block_walls`), block
    medians (:func:`block_medians`) and the per-iteration max over ranks (``iters``, one
    list per round)."""
    per_iter = [max(row) for row in iter_s]
    return {
        "walls": block_walls(iter_s, block_iters),
        "block_medians": block_medians(iter_s, block_iters),
        "iters": [per_iter[i : i + block_iters] for i in range(0, len(per_iter), block_iters)],
    }


def _ci(stat: Statistic, num: list[Any], den: list[Any], strata: list[int]) -> list[float] | None:
    """[low, high] of ``stat`` over rounds; None when the rounds differ in length (a
    short last block: its iterations cannot be resampled as a block)."""
    if any(isinstance(x, list) for x in num) and len({len(x) for x in num + den}) > 1:
        return None
    low, high = bootstrap_ci(stat, num, den, strata=strata)
    return [low, high]


def ratio_intervals(
    mode: dict[str, list[Any]], none: dict[str, list[Any]], strata: list[int]
) -> dict[str, Any]:
    """Intervals of every ratio of :data:`RATIOS` (``ci``: name -> [low, high]); the
    headline's also as ``ci_low``/``ci_high`` with ``inside_noise_vs_none``."""
    ci = {name: _ci(stat, mode[key], none[key], strata) for name, (stat, key) in RATIOS.items()}
    low, high = ci[HEADLINE] or (None, None)
    return {
        "ci": ci,
        "ci_low": low,
        "ci_high": high,
        "inside_noise_vs_none": inside_noise(low, high),
    }


def versus(mode: list[float], ref: list[float], strata: list[int]) -> dict[str, Any]:
    """Paired wall ratio of a mode to another mode (median over rounds of the block walls'
    ratio), its interval and whether it is inside the noise."""
    low, high = _ci(median_of_ratios, mode, ref, strata) or (None, None)
    return {
        "paired_wall_ratio": statistics.median(m / r for m, r in zip(mode, ref, strict=True)),
        "ci_low": low,
        "ci_high": high,
        "inside_noise": inside_noise(low, high),
    }


def _per_launch(
    mode: dict[str, list[Any]], none: dict[str, list[Any]], strata: list[int]
) -> list[dict[str, Any]]:
    """The headline ratio and its interval within each launch."""
    out, start = [], 0
    for size in strata:
        walls, ref = mode["walls"][start : start + size], none["walls"][start : start + size]
        v = versus(walls, ref, [size])
        out.append({"rounds": size, HEADLINE: v["paired_wall_ratio"], "ci_low": v["ci_low"], "ci_high": v["ci_high"]})  # fmt: skip
        start += size
    return out


def summarize(raw: dict[str, Any], machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The reported result (the ``--json`` object) from the worker's raw output (one
    launch's, or several launches' pooled by :func:`pool_launches`)."""
    raw = pool_launches(raw)
    strata = raw["launch_rounds"]
    modes = {name: summarize_mode(s) for name, s in raw["modes"].items()}
    ref = modes["none"]["median_iter_s"]
    none_iters = raw["modes"]["none"]["iter_s"]
    block_iters = raw["config"]["block_iters"]
    rounds = {name: per_round(s["iter_s"], block_iters) for name, s in raw["modes"].items()}
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
        m.update(ratio_intervals(rounds[name], rounds["none"], strata))
        m["rounds"] = sum(strata)
        m["vs"] = {
            r: versus(rounds[name]["walls"], rounds[r]["walls"], strata)
            for r in REFERENCES
            if r in rounds and r != name
        }
        if len(strata) > 1:
            m["per_launch"] = _per_launch(rounds[name], rounds["none"], strata)
        for key in EXTRA_MODE_KEYS:
            if key in raw["modes"][name]:
                m[key] = raw["modes"][name][key]
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
        "launches": len(strata),
        "launch_rounds": strata,
        "design": design_summary(len(modes), strata[0]),
        "bootstrap": {
            "resamples": RESAMPLES,
            "seed": SEED,
            "level": LEVEL,
            "unit": "round",
            "strata": "launch",
        },  # fmt: skip
        "peer_versions": raw.get("peer_versions"),
        "memory_method": raw.get("memory_method"),
        "config": raw["config"],
        "machine": machine or {},
    }
