"""Pure per-rank scratch state of the planner, and redundancy SEND placement.

With a checkpoint every iteration, SEND time is reserved from the end of the iteration
backwards before any snapshot is placed (``reserve_sends``), so sends run after the rank's
snapshots (lag 0) where possible and in the next iteration's bubbles (lag 1) otherwise;
with a longer interval they use the next iteration's bubbles freely (``send_tasks``).
Sends never use "collective" slots, where the network is busy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baft.plan.cost import CostModel, cut_sizes, slot_bytes, tail_bytes
from baft.plan.types import BubbleMap, CheckpointPolicy, Task, TaskKind

__all__ = [
    "RankScratch",
    "copy_rank",
    "new_rank",
    "reserve_sends",
    "send_key",
    "send_spill_s",
    "send_tasks",
]


@dataclass(slots=True)
class RankScratch:
    """Scratch state of one rank while planning."""

    rank: int
    slot_ids: tuple[str, ...]
    sendable: tuple[bool, ...]
    usable: tuple[float, ...]
    cap: list[float]
    slot_tasks: list[list[Task]] = field(default_factory=list)
    spilled: list[Task] = field(default_factory=list)
    sends: list[tuple[int, int, int, int]] = field(default_factory=list)
    """Reserved SEND pieces (slot index or -1 = spilled, stream, offset, nbytes)."""


def copy_rank(w: RankScratch) -> RankScratch:
    """A fresh scratch rank with ``w``'s slots, capacities and SEND reservations."""
    return RankScratch(
        rank=w.rank,
        slot_ids=w.slot_ids,
        sendable=w.sendable,
        usable=w.usable,
        cap=list(w.cap),
        slot_tasks=[[] for _ in w.slot_ids],
        sends=list(w.sends),
    )


def send_key(w: RankScratch, sizes: tuple[int, ...], interval: int) -> tuple[Any, ...]:
    """Everything ``send_tasks`` reads of ``w`` (after snapshot placement)."""
    filled = [j for j, ts in enumerate(w.slot_tasks) if ts]
    last_snap = filled[-1] if filled else 0
    if interval == 1:
        return (sizes, last_snap, bool(w.spilled), tuple(w.sends))
    return (sizes, last_snap, bool(w.spilled), tuple(w.cap), w.usable, w.sendable)


def new_rank(bubble: BubbleMap, policy: CheckpointPolicy) -> RankScratch:
    usable = tuple(max(0.0, s.idle_s - policy.spread_margin * s.spread_s) for s in bubble.slots)
    return RankScratch(
        rank=bubble.rank,
        slot_ids=tuple(s.slot_id for s in bubble.slots),
        sendable=tuple(s.kind != "collective" for s in bubble.slots),
        usable=usable,
        cap=list(usable),
        slot_tasks=[[] for _ in bubble.slots],
    )


def send_spill_s(w: RankScratch, cost: CostModel) -> float:
    """Seconds of reserved SEND work that found no slot (already known for interval 1)."""
    return sum(cost.seconds(TaskKind.SEND, n) for j, _, _, n in w.sends if j < 0)


def _fill_stream(
    cap: list[float],
    order: Sequence[int],
    nbytes: int,
    cost: CostModel,
    policy: CheckpointPolicy,
) -> list[tuple[int, int]]:
    """Take SEND bytes slot by slot in ``order``; returns (slot index, bytes) amounts."""
    o, mx, mn = cost.task_overhead_s, policy.max_chunk_bytes, policy.min_chunk_bytes
    rate = cost.net_Bps
    out: list[tuple[int, int]] = []
    left = nbytes
    for j in order:
        if left == 0:
            break
        room = slot_bytes(cap[j], rate, o, mx, mn)
        if room < left and left <= tail_bytes(cap[j], rate, o) and left <= mx:
            room = left
        take = min(room, left)
        if take:
            cap[j] -= sum(cost.seconds(TaskKind.SEND, s) for s in cut_sizes(take, mx, mn))
            out.append((j, take))
            left -= take
    if left:
        out.append((-1, left))
    return out


def reserve_sends(
    w: RankScratch, streams: Sequence[int], cost: CostModel, policy: CheckpointPolicy
) -> None:
    """Interval 1: reserve SEND time from the last sendable slot backwards."""
    order = [j for j in reversed(range(len(w.cap))) if w.sendable[j]]
    pieces: list[tuple[int, int, int, int]] = []
    for stream in reversed(range(len(streams))):
        amounts = _fill_stream(w.cap, order, streams[stream], cost, policy)
        offset = 0
        spill = [a for a in amounts if a[0] < 0]
        for j, take in sorted((a for a in amounts if a[0] >= 0), key=lambda a: a[0]) + spill:
            pieces.append((j, stream, offset, take))
            offset += take
    w.sends = sorted(pieces, key=lambda p: (p[1], p[2]))


def send_tasks(
    w: RankScratch,
    streams: Sequence[int],
    cost: CostModel,
    policy: CheckpointPolicy,
    interval: int,
) -> list[tuple[int, Task]]:
    """SEND reservations (interval 1) or fresh placements (interval >= 2) as (slot index
    or -1 = spilled, task). Uses ``w.cap`` up (interval >= 2); adds no tasks to ``w``."""
    if not streams:
        return []
    snap_slots = [j for j, ts in enumerate(w.slot_tasks) if ts]
    last_snap = snap_slots[-1] if snap_slots else 0
    snap_spilled = bool(w.spilled)
    placed: list[tuple[int, int, int, int, int]] = []  # slot, lag, stream, offset, nbytes
    if interval == 1:
        for j, stream, offset, take in w.sends:
            lag = 0 if j < 0 or (not snap_spilled and j >= last_snap) else 1
            placed.append((j, lag, stream, offset, take))
    else:
        after = [] if snap_spilled else [j for j in range(last_snap, len(w.cap)) if w.sendable[j]]
        fresh = list(w.usable)
        every = [j for j in range(len(w.cap)) if w.sendable[j]]
        for stream, nbytes in enumerate(streams):
            offset = 0
            for j, take in _fill_stream(w.cap, after, nbytes, cost, policy):
                if j < 0:
                    for j2, take2 in _fill_stream(fresh, every, take, cost, policy):
                        placed.append((j2, 1, stream, offset, take2))
                        offset += take2
                else:
                    placed.append((j, 0, stream, offset, take))
                    offset += take
    piece = 0
    mx, mn = policy.max_chunk_bytes, policy.min_chunk_bytes
    out: list[tuple[int, Task]] = []
    for j, lag, stream, offset, take in sorted(placed, key=lambda p: (p[2], p[3])):
        for size in cut_sizes(take, mx, mn):
            task = Task(
                kind=TaskKind.SEND,
                chunk_id=piece,
                nbytes=size,
                est_s=cost.seconds(TaskKind.SEND, size),
                lag=lag,
                stream=stream,
                offset=offset,
            )
            out.append((j, task))
            piece += 1
            offset += size
    return out
