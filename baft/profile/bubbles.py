"""Pure: measured timelines -> BubbleMap (expected idle seconds per slot and rank).

For each rank the chosen iterations (warm-up skipped) are reduced per slot id: the idle
time of a slot in one iteration is the time covered by its ``wait`` events plus any
in-bubble checkpoint task of that slot that ran just before the wait (0 when the slot did
not occur in that iteration); the slot's ``idle_s`` is the median over the iterations,
its ``spread_s`` half the p10..p90 range. Slots are ordered by their median
start time, and the map always ends with the ``pre_step`` slot (the window between the
last backward and the optimizer step; idle 0 unless the trainer measured a wait there).

No I/O, no torch: a function of the records only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from baft.plan.types import BubbleMap, Slot
from baft.profile.timeline import Event, IterationRecord

PRE_STEP = "pre_step"
"""Slot id of the window right before the optimizer step."""


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of a non-empty sequence."""
    assert values, "quantile of an empty sequence"
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the two middle values when even)."""
    return quantile(values, 0.5)


def select_iterations(
    records: Sequence[IterationRecord], *, skip: int = 1, last: int | None = None
) -> list[IterationRecord]:
    """Records in iteration order without the first ``skip``, then only the final ``last``.

    Raises ``ValueError`` with the fix when nothing is left.
    """
    if skip < 0:
        raise ValueError(f"skip={skip} must be >= 0 (number of warm-up iterations to drop)")
    if last is not None and last < 1:
        raise ValueError(f"last={last} must be >= 1 or None (use all remaining iterations)")
    chosen = sorted(records, key=lambda r: r.iteration)[skip:]
    if last is not None:
        chosen = chosen[-last:]
    if not chosen:
        raise ValueError(
            f"only {len(records)} iteration(s) recorded and skip={skip} drops them all: "
            "profile more iterations or lower skip"
        )
    return chosen


def _slot_kind(event: Event) -> str:
    if event.slot == PRE_STEP:
        return "pre_step"
    return event.kind or "p2p"


def _merged_length(spans: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of intervals."""
    ordered = sorted(spans)
    if not ordered:
        return 0.0
    total = 0.0
    cur_start, cur_end = ordered[0]
    for start, end in ordered[1:]:
        if start > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + cur_end - cur_start


def _slot_idle(events: Sequence[Event]) -> dict[str, tuple[float, float, str]]:
    """slot id -> (idle seconds, start, kind) in one iteration.

    Idle is the union of the slot's waits and its in-bubble checkpoint tasks, the tasks
    cut off at the end of the slot's last wait: tasks that ran in a background worker
    during the wait add nothing, tasks that ran right before the wait (and so shortened
    it) are given back, so a filled bubble still measures as a bubble.
    """
    waits: dict[str, list[Event]] = {}
    tasks: dict[str, list[Event]] = {}
    for ev in events:
        if ev.slot is not None and ev.cat == "wait":
            waits.setdefault(ev.slot, []).append(ev)
        elif ev.slot is not None and ev.cat == "ckpt" and ev.exposed is False:
            tasks.setdefault(ev.slot, []).append(ev)
    out: dict[str, tuple[float, float, str]] = {}
    for slot_id, slot_waits in waits.items():
        cap = max(w.end for w in slot_waits)
        spans = [(w.start, max(w.start, w.end)) for w in slot_waits]
        spans += [(t.start, min(t.end, cap)) for t in tasks.get(slot_id, ()) if t.start < cap]
        out[slot_id] = (_merged_length(spans), min(a for a, _ in spans), _slot_kind(slot_waits[0]))
    return out


def _slot_samples(
    chosen: Sequence[IterationRecord],
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, str]]:
    """Per slot: idle seconds per chosen iteration (0 where absent), starts where seen, kind."""
    idle: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for i, rec in enumerate(chosen):
        for slot_id, (seconds, start, kind) in _slot_idle(rec.events).items():
            idle.setdefault(slot_id, [0.0] * len(chosen))[i] = seconds
            starts.setdefault(slot_id, []).append(start)
            kinds.setdefault(slot_id, kind)
    return idle, starts, kinds


def bubble_map(
    rank: int, records: Sequence[IterationRecord], *, skip: int = 1, last: int | None = None
) -> BubbleMap:
    """The BubbleMap of one rank from its records (see the module docstring)."""
    chosen = select_iterations(records, skip=skip, last=last)
    idle, starts, kinds = _slot_samples(chosen)
    order = sorted((s for s in idle if s != PRE_STEP), key=lambda s: (median(starts[s]), s))
    slots = [
        Slot(
            slot_id=s,
            idle_s=median(idle[s]),
            spread_s=(quantile(idle[s], 0.9) - quantile(idle[s], 0.1)) / 2,
            kind=kinds[s],
        )
        for s in order
    ]
    pre = idle.get(PRE_STEP, [0.0] * len(chosen))
    slots.append(
        Slot(
            slot_id=PRE_STEP,
            idle_s=median(pre),
            spread_s=(quantile(pre, 0.9) - quantile(pre, 0.1)) / 2,
            kind="pre_step",
        )
    )
    return BubbleMap(rank=rank, slots=tuple(slots), iteration_s=median([r.iter_s for r in chosen]))


def bubble_maps(
    records: Mapping[int, Sequence[IterationRecord]], *, skip: int = 1, last: int | None = None
) -> dict[int, BubbleMap]:
    """rank -> BubbleMap over iterations ``skip..`` (only the final ``last`` if given).

    ``skip`` drops warm-up iterations (lowest iteration numbers first); ``last`` keeps
    only the most recent ``last`` of the remaining ones (None: all of them).
    """
    return {
        rank: bubble_map(rank, recs, skip=skip, last=last) for rank, recs in sorted(records.items())
    }


def blocked_fraction(
    records: Mapping[int, Sequence[IterationRecord]], *, skip: int = 1, last: int | None = None
) -> dict[int, float]:
    """rank -> share of iteration time spent blocked in waits (0..1), same selection.

    Overlapping wait events are counted once; the total is divided by the summed
    ``iter_s`` of the chosen iterations (0.0 when that sum is 0).
    """
    out: dict[int, float] = {}
    for rank, recs in sorted(records.items()):
        chosen = select_iterations(recs, skip=skip, last=last)
        blocked = sum(
            _merged_length(
                [(e.start, e.end) for e in r.events if e.cat == "wait" and e.end > e.start]
            )
            for r in chosen
        )
        total = sum(r.iter_s for r in chosen)
        out[rank] = blocked / total if total > 0 else 0.0
    return out
