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
import contextlib
import gc
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baft.plan.bounds import (
    Exposure,
    GroupKey,
    group_keys,
    groups_lower_bound,
    level_split,
    validate_inputs,
)
from baft.plan.cost import CostModel, cut_sizes, slot_bytes, tail_bytes
from baft.plan.render import ms, plan_reason
from baft.plan.sends import (
    RankScratch,
    copy_rank,
    new_rank,
    reserve_sends,
    send_key,
    send_spill_s,
    send_tasks,
)
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
    ``ValueError`` with the fix when the inputs disagree. Ranks with identical inputs
    share their task tuples and slot dicts: treat the plan as read-only.
    """
    with _gc_paused():
        return _plan(bubbles, layouts, cost, policy, transfers)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while planning.

    A 4096-rank plan allocates ~10^5 small objects and no reference cycles; the collector
    would scan the whole process heap (a training job's, here) several times over, which
    measured as more than half of the planner's time at 4096 ranks. Reference counting
    still frees everything; the previous GC state is restored on the way out.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _plan(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    cost: CostModel,
    policy: CheckpointPolicy,
    transfers: Transfers | None,
) -> CheckpointPlan:
    groups = validate_inputs(bubbles, layouts, transfers)
    keys = group_keys(groups, bubbles, layouts, transfers)
    interval = policy.every
    built = _build(bubbles, layouts, groups, keys, cost, policy, interval)
    note = ""
    if policy.on_overflow == "stretch":
        interval, built, note = _stretch(bubbles, layouts, groups, keys, cost, policy, built)
    ranks = {
        r: RankPlan(
            rank=r,
            owned=p.chunks,
            owned_start=p.start,
            owned_stop=p.stop,
            tasks=p.tasks,
            spilled=p.spilled,
            exposed_s=p.exposure_s / interval,
            peers=tuple(peer for peer, _ in transfers.get(r, ())) if transfers else (),
        )
        for r, p in sorted(built.items())
    }
    exposed = max((rp.exposed_s for rp in ranks.values()), default=0.0)
    bound = groups_lower_bound(
        bubbles, layouts, groups, cost, policy, transfers, interval, keys=keys
    )
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
    cap_of: dict[int, int] = {}  # slots key -> snapshot bytes the slots hold
    memo: dict[GroupKey, list[int]] = {}
    groups = validate_inputs(bubbles, layouts)
    for group, key in zip(groups, group_keys(groups, bubbles, layouts, None), strict=True):
        shares = memo.get(key)
        if shares is None:
            for r, (k, _) in zip(group, key[1], strict=True):
                if k not in cap_of:
                    cap_of[k] = _capacity_bytes(new_rank(bubbles[r], policy), cost, policy)
            caps = [cap_of[k] for k, _ in key[1]]
            shares = _shares(layouts[group[0]], caps, [0.0] * len(group), cost, policy)
            memo[key] = shares
        start = 0
        for r, share in zip(group, shares, strict=True):
            out[r] = (start, start + share)
            start += share
    return out


def _shares(
    layout: StateLayout,
    caps: Sequence[int],
    fixed: Sequence[float],
    cost: CostModel,
    policy: CheckpointPolicy,
) -> list[int]:
    """Bytes each replica owns: balanced by bubble capacity ``caps`` (bytes) and already
    exposed seconds ``fixed``, then snapped to tensor edges if asked."""
    shares = split_bytes(layout.nbytes, caps, fixed, cost, policy)
    if policy.align_to_tensors:
        shares = snap_to_tensors(shares, layout)
    return shares


@dataclass(frozen=True, slots=True)
class _Placed:
    """One rank's finished work for one checkpoint; identical ranks share one."""

    tasks: dict[str, tuple[Task, ...]]
    spilled: tuple[Task, ...]
    chunks: tuple[Chunk, ...]
    start: int
    stop: int
    exposure_s: float
    """Exposed seconds per checkpoint (spill + interference)."""


_Built = dict[int, _Placed]


