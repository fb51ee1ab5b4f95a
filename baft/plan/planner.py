"""Pure planner: bubbles + state layouts + cost model + policy -> CheckpointPlan.

Per DP replica group the flat state is split into contiguous owned ranges, balanced by
how many snapshot bytes each replica's bubbles can hold. Each owner cuts its range into
chunks that fit its slots (first fit, in iteration order); what fits nowhere is spilled
and runs right before the optimizer step. Redundancy SENDs take the bubble time left over
(never the "collective" slots, where the network is busy): with a checkpoint every
iteration they are reserved from the end of the iteration backwards, so they run after
the snapshots (lag 0) where possible and in the next iteration's bubbles (lag 1)
otherwise; with a longer interval they use the next iteration's bubbles freely.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from baft.plan.bounds import Exposure, groups_lower_bound, level_split, validate_inputs
from baft.plan.cost import CostModel, cut_sizes, slot_bytes, tail_bytes
from baft.plan.render import ms, plan_reason
from baft.plan.types import (
    BubbleMap,
    CheckpointPlan,
    CheckpointPolicy,
    Chunk,
    RankPlan,
    StateLayout,
    Task,
    TaskKind,
)

__all__ = ["owned_ranges", "plan", "split_bytes"]

Transfers = Mapping[int, Sequence[tuple[int, int]]]


@dataclass(slots=True)
class _Rank:
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
    exposure_s: float = 0.0
    """Exposed seconds per checkpoint (spill + interference)."""


def plan(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    cost: CostModel,
    policy: CheckpointPolicy,
    transfers: Transfers | None = None,
) -> CheckpointPlan:
    """Plan one checkpoint for every rank; see the module docstring for the method.

    ``transfers[rank]`` lists the redundancy bytes ``(peer, nbytes)`` the rank sends per
    checkpoint; a SEND reads only the rank's own snapshot of that version. Raises
    ``ValueError`` with the fix when the inputs disagree.
    """
    groups = validate_inputs(bubbles, layouts, transfers)
    interval = policy.every
    built = _build(bubbles, layouts, groups, cost, policy, transfers, interval)
    note = ""
    if policy.on_overflow == "stretch":
        interval, built, note = _stretch(bubbles, layouts, groups, cost, policy, transfers, built)
    ranks = {
        r: RankPlan(
            rank=r,
            owned=chunks,
            owned_start=start,
            owned_stop=stop,
            tasks={sid: tuple(ts) for sid, ts in zip(w.slot_ids, w.slot_tasks, strict=True) if ts},
            spilled=tuple(w.spilled),
            exposed_s=w.exposure_s / interval,
        )
        for r, (w, chunks, start, stop) in sorted(built.items())
    }
    exposed = max((rp.exposed_s for rp in ranks.values()), default=0.0)
    bound = groups_lower_bound(bubbles, layouts, groups, cost, policy, transfers, interval)
    reason = plan_reason(ranks, bubbles, layouts, groups, policy, interval, exposed, bound, note)
    return CheckpointPlan(
        ranks=ranks,
        interval_iters=interval,
        exposed_s=exposed,
        lower_bound_s=bound,
        reason=reason,
    )


def owned_ranges(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    cost: CostModel,
    policy: CheckpointPolicy,
) -> dict[int, tuple[int, int]]:
    """Each rank's owned byte range exactly as ``plan`` splits it without transfers (no
    chunking): the shard sizes to hand the coding module before planning its SENDs."""
    out: dict[int, tuple[int, int]] = {}
    for group in validate_inputs(bubbles, layouts):
        works = [_new_rank(bubbles[r], policy) for r in group]
        shares = _shares(layouts[group[0]], works, cost, policy)
        start = 0
        for r, share in zip(group, shares, strict=True):
            out[r] = (start, start + share)
            start += share
    return out


def _shares(
    layout: StateLayout, works: Sequence[_Rank], cost: CostModel, policy: CheckpointPolicy
) -> list[int]:
    """Bytes each replica owns: capacity-balanced, then snapped to tensor edges if asked."""
    caps = [_capacity_bytes(w, cost, policy) for w in works]
    fixed = [_send_spill_s(w, cost) for w in works]
    shares = split_bytes(layout.nbytes, caps, fixed, cost, policy)
    if policy.align_to_tensors:
        shares = snap_to_tensors(shares, layout)
    return shares


_Built = dict[int, tuple[_Rank, tuple[Chunk, ...], int, int]]
_Placed = tuple[list[float], list[list[Task]], list[Task], tuple[Chunk, ...]]
"""A rank's state right after snapshot placement: cap, slot tasks, spilled, chunks."""


