"""Trace export: timelines -> Chrome/Perfetto JSON and a per-rank PNG (``baft trace``).

The JSON uses the Chrome trace event format ("X" complete events, microseconds) and
loads in https://ui.perfetto.dev and chrome://tracing: one process, and per rank one
track per category (step, compute, wait, ckpt) so checkpoint tasks that overlap a wait
stay visible; overlapping events of one category get extra tracks. The PNG has one row
per rank: compute and hatched waits on top, checkpoint tasks below (green inside a
bubble, red when exposed), with the time axis in milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baft.profile.bubbles import blocked_fraction
from baft.profile.timeline import Event, IterationRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Records = Mapping[int, Sequence[IterationRecord]]

LANES: tuple[str, ...] = ("step", "compute", "wait", "ckpt")
"""Per-rank track groups, top to bottom."""
_CNAME = {"compute": "thread_state_running", "wait": "grey", "step": "generic_work"}
_COLOR = {
    "compute": "#4C72B0",
    "wait": "#E4E4E4",
    "ckpt": "#55A868",
    "exposed": "#C44E52",
}


def event_label(event: Event) -> str:
    """Short display name: torch's action notation for compute ("1F0"), else name+slot."""
    if event.cat == "compute" and event.mb is not None:
        stage = "" if event.stage is None else str(event.stage)
        return f"{stage}{event.name}{event.mb}"
    if event.slot is not None:
        return f"{event.name} {event.slot}" + (" (exposed)" if event.exposed else "")
    return event.name


def select_range(
    records: Records, iterations: tuple[int, int] | None
) -> dict[int, list[IterationRecord]]:
    """Records with ``first <= iteration <= last`` (all when None); empty ranks dropped."""
    out: dict[int, list[IterationRecord]] = {}
    for rank, recs in sorted(records.items()):
        kept = [
            r for r in recs if iterations is None or iterations[0] <= r.iteration <= iterations[1]
        ]
        if kept:
            out[rank] = sorted(kept, key=lambda r: r.iteration)
    return out


def _pack(spans: list[tuple[float, float]]) -> list[int]:
    """Greedy lane per span (in the given order) so spans on one lane never overlap."""
    lane_end: list[float] = []
    lanes: list[int] = []
    for start, end in spans:
        for i, last_end in enumerate(lane_end):
            if start >= last_end:
                lane_end[i] = end
                lanes.append(i)
                break
        else:
            lane_end.append(end)
            lanes.append(len(lane_end) - 1)
    return lanes


def _tid(rank: int, lane_group: int, sub: int) -> int:
    return rank * 1000 + lane_group * 100 + sub


def _rank_events(
    rank: int, recs: Sequence[IterationRecord], origin: float
) -> tuple[list[dict[str, Any]], set[tuple[int, int]]]:
    """X events of one rank and the (lane group, sub-lane) pairs they use."""
    spans: dict[str, list[tuple[float, float, dict[str, Any]]]] = {k: [] for k in LANES}
    for rec in recs:
        base = (rec.t0 - origin) * 1e6
        step: dict[str, Any] = {
            "name": f"iteration {rec.iteration}",
            "cat": "step",
            "args": {"iteration": rec.iteration, "iter_s": rec.iter_s},
        }
        spans["step"].append((base, base + rec.iter_s * 1e6, step))
        for ev in rec.events:
            args: dict[str, Any] = {"iteration": rec.iteration}
            for key in ("stage", "mb", "slot", "kind", "nbytes", "exposed"):
                value = getattr(ev, key)
                if value is not None:
                    args["bytes" if key == "nbytes" else key] = value
            item: dict[str, Any] = {"name": event_label(ev), "cat": ev.cat, "args": args}
            if ev.cat == "ckpt":
                item["cname"] = "terrible" if ev.exposed else "good"
            lane = ev.cat if ev.cat in spans else "compute"
            spans[lane].append((base + ev.start * 1e6, base + ev.end * 1e6, item))
    events: list[dict[str, Any]] = []
    used: set[tuple[int, int]] = set()
    for group, lane in enumerate(LANES):
        ordered = sorted(spans[lane], key=lambda s: (s[0], s[1]))
        for (start, end, item), sub in zip(
            ordered, _pack([(s, e) for s, e, _ in ordered]), strict=True
        ):
            used.add((group, sub))
            item.setdefault("cname", _CNAME.get(lane, "generic_work"))
            item.update(
                ph="X",
                pid=0,
                tid=_tid(rank, group, sub),
                ts=round(start, 3),
                dur=round(max(0.0, round(end, 3) - round(start, 3)), 3),
            )
            events.append(item)
    return events, used


def chrome_trace(records: Records) -> dict[str, Any]:
    """Chrome trace event JSON (a dict; ``json.dump`` it) of all given records.

    Times are microseconds since the earliest ``t0``; ``pid`` is 0; each rank has tracks
    named "rank R step/compute/wait/ckpt" (extra ones numbered when events overlap).
    """
    t0s = [r.t0 for recs in records.values() for r in recs]
    origin = min(t0s) if t0s else 0.0
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "baft"}}
    ]
    body: list[dict[str, Any]] = []
    for rank, recs in sorted(records.items()):
        events, used = _rank_events(rank, recs, origin)
        body.extend(events)
        for group, sub in sorted(used):
            tid = _tid(rank, group, sub)
            name = f"rank {rank} {LANES[group]}" + (f" {sub + 1}" if sub else "")
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
            )
            meta.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": 0,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
    return {
        "traceEvents": meta + body,
        "displayTimeUnit": "ms",
        "otherData": {"origin_epoch_s": origin},
    }