def _build(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    groups: Sequence[tuple[int, ...]],
    keys: Sequence[GroupKey],
    cost: CostModel,
    policy: CheckpointPolicy,
    interval: int,
) -> _Built:
    """Place every rank's work for one checkpoint at the given interval.

    At cluster scale most replica groups are identical (every tp rank of a pp stage has
    the same bubbles, layout and send sizes; SENDs name their peer by stream index):
    each distinct group (``keys``) is planned once and its results are shared, so 4096
    ranks cost little more than the handful of distinct stages.
    """
    memo: dict[GroupKey, list[_Placed]] = {}
    out: _Built = {}
    for group, key in zip(groups, keys, strict=True):
        placed = memo.get(key)
        if placed is None:
            members = [bubbles[r] for r in group]
            placed = memo[key] = _place_group(
                members, layouts[group[0]], key[1], cost, policy, interval
            )
        out.update(zip(group, placed, strict=True))
    return out


def _place_group(
    bubbles: Sequence[BubbleMap],
    layout: StateLayout,
    members: Sequence[tuple[int, tuple[int, ...]]],
    cost: CostModel,
    policy: CheckpointPolicy,
    interval: int,
) -> list[_Placed]:
    """Split, chunk and place one replica group's snapshot work, then its SENDs.

    ``members``: per member (slots key, send sizes) from its ``GroupKey``; members with
    equal ones get their slot reservations and capacities computed once."""
    protos: dict[tuple[int, tuple[int, ...]], tuple[RankScratch, int, float]] = {}
    works: list[RankScratch] = []
    caps: list[int] = []
    fixed: list[float] = []
    for b, mkey in zip(bubbles, members, strict=True):
        sizes = mkey[1]
        proto = protos.get(mkey)
        if proto is None:
            w = new_rank(b, policy)
            if interval == 1:
                reserve_sends(w, sizes, cost, policy)
            proto = protos[mkey] = (w, _capacity_bytes(w, cost, policy), send_spill_s(w, cost))
        w, cap, spill_s = proto
        works.append(copy_rank(w))
        caps.append(cap)
        fixed.append(spill_s)
    shares = _shares(layout, caps, fixed, cost, policy)
    out: list[_Placed] = []
    start = next_id = 0
    # Replicas with the same bubbles and shares send the same pieces: place them once.
    sends_memo: dict[tuple[Any, ...], list[tuple[int, Task]]] = {}
    for w, share, (_, sizes) in zip(works, shares, members, strict=True):
        chunks = _place_snapshots(w, start, start + share, next_id, cost.copy_Bps, cost, policy)
        sends = sends_memo.get(key := send_key(w, sizes, interval))
        if sends is None:
            sends = sends_memo[key] = send_tasks(w, sizes, cost, policy, interval)
        for j, task in sends:
            (w.spilled if j < 0 else w.slot_tasks[j]).append(task)
        in_bubble = sum(t.est_s for ts in w.slot_tasks for t in ts if t.kind is TaskKind.SNAPSHOT)
        out.append(
            _Placed(
                tasks={
                    sid: tuple(ts) for sid, ts in zip(w.slot_ids, w.slot_tasks, strict=True) if ts
                },
                spilled=tuple(w.spilled),
                chunks=chunks,
                start=start,
                stop=start + share,
                exposure_s=sum(t.est_s for t in w.spilled) + cost.interference * in_bubble,
            )
        )
        next_id += len(chunks)
        start += share
    return out


def _capacity_bytes(w: RankScratch, cost: CostModel, policy: CheckpointPolicy) -> int:
    """Snapshot bytes this rank's remaining slot time can hold."""
    o, mx, mn = cost.task_overhead_s, policy.max_chunk_bytes, policy.min_chunk_bytes
    return sum(slot_bytes(c, cost.copy_Bps, o, mx, mn) for c in w.cap)


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
    w: RankScratch,
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
        0,
        0,
        start,
    )


def _stretch(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    groups: Sequence[tuple[int, ...]],
    keys: Sequence[GroupKey],
    cost: CostModel,
    policy: CheckpointPolicy,
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
    worst = max((p.exposure_s for p in built.values()), default=0.0)
    if worst / policy.every <= target:
        return policy.every, built, ""
    if policy.every == 1:
        built = _build(bubbles, layouts, groups, keys, cost, policy, 2)
        worst = max((p.exposure_s for p in built.values()), default=0.0)
    interval = max(2, policy.every, math.ceil(worst / target - 1e-12))
    note = (
        f" (stretched from every {policy.every}: the bubbles cannot hold one checkpoint, "
        f"so {ms(worst)} of work per checkpoint is exposed; every {interval} iterations "
        f"keeps that at or below {policy.target_overhead:.1%} of the "
        f"{ms(iteration_s)} iteration)"
    )
    return interval, built, note
