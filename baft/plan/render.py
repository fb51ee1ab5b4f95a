"""Pure rendering of plans and bubble maps: a plain-text table and JSON-ready dicts.

``plan_table`` needs no terminal: per rank, one row per slot (idle, planned work, bytes,
what runs there) plus a spill row. ``plan_to_dict`` / ``bubbles_to_dict`` give plain
dicts for ``--json`` output.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from baft.plan.types import (
    BubbleMap,
    CheckpointPlan,
    CheckpointPolicy,
    RankPlan,
    StateLayout,
    Task,
    TaskKind,
)

__all__ = [
    "bubble_table",
    "bubbles_to_dict",
    "fmt_bytes",
    "ms",
    "plan_reason",
    "plan_table",
    "plan_to_dict",
    "summarize_tasks",
]


def _peer(t: Task, peers: Sequence[int]) -> int | None:
    """The rank a SEND goes to (None for other tasks or without ``peers``)."""
    return peers[t.stream] if t.kind is TaskKind.SEND and t.stream < len(peers) else None


def summarize_tasks(tasks: Sequence[Task], peers: Sequence[int] = ()) -> str:
    """E.g. "snapshot x3 (c4-c6), send x2 ->17 lag1" (``peers``: ``RankPlan.peers``)."""
    parts: list[str] = []
    groups: dict[tuple[str, int | None, int], list[Task]] = {}
    for t in tasks:
        groups.setdefault((t.kind.value, _peer(t, peers), t.lag), []).append(t)
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
                summarize_tasks(tasks, rp.peers),
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
                summarize_tasks(rest, rp.peers),
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
            summarize_tasks(rp.spilled, rp.peers),
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
        for row in [header, *rows]:
            cells = [
                c.rjust(w) if 2 <= k <= 4 else c.ljust(w)
                for k, (c, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _task_dict(t: Task, peers: Sequence[int]) -> dict[str, Any]:
    return {
        "kind": t.kind.value,
        "chunk_id": t.chunk_id,
        "nbytes": t.nbytes,
        "est_s": t.est_s,
        "peer": _peer(t, peers),
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
                "tasks": {
                    sid: [_task_dict(t, rp.peers) for t in ts] for sid, ts in rp.tasks.items()
                },
                "spilled": [_task_dict(t, rp.peers) for t in rp.spilled],
                "peers": list(rp.peers),
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


def ms(seconds: float) -> str:
    millis = seconds * 1e3
    return f"{millis:.0f} ms" if millis >= 100 else f"{millis:.3g} ms"


def fmt_bytes(n: int) -> str:
    """Human-readable byte count (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024.0 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def _rank_sentence(rp: RankPlan, bubble: BubbleMap) -> str:
    tasks = [t for ts in rp.tasks.values() for t in ts] + list(rp.spilled)
    snaps = [t for t in tasks if t.kind is TaskKind.SNAPSHOT]
    sends = [t for t in tasks if t.kind is TaskKind.SEND]
    spilled = sum(t.nbytes for t in rp.spilled)
    idle_slots = sum(1 for s in bubble.slots if s.idle_s > 0.0)
    text = (
        f"rank {rp.rank} has {ms(bubble.capacity_s())} of idle in {idle_slots} bubbles, "
        f"snapshots {fmt_bytes(sum(t.nbytes for t in snaps))} in {len(snaps)} chunks"
    )
    if sends:
        late = sum(1 for t in sends if t.lag)
        text += (
            f", sends {fmt_bytes(sum(t.nbytes for t in sends))} in {len(sends)} pieces "
            f"({late} in the next iteration)"
        )
    return text + f", spills {fmt_bytes(spilled)}"


def plan_reason(
    ranks: Mapping[int, RankPlan],
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    groups: Sequence[tuple[int, ...]],
    policy: CheckpointPolicy,
    interval: int,
    exposed: float,
    bound: float,
    note: str,
) -> str:
    """One paragraph: scale, interval, the busiest rank(s), prediction and caveats."""
    if not ranks:
        return "no ranks to plan."
    total = sum(layouts[g[0]].nbytes for g in groups)
    parts = [
        f"{len(ranks)} ranks in {len(groups)} DP replica groups ({fmt_bytes(total)} of state "
        f"in all); a checkpoint every {interval} iteration{'s' if interval > 1 else ''}{note}"
    ]
    if len(ranks) <= 4:
        parts += [_rank_sentence(rp, bubbles[r]) for r, rp in ranks.items()]
    else:
        busiest = max(ranks.values(), key=lambda rp: (rp.exposed_s, -rp.rank))
        parts.append("busiest " + _rank_sentence(busiest, bubbles[busiest.rank]))
    parts.append(f"predicted exposed {ms(exposed)} per iteration (lower bound {ms(bound)})")
    snap_total = sum(
        t.nbytes for rp in ranks.values() for t in rp.spilled if t.kind is TaskKind.SNAPSHOT
    )
    if total and snap_total:
        share = 1.0 - snap_total / total
        hint = (
            ""
            if policy.on_overflow == "stretch"
            else "; overflow=stretch lowers the frequency instead"
        )
        parts.append(
            f"the bubbles hold only {share:.0%} of the snapshot work, the rest runs before "
            f"the optimizer step{hint}"
        )
    if policy.persist_every:
        parts.append(
            f"every {policy.persist_every}th committed checkpoint is persisted in the "
            "background (not planned per slot)"
        )
    return "; ".join(parts) + "."