def _build(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    groups: Sequence[tuple[int, ...]],
    cost: CostModel,
    policy: CheckpointPolicy,
    transfers: Transfers | None,
    interval: int,
) -> _Built:
    """Place every rank's work for one checkpoint at the given interval."""
    works = {r: _new_rank(bubbles[r], policy) for r in layouts}
    if interval == 1 and transfers:
        for r, pairs in transfers.items():
            _reserve_sends(works[r], [n for _, n in pairs], cost, policy)
    out: _Built = {}
    snap_rate = cost.copy_Bps
    # At cluster scale most replica groups are identical (same stage, same bubbles, same
    # layout: every tp rank of a pp stage): place each distinct group once, copy the rest.
    memo: dict[tuple[Any, ...], tuple[list[int], list[_Placed]]] = {}
    for group in groups:
        members = [works[r] for r in group]
        key = (
            layouts[group[0]].tensors,
            tuple(
                (w.slot_ids, tuple(w.cap), w.usable, w.sendable, tuple(w.sends)) for w in members
            ),
        )
        hit = memo.get(key)
        if hit is None:
            shares = _shares(layouts[group[0]], members, cost, policy)
            placed: list[_Placed] = []
            start = next_id = 0
            for w, share in zip(members, shares, strict=True):
                chunks = _place_snapshots(w, start, start + share, next_id, snap_rate, cost, policy)
                placed.append(
                    (list(w.cap), [list(ts) for ts in w.slot_tasks], list(w.spilled), chunks)
                )
                next_id += len(chunks)
                start += share
            memo[key] = (shares, placed)
        else:
            shares, placed = hit
            for w, (cap, slot_tasks, spilled, _) in zip(members, placed, strict=True):
                w.cap, w.spilled = list(cap), list(spilled)
                w.slot_tasks = [list(ts) for ts in slot_tasks]
        start = 0
        for r, share, (_, _, _, chunks) in zip(group, shares, placed, strict=True):
            out[r] = (works[r], chunks, start, start + share)
            start += share
    for r, (w, _, _, _) in out.items():
        pairs = list(transfers.get(r, ())) if transfers else []
        _finish_sends(w, [n for _, n in pairs], [p for p, _ in pairs], cost, policy, interval)
        in_bubble = sum(t.est_s for ts in w.slot_tasks for t in ts if t.kind is TaskKind.SNAPSHOT)
        w.exposure_s = sum(t.est_s for t in w.spilled) + cost.interference * in_bubble
    return out


def _new_rank(bubble: BubbleMap, policy: CheckpointPolicy) -> _Rank:
    usable = tuple(max(0.0, s.idle_s - policy.spread_margin * s.spread_s) for s in bubble.slots)
    return _Rank(
        rank=bubble.rank,
        slot_ids=tuple(s.slot_id for s in bubble.slots),
        sendable=tuple(s.kind != "collective" for s in bubble.slots),
        usable=usable,
        cap=list(usable),
        slot_tasks=[[] for _ in bubble.slots],
    )


