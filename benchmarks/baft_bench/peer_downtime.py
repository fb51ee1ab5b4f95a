"""The peers' downtime rows from what their jobs logged (pure: records in, rows out).

The torchft and NVRx arms of ``baft bench recovery`` log one record per training-step
attempt of every process (:data:`ATTEMPT` keys), one per process start (``ready``) and one
per kill, sent from outside by the bench. From them, per kill, with the definition of
:mod:`baft_bench.downtime` (the fault to the first iteration completed after it):

- ``downtime_s``: the kill to the end of the first committed step that a live process
  *started* after the kill (a step in flight at the kill that still commits is no
  recovery);
- ``full_strength_s``: the kill to the end of the first committed step in which every
  replica took part again (torchft keeps training on the survivors meanwhile);
- ``lost_iterations``: work done again: the step attempts that live processes computed
  after the kill and threw away (not committed), plus the committed steps the job went
  back behind (the last step committed before the kill + 1 - the first step committed
  after it: 0 when the survivors go on, everything when the job starts over);
- ``dropped_batches``: steps committed after the kill with fewer replicas than the job
  has: the missing replicas' share of those global batches was never trained on (what
  torchft trades for not stopping);
- phases: ``detect`` (the kill to a survivor's failed attempt), ``restart`` (to the
  replacement process's start), ``ready`` (its start to its model and library built),
  ``restore`` (the state transfer it reported), ``rejoin`` (ready to its first committed
  step);
- ``survivors_replaced``: processes of other replicas than the killed one that started
  anew after the kill (their state went with the old process).
"""

from __future__ import annotations

import statistics
from typing import Any

ATTEMPT = ("pid", "replica", "step", "t0", "t1", "committed", "participants")
"""Keys of one step attempt: the process, its replica (DP rank), the step index it trained
(after a heal, the step it healed to), start and end (``time.time()``), whether the
step was committed (the optimizer stepped), how many replicas' gradients it averaged."""


def _window(kills: list[dict[str, Any]], i: int) -> tuple[float, float]:
    t = float(kills[i]["t"])
    end = float(kills[i + 1]["t"]) if i + 1 < len(kills) else float("inf")
    return t, end


def failure(
    kills: list[dict[str, Any]],
    i: int,
    attempts: list[dict[str, Any]],
    ready: list[dict[str, Any]],
    replicas: int,
) -> dict[str, Any]:
    """Kill ``i``'s measures, from the records between it and the next kill."""
    t_kill, t_next = _window(kills, i)
    dead = kills[i]["pid"]
    live = [a for a in attempts if a["pid"] != dead and t_kill <= a["t1"] < t_next]
    after = sorted((a for a in live if a["t0"] >= t_kill and a["committed"]), key=lambda a: a["t1"])
    if not after:
        raise ValueError(f"kill {i} (pid {dead}): no committed step after it")
    first = after[0]
    full = next((a for a in after if a["participants"] >= replicas), None)
    end = full["t1"] if full is not None else t_next
    failed = sorted(
        (a for a in live if not a["committed"] and a["t1"] <= end), key=lambda a: a["t1"]
    )
    before = [a["step"] for a in attempts if a["committed"] and a["t1"] < t_kill]
    undone = max(0, (max(before) + 1 if before else 0) - first["step"])
    committed_steps = {a["step"]: a["participants"] for a in after if a["t1"] <= end}
    dropped = sum(1 for n in committed_steps.values() if n < replicas)
    old_pids = {a["pid"] for a in attempts if a["t1"] < t_kill}
    phases: dict[str, float] = {}
    if failed:
        phases["detect"] = failed[0]["t1"] - t_kill
    new = sorted((r for r in ready if t_kill <= r["t_start"] < t_next), key=lambda r: r["t_start"])
    replaced = {
        r["pid"] for r in new if r["replica"] != kills[i]["replica"] and r["pid"] not in old_pids
    }
    if new:
        r = new[0]
        phases["restart"] = r["t_start"] - t_kill
        phases["ready"] = r["t_ready"] - r["t_start"]
        mine = [a for a in after if a["pid"] == r["pid"]]
        if r.get("restore_s") is not None:
            phases["restore"] = float(r["restore_s"])
        if mine:
            phases["rejoin"] = mine[0]["t1"] - r["t_ready"]
    return {
        "fault": f"kill -9 replica {kills[i]['replica']} (pid {dead}) at step {kills[i]['step']}",
        "downtime_s": first["t1"] - t_kill,
        "full_strength_s": None if full is None else full["t1"] - t_kill,
        "lost_iterations": undone + len(failed),
        "dropped_batches": dropped,
        "survivors_replaced": len(replaced),
        "seconds": phases,
    }


