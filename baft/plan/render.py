"""Pure rendering of plans and bubble maps: a plain-text table and JSON-ready dicts.

``plan_table`` needs no terminal: per rank, one row per slot (idle, planned work, bytes,
what runs there) plus a spill row. ``plan_to_dict`` / ``bubbles_to_dict`` give plain
dicts for ``--json`` output.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from baft.plan.planner import fmt_bytes
from baft.plan.types import BubbleMap, CheckpointPlan, RankPlan, Task

__all__ = ["bubbles_to_dict", "plan_table", "plan_to_dict", "summarize_tasks"]


def summarize_tasks(tasks: Sequence[Task]) -> str:
    """E.g. "snapshot x3 (c4-c6), send x2 ->17 lag1"."""
    parts: list[str] = []
    groups: dict[tuple[str, int | None, int], list[Task]] = {}
    for t in tasks:
        groups.setdefault((t.kind.value, t.peer, t.lag), []).append(t)
    for (kind, peer, lag), ts in groups.items():
        text = f"{kind} x{len(ts)}"
        if kind == "snapshot":
            ids = [t.chunk_id for t in ts]
            text += f" (c{ids[0]})" if len(ids) == 1 else f" (c{min(ids)}-c{max(ids)})"
        if peer is not None:
            text += f" ->{peer}"
        if lag:
            text += f" lag{lag}"
        parts.append(text)
    return ", ".join(parts)


def _rank_rows(rp: RankPlan, bubble: BubbleMap, max_slots: int | None) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    slots = bubble.slots
    hidden = slots[max_slots:] if max_slots is not None and len(slots) > max_slots + 1 else ()
    if hidden:
        slots = slots[:max_slots]
    for slot in slots:
        tasks = rp.tasks.get(slot.slot_id, ())
        used = sum(t.est_s for t in tasks)
        rows.append(
            (
                slot.slot_id,
                slot.kind,
                f"{slot.idle_s * 1e3:.3f}",
                f"{used * 1e3:.3f}",
                fmt_bytes(sum(t.nbytes for t in tasks)) if tasks else "",
                summarize_tasks(tasks),
            )
        )
    if hidden:
        rest = [t for slot in hidden for t in rp.tasks.get(slot.slot_id, ())]
        rows.append(
            (
                f"+{len(hidden)} more",
                "",
                f"{sum(s.idle_s for s in hidden) * 1e3:.3f}",
                f"{sum(t.est_s for t in rest) * 1e3:.3f}",
                fmt_bytes(sum(t.nbytes for t in rest)) if rest else "",
                summarize_tasks(rest),
            )
        )
    spill_s = sum(t.est_s for t in rp.spilled)
    rows.append(
        (
            "spill",
            "sync",
            "",
            f"{spill_s * 1e3:.3f}",
            fmt_bytes(sum(t.nbytes for t in rp.spilled)) if rp.spilled else "",
            summarize_tasks(rp.spilled),
        )
    )
    return rows


def plan_table(
    plan: CheckpointPlan,
    bubbles: Mapping[int, BubbleMap],
    ranks: Iterable[int] | None = None,
    *,
    max_slots: int | None = 40,
) -> str:
    """Text table of the plan: per rank, per slot idle ms, planned ms, bytes, tasks, spill.

    Ranks with more than ``max_slots`` slots get one summary row for the rest."""
    chosen = sorted(plan.ranks) if ranks is None else list(ranks)
    header = ("slot", "kind", "idle ms", "work ms", "bytes", "tasks")
    lines = [
        f"checkpoint every {plan.interval_iters} iteration(s); predicted exposed "
        f"{plan.exposed_s * 1e3:.3f} ms/iter (lower bound {plan.lower_bound_s * 1e3:.3f} ms)"
    ]
    for r in chosen:
        rp = plan.ranks[r]
        rows = _rank_rows(rp, bubbles[r], max_slots)
        widths = [max(len(h), *(len(row[k]) for row in rows)) for k, h in enumerate(header)]
        owned = rp.owned_stop - rp.owned_start
        lines.append("")
        lines.append(
            f"rank {r}: owns bytes {rp.owned_start}..{rp.owned_stop} ({fmt_bytes(owned)}, "
            f"{len(rp.owned)} chunks); exposed {rp.exposed_s * 1e3:.3f} ms/iter"
        )
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for row in rows:
            cells = [
                c.rjust(w) if 2 <= k <= 4 else c.ljust(w)
                for k, (c, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _task_dict(t: Task) -> dict[str, Any]:
    return {
        "kind": t.kind.value,
        "chunk_id": t.chunk_id,
        "nbytes": t.nbytes,
        "est_s": t.est_s,
        "peer": t.peer,
        "lag": t.lag,
        "stream": t.stream,
        "offset": t.offset,
    }


def plan_to_dict(plan: CheckpointPlan) -> dict[str, Any]:
    """JSON-ready dict of a plan (rank keys become strings in JSON)."""
    return {
        "interval_iters": plan.interval_iters,
        "exposed_s": plan.exposed_s,
        "lower_bound_s": plan.lower_bound_s,
        "reason": plan.reason,
        "ranks": {
            str(r): {
                "owned_start": rp.owned_start,
                "owned_stop": rp.owned_stop,
                "owned": [[c.chunk_id, c.start, c.stop] for c in rp.owned],
                "tasks": {sid: [_task_dict(t) for t in ts] for sid, ts in rp.tasks.items()},
                "spilled": [_task_dict(t) for t in rp.spilled],
                "exposed_s": rp.exposed_s,
            }
            for r, rp in sorted(plan.ranks.items())
        },
    }


def bubbles_to_dict(bubbles: Mapping[int, BubbleMap]) -> dict[str, Any]:
    """JSON-ready dict of bubble maps."""
    return {
        str(r): {
            "iteration_s": b.iteration_s,
            "capacity_s": b.capacity_s(),
            "slots": [
                {"slot_id": s.slot_id, "idle_s": s.idle_s, "spread_s": s.spread_s, "kind": s.kind}
                for s in b.slots
            ],
        }
        for r, b in sorted(bubbles.items())
    }


def bubble_table(
    bubbles: Mapping[int, BubbleMap], ranks: Iterable[int] | None = None, *, max_slots: int = 12
) -> str:
    """One line per rank: iteration, total idle and the first slots' idle in ms."""
    chosen = sorted(bubbles) if ranks is None else list(ranks)
    lines = []
    for r in chosen:
        b = bubbles[r]
        busy = [s for s in b.slots if s.idle_s > 0]
        slots = " ".join(f"{s.slot_id}={s.idle_s * 1e3:.2f}" for s in busy[:max_slots])
        if len(busy) > max_slots:
            slots += f" ... (+{len(busy) - max_slots} more)"
        lines.append(
            f"rank {r}: iteration {b.iteration_s * 1e3:.1f} ms, idle {b.capacity_s() * 1e3:.1f} ms"
            f" in {sum(1 for s in b.slots if s.idle_s > 0)} slots: {slots or '(none)'}"
        )
    return "\n".join(lines)