def _capacity_bytes(w: _Rank, cost: CostModel, policy: CheckpointPolicy) -> int:
    """Snapshot bytes this rank's remaining slot time can hold."""
    o, mx, mn = cost.task_overhead_s, policy.max_chunk_bytes, policy.min_chunk_bytes
    return sum(slot_bytes(c, cost.copy_Bps, o, mx, mn) for c in w.cap)


def _send_spill_s(w: _Rank, cost: CostModel) -> float:
    """Seconds of reserved SEND work that found no slot (already known for interval 1)."""
    return sum(cost.seconds(TaskKind.SEND, n) for j, _, _, n in w.sends if j < 0)


def split_bytes(
    total: int,
    caps: Sequence[int],
    fixed_s: Sequence[float],
    cost: CostModel,
    policy: CheckpointPolicy,
) -> list[int]:
    """Split ``total`` bytes among replicas with bubble capacities ``caps`` (bytes) and
    already-exposed seconds ``fixed_s``, minimising the largest per-rank exposure.

    When everything fits and there is no interference, shares are proportional to the
    capacities; otherwise each rank's exposure ``fixed + i*a*min(x, cap) + a*max(0, x-cap)``
    (``a`` seconds per snapshot byte, ``i`` the interference) is levelled.
    """
    n = len(caps)
    cap_sum = sum(caps)
    if total == 0:
        return [0] * n
    if cost.interference == 0.0 and cap_sum >= total:
        shares = [total * c // cap_sum for c in caps]
        for k in range(n):
            if sum(shares) == total:
                break
            if shares[k] < caps[k]:
                shares[k] += 1
        assert sum(shares) == total
        return shares
    a = cost.per_byte_s(TaskKind.SNAPSHOT, policy.max_chunk_bytes)
    i = cost.interference
    curves = [
        Exposure(points=((0.0, e), (a * c, e + i * a * c)))
        for c, e in zip(caps, fixed_s, strict=True)
    ]
    _, ys = level_split(curves, a * total)
    shares = [min(total, math.floor(y / a)) for y in ys]
    _fix_sum(shares, total)
    return shares


def snap_to_tensors(shares: Sequence[int], layout: StateLayout) -> list[int]:
    """Move every boundary between DP owners to the nearest tensor boundary.

    Each owner then holds whole tensors: its shard can be read back as typed views
    (alignment) and persisted to DCP tensor by tensor without asking a peer for the rest
    of a tensor that straddles two shards. The cost is a little balance when tensors are
    large relative to a share; chunks inside a shard are still cut freely.
    """
    edges = [0]
    for t in layout.tensors:
        edges.append(edges[-1] + t.nbytes)
    out, prev, cut = [], 0, 0
    for share in shares[:-1]:
        cut += share
        k = bisect.bisect_left(edges, cut)
        candidates = [edges[j] for j in (k - 1, k) if 0 <= j < len(edges)]
        snapped = max(prev, min(candidates, key=lambda e: (abs(e - cut), e)))
        out.append(snapped - prev)
        prev = snapped
    out.append(edges[-1] - prev)
    return out


def _fix_sum(shares: list[int], total: int) -> None:
    """Make ``shares`` add up to ``total`` by small deterministic adjustments."""
    diff = sum(shares) - total
    order = sorted(range(len(shares)), key=lambda k: -shares[k])
    while diff > 0:
        for k in order:
            step = min(diff, shares[k], max(1, diff // len(shares)))
            shares[k] -= step
            diff -= step
            if diff == 0:
                break
    k = 0
    while diff < 0:
        step = max(1, -diff // len(shares))
        shares[order[k % len(order)]] += step
        diff += step
        k += 1


def _place_snapshots(
    w: _Rank,
    start: int,
    stop: int,
    first_id: int,
    rate: float,
    cost: CostModel,
    policy: CheckpointPolicy,
) -> tuple[Chunk, ...]:
    """First-fit the byte range into the rank's slots in order; spill the rest."""
    o, mx, mn = cost.task_overhead_s, policy.max_chunk_bytes, policy.min_chunk_bytes
    chunks: list[Chunk] = []
    pos = start
    for j, c in enumerate(w.cap):
        if pos >= stop:
            break
        left = stop - pos
        room = slot_bytes(c, rate, o, mx, mn)
        if room < left and left <= tail_bytes(c, rate, o) and left <= mx:
            room = left
        take = min(room, left)
        for size in cut_sizes(take, mx, mn):
            task = _snap_task(len(chunks) + first_id, pos, size, cost)
            chunks.append(Chunk(chunk_id=task.chunk_id, start=pos, stop=pos + size))
            w.slot_tasks[j].append(task)
            w.cap[j] -= task.est_s
            pos += size
    for size in cut_sizes(stop - pos, mx, mn):
        task = _snap_task(len(chunks) + first_id, pos, size, cost)
        chunks.append(Chunk(chunk_id=task.chunk_id, start=pos, stop=pos + size))
        w.spilled.append(task)
        pos += size
    assert pos == stop
    return tuple(chunks)


def _snap_task(chunk_id: int, start: int, size: int, cost: CostModel) -> Task:
    # same arithmetic as cost.seconds(SNAPSHOT, size), inlined: this runs per chunk
    return Task(
        TaskKind.SNAPSHOT,
        chunk_id,
        size,
        cost.task_overhead_s + size / cost.copy_Bps,
        None,
        0,
        0,
        start,
    )


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


def _reserve_sends(
    w: _Rank, streams: Sequence[int], cost: CostModel, policy: CheckpointPolicy
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


def _finish_sends(
    w: _Rank,
    streams: Sequence[int],
    peers: Sequence[int],
    cost: CostModel,
    policy: CheckpointPolicy,
    interval: int,
) -> None:
    """Turn SEND reservations (interval 1) or fresh placements (interval >= 2) into tasks."""
    if not streams:
        return
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
    for j, lag, stream, offset, take in sorted(placed, key=lambda p: (p[2], p[3])):
        for size in cut_sizes(take, mx, mn):
            task = Task(
                kind=TaskKind.SEND,
                chunk_id=piece,
                nbytes=size,
                est_s=cost.seconds(TaskKind.SEND, size),
                peer=peers[stream],
                lag=lag,
                stream=stream,
                offset=offset,
            )
            (w.spilled if j < 0 else w.slot_tasks[j]).append(task)
            piece += 1
            offset += size


def _stretch(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    groups: Sequence[tuple[int, ...]],
    cost: CostModel,
    policy: CheckpointPolicy,
    transfers: Transfers | None,
    built: _Built,
) -> tuple[int, _Built, str]:
    """Smallest interval >= policy.every whose exposed seconds per iteration are zero or
    at most ``target_overhead`` of the iteration."""
    iteration_s = max((b.iteration_s for b in bubbles.values()), default=0.0)
    if not iteration_s > 0.0:
        raise ValueError(
            "on_overflow='stretch' needs BubbleMap.iteration_s > 0 to size the interval; "
            "profile real iterations or use on_overflow='spill'"
        )
    target = policy.target_overhead * iteration_s
    worst = max((w.exposure_s for w, _, _, _ in built.values()), default=0.0)
    if worst / policy.every <= target:
        return policy.every, built, ""
    if policy.every == 1:
        built = _build(bubbles, layouts, groups, cost, policy, transfers, 2)
        worst = max((w.exposure_s for w, _, _, _ in built.values()), default=0.0)
    interval = max(2, policy.every, math.ceil(worst / target - 1e-12))
    note = (
        f" (stretched from every {policy.every}: the bubbles cannot hold one checkpoint, "
        f"so {ms(worst)} of work per checkpoint is exposed; every {interval} iterations "
        f"keeps that at or below {policy.target_overhead:.1%} of the "
        f"{ms(iteration_s)} iteration)"
    )
    return interval, built, note