def failures(
    kills: list[dict[str, Any]],
    attempts: list[dict[str, Any]],
    ready: list[dict[str, Any]],
    replicas: int,
) -> list[dict[str, Any]]:
    kills = sorted(kills, key=lambda k: k["t"])
    return [failure(kills, i, attempts, ready, replicas) for i in range(len(kills))]


def row(scenario: str, mode: str, recs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A downtime row shaped like :func:`baft_bench.downtime._row`'s, plus the peers'
    ``full_strength_s`` and ``dropped_batches`` and whatever ``extra`` says (the final
    state's comparison, the configuration)."""
    down = [r["downtime_s"] for r in recs]
    phases: dict[str, list[float]] = {}
    for r in recs:
        for k, v in r["seconds"].items():
            phases.setdefault(k, []).append(v)
    full = [r["full_strength_s"] for r in recs if r["full_strength_s"] is not None]
    return {
        "scenario": scenario,
        "mode": mode,
        "failures": len(recs),
        "downtime_median_s": statistics.median(down),
        "downtime_min_s": min(down),
        "downtime_max_s": max(down),
        "downtime_s": down,
        "faults": [r["fault"] for r in recs],
        "restore_median_s": statistics.median(phases["restore"]) if "restore" in phases else 0.0,
        "lost_iterations": [r["lost_iterations"] for r in recs],
        "sources": [],
        "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "phases_n": {k: len(v) for k, v in phases.items()},
        "full_strength_s": full,
        "full_strength_median_s": statistics.median(full) if full else None,
        "dropped_batches": [r["dropped_batches"] for r in recs],
        "survivors_replaced": [r["survivors_replaced"] for r in recs],
        **extra,
    }


def final_state(
    faulted: list[dict[str, Any]], reference: list[dict[str, Any]], diff: dict[str, float] | None
) -> dict[str, Any]:
    """The faulted job's final state against the failure-free job's (each a list of the
    replicas' ``{"replica", "step", "digest"}``); ``diff``: how far replica 0's model is
    from the reference's when they differ (max |a - b|, ||a - b|| / ||b||)."""
    ref = {f["digest"] for f in reference}
    got = {f["digest"] for f in faulted}
    return {
        "replicas_agree": len(got) == 1,
        "reference_replicas_agree": len(ref) == 1,
        "steps": sorted({f["step"] for f in faulted}),
        "reference_steps": sorted({f["step"] for f in reference}),
        "bit_identical": len(got) == 1 and got == ref,
        "digest": sorted(got),
        "reference_digest": sorted(ref),
        "model_diff": diff,
    }


def contributions(
    attempts: list[dict[str, Any]], replicas: int
) -> list[tuple[int, list[int], int]]:
    """Per committed step of a job whose replicas never go back (torchft's survivors):
    ``(step, replicas whose gradients were summed, divisor)``. The divisor is the
    manager's ``num_participants()``; when it is the whole job, every replica summed its
    gradient but those that logged ``participating: False`` (healing: torchft zeroes
    their gradient); otherwise only those that logged ``participating: True`` (a killed
    replica's last record may be missing, so it is not counted on its own word)."""
    by: dict[int, dict[str, Any]] = {}
    for a in attempts:
        if not a["committed"]:
            continue
        e = by.setdefault(a["step"], {"n": a["participants"], "in": set(), "out": set()})
        if e["n"] != a["participants"]:
            raise ValueError(f"step {a['step']}: replicas disagree on participants")
        if a["replica"] in e["in"] | e["out"]:
            raise ValueError(f"step {a['step']} committed twice by replica {a['replica']}: the job went back")  # fmt: skip
        e["in" if a.get("participating", True) else "out"].add(a["replica"])
    if sorted(by) != list(range(len(by))):
        raise ValueError("committed steps are not 0..n-1: the job went back")
    out = []
    for step in sorted(by):
        e = by[step]
        who = set(range(replicas)) - e["out"] if e["n"] == replicas else e["in"]
        out.append((step, sorted(who), e["n"]))
    return out