def default_png_iterations(records: Records, *, count: int = 3) -> tuple[int, int]:
    """The last ``count`` iterations present (steady state, checkpointing on)."""
    its = sorted({r.iteration for recs in records.values() for r in recs})
    if not its:
        raise ValueError("no iterations recorded: nothing to draw")
    window = its[-count:]
    return window[0], window[-1]


def _draw_rank(
    ax: Axes, y: float, recs: Sequence[IterationRecord], origin: float, span_ms: float
) -> None:
    """One rank's row at height ``y``: compute/wait lane on top, ckpt lane below."""
    bars: dict[str, list[tuple[float, float]]] = {k: [] for k in _COLOR}
    labels: list[tuple[float, float, str]] = []
    for rec in recs:
        base = (rec.t0 - origin) * 1e3
        ax.plot([base, base], [y - 0.45, y + 0.45], color="black", lw=0.8)
        for ev in rec.events:
            x, w = base + ev.start * 1e3, ev.duration * 1e3
            key = (
                "exposed"
                if ev.cat == "ckpt" and ev.exposed
                else ev.cat
                if ev.cat in _COLOR
                else "compute"
            )
            bars[key].append((x, w))
            text = event_label(ev)
            # about 1500 px of plot width; a 6 pt character is about 6 px at 120 dpi
            if ev.cat == "compute" and w / span_ms * 1500 > 6 * len(text) + 4:
                labels.append((x + w / 2, y - 0.12, text))
    top, low = (y - 0.4, 0.55), (y + 0.2, 0.25)
    ax.broken_barh(
        bars["compute"], top, facecolors=_COLOR["compute"], edgecolor="white", linewidth=0.3
    )
    ax.broken_barh(
        bars["wait"],
        top,
        facecolors=_COLOR["wait"],
        edgecolor="#777777",
        hatch="////",
        linewidth=0.3,
    )
    ax.broken_barh(bars["ckpt"], low, facecolors=_COLOR["ckpt"], edgecolor="#2D6A3E", linewidth=0.3)
    ax.broken_barh(
        bars["exposed"], low, facecolors=_COLOR["exposed"], edgecolor="#7A2226", linewidth=0.3
    )
    for x, ty, text in labels:
        ax.text(x, ty, text, ha="center", va="center", fontsize=6, color="white", clip_on=True)


def _row_label(rank: int, recs: Sequence[IterationRecord], blocked: float) -> str:
    """ "rank 2 / stage 1 / 30% waiting" (stages as seen in the compute events)."""
    stages = sorted({e.stage for r in recs for e in r.events if e.stage is not None})
    where = f"\nstage {','.join(map(str, stages))}" if stages else ""
    return f"rank {rank}{where}\n{blocked:.0%} waiting"


def timeline_png(
    records: Records,
    path: str | Path,
    iterations: tuple[int, int] | None = None,
    *,
    title: str | None = None,
) -> Path:
    """Draw iterations ``first..last`` (inclusive; default: the last three) to a PNG.

    One row per rank, compute in blue, waits hatched grey, checkpoint tasks green when
    inside a bubble and red when exposed; time in ms from the earliest iteration start.
    Raises ``ValueError`` when no record falls in the range.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rng = iterations if iterations is not None else default_png_iterations(records)
    chosen = select_range(records, rng)
    if not chosen:
        raise ValueError(f"no iterations in {rng[0]}..{rng[1]}: pick a range the run recorded")
    origin = min(r.t0 for recs in chosen.values() for r in recs)
    end_ms = max((r.t0 - origin + r.iter_s) * 1e3 for recs in chosen.values() for r in recs)
    blocked = blocked_fraction(chosen, skip=0)
    fig = Figure(figsize=(14, 1.4 + 0.75 * len(chosen)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row, recs in enumerate(chosen.values()):
        _draw_rank(ax, row, recs, origin, end_ms)
    ax.set_yticks(range(len(chosen)))
    ax.set_yticklabels([_row_label(r, recs, blocked[r]) for r, recs in chosen.items()], fontsize=8)
    ax.set_ylim(len(chosen) - 0.45, -0.65)
    ax.set_xlim(0, end_ms * 1.005)
    ax.set_xlabel("time since first iteration start [ms]   (black ticks: iteration starts)")
    ax.grid(axis="x", color="#cccccc", lw=0.4)
    ax.set_axisbelow(True)
    its = sorted({r.iteration for recs in chosen.values() for r in recs})
    ax.set_title(title or f"baft timeline, iterations {its[0]}..{its[-1]}", fontsize=10)
    handles = [
        Patch(facecolor=_COLOR["compute"], label="compute (stage F/B mb)"),
        Patch(facecolor=_COLOR["wait"], edgecolor="#777777", hatch="////", label="wait (bubble)"),
        Patch(facecolor=_COLOR["ckpt"], label="checkpoint task in bubble"),
        Patch(facecolor=_COLOR["exposed"], label="checkpoint task exposed"),
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28 / (0.6 + 0.3 * len(chosen))),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


def write_trace(
    records: Records, out_dir: str | Path, iterations: tuple[int, int] | None = None
) -> tuple[Path, Path]:
    """Write ``out_dir/trace.json`` (every given record) and ``out_dir/timeline.png``
    (iterations ``first..last``, default the last three); returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "trace.json"
    with json_path.open("w", encoding="utf-8") as f:
        json.dump(chrome_trace(records), f)
    return json_path, timeline_png(records, out / "timeline.png", iterations)
