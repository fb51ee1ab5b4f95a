"""Pure lower bound on a plan's exposed seconds, and an exact solver for tiny instances.

The lower bound relaxes chunking away: work is fluid (seconds per byte = 1/throughput plus
the task overhead amortised over the largest chunk), bubbles are filled perfectly, and the
DP split is the best possible. Per rank the exposure is a piecewise-linear, non-decreasing
function of the snapshot seconds it takes on; the split levels the largest of them
(``level_split``). ``exact_exposed`` brute-forces chunk sizes, chunk -> slot assignments
and DP splits on a byte quantum, to check the planner on small instances.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from baft.plan.cost import CostModel
from baft.plan.types import BubbleMap, CheckpointPolicy, StateLayout, TaskKind

__all__ = [
    "Exposure",
    "Interner",
    "exact_exposed",
    "group_keys",
    "groups_lower_bound",
    "level_split",
    "lower_bound",
    "replica_groups",
    "validate_inputs",
]

Transfers = Mapping[int, Sequence[tuple[int, int]]]


class Interner:
    """Small int per distinct value, hashing each distinct object only once.

    Plans for 4096 ranks see a few distinct slot and tensor tuples, many times over (often
    the very same object): the id cache skips re-hashing 50 slots or 250 tensors per rank.
    Only for objects the caller keeps alive while the interner is in use (an id is reused
    after its object dies).
    """

    __slots__ = ("_by_id", "_by_value")

    def __init__(self) -> None:
        self._by_id: dict[int, int] = {}
        self._by_value: dict[object, int] = {}

    def __call__(self, obj: object) -> int:
        key = self._by_id.get(id(obj))
        if key is None:
            key = self._by_value.setdefault(obj, len(self._by_value))
            self._by_id[id(obj)] = key
        return key

    def __len__(self) -> int:
        """Distinct values seen so far."""
        return len(self._by_value)


GroupKey = tuple[int, tuple[tuple[int, tuple[int, ...]], ...]]
"""A replica group's planner inputs in short: (which tensor list, per member (which slots,
its send sizes)). Equal keys mean equal inputs, so equal plans and bounds."""


def group_keys(
    groups: Sequence[tuple[int, ...]],
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    transfers: Transfers | None,
) -> list[GroupKey]:
    """The key of each replica group (same order): at cluster scale a handful are
    distinct, so the planner and the bound work once per distinct group."""
    slots_key, tensors_key = Interner(), Interner()
    return [
        (
            tensors_key(layouts[group[0]].tensors),
            tuple(
                (
                    slots_key(bubbles[r].slots),
                    tuple(n for _, n in transfers.get(r, ())) if transfers else (),
                )
                for r in group
            ),
        )
        for group in groups
    ]


def validate_inputs(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    transfers: Transfers | None = None,
) -> list[tuple[int, ...]]:
    """Raise ``ValueError`` with the fix when bubbles, layouts and transfers disagree;
    return the replica groups."""
    missing = sorted(set(layouts) ^ set(bubbles))
    if missing:
        raise ValueError(
            f"ranks {missing[:8]} have a StateLayout or a BubbleMap but not both: "
            "give both for every rank"
        )
    checked = Interner()
    for r in layouts:
        if layouts[r].rank != r or bubbles[r].rank != r:
            raise ValueError(f"layouts[{r}] / bubbles[{r}] carry another rank: key them by rank")
        known = len(checked)
        if checked(bubbles[r].slots) < known:
            continue  # these slots were checked for an earlier rank
        seen: set[str] = set()
        for slot in bubbles[r].slots:
            if slot.slot_id in seen:
                raise ValueError(f"rank {r}: slot id {slot.slot_id!r} appears twice")
            seen.add(slot.slot_id)
            if not (0.0 <= slot.idle_s < math.inf and 0.0 <= slot.spread_s < math.inf):
                raise ValueError(
                    f"rank {r} slot {slot.slot_id!r}: idle_s={slot.idle_s}, "
                    f"spread_s={slot.spread_s} must be finite and >= 0"
                )
    groups = replica_groups(layouts)
    for r, streams in (transfers or {}).items():
        if r not in layouts:
            raise ValueError(f"transfers name rank {r}, which has no StateLayout")
        for peer, nbytes in streams:
            if nbytes < 0 or peer < 0:
                raise ValueError(f"rank {r}: transfer ({peer}, {nbytes}) needs peer, nbytes >= 0")
    return groups


def replica_groups(layouts: Mapping[int, StateLayout]) -> list[tuple[int, ...]]:
    """The DP replica groups (each ordered by dp), sorted by first member.

    Raises ``ValueError`` when replicas disagree about their group or state size.
    """
    groups: dict[tuple[int, ...], int] = {}
    sizes_of: dict[int, int] = {}  # id(tensors) -> nbytes; the layouts keep them alive
    for r, lay in layouts.items():
        group = tuple(lay.replicas)
        if r not in group:
            raise ValueError(f"rank {r}: replicas {group} must include the rank itself")
        if group in groups:
            continue
        sizes = set()
        for member in group:
            other = layouts.get(member)
            if other is None:
                raise ValueError(f"rank {r} lists replica {member}, which has no StateLayout")
            if tuple(other.replicas) != group:
                raise ValueError(
                    f"ranks {r} and {member} disagree about their replicas "
                    f"({group} vs {tuple(other.replicas)}): give every member the same tuple"
                )
            size = sizes_of.get(id(other.tensors))
            if size is None:
                size = sizes_of[id(other.tensors)] = other.nbytes
            sizes.add(size)
        if len(sizes) > 1:
            raise ValueError(
                f"replica group {group} has different state sizes {sorted(sizes)}: "
                "DP replicas must hold identical state"
            )
        groups[group] = 0
    return sorted(groups, key=lambda g: g[0])


@dataclass(frozen=True, slots=True)
class Exposure:
    """Non-decreasing piecewise-linear exposure g(y) of one rank, y = snapshot seconds.

    ``points`` are (y, g) with increasing y starting at 0; beyond the last point g grows
    with slope 1 (every further snapshot second is spilled).
    """

    points: tuple[tuple[float, float], ...]

    def at(self, y: float) -> float:
        pts = self.points
        for (y0, g0), (y1, g1) in itertools.pairwise(pts):
            if y <= y1:
                return g0 + (g1 - g0) * (y - y0) / (y1 - y0) if y1 > y0 else g1
        return pts[-1][1] + (y - pts[-1][0])

    def inverse(self, level: float) -> float:
        """Largest y with g(y) <= level (``level`` must be >= g(0))."""
        pts = self.points
        for (y0, g0), (y1, g1) in itertools.pairwise(pts):
            if level < g1:
                return y0 + (level - g0) * (y1 - y0) / (g1 - g0) if g1 > g0 else y0
        return pts[-1][0] + (level - pts[-1][1])


def level_split(curves: Sequence[Exposure], total: float) -> tuple[float, list[float]]:
    """Split ``total`` snapshot seconds over ranks minimising max g_r(y_r), y_r >= 0.

    Exact for piecewise-linear curves: the summed inverse is piecewise linear in the level
    between the curves' breakpoint levels. Returns (level, y per rank).
    """
    base = max(c.points[0][1] for c in curves)

    def supply(level: float) -> float:
        return sum(c.inverse(level) for c in curves)

    if supply(base) >= total:
        return base, [c.inverse(base) for c in curves]
    levels = sorted({g for c in curves for _, g in c.points if g > base})
    lo = base
    for hi in levels:
        if supply(hi) >= total:
            break
        lo = hi
    else:
        # Beyond every breakpoint each curve has slope 1: supply grows 1:1 per rank.
        level = lo + (total - supply(lo)) / len(curves)
        return level, [c.inverse(level) for c in curves]
    s_lo, s_hi = supply(lo), supply(hi)
    level = lo + (hi - lo) * (total - s_lo) / (s_hi - s_lo) if s_hi > s_lo else hi
    return level, [c.inverse(level) for c in curves]


def _curve(
    bubble: BubbleMap,
    send_s: float,
    interference: float,
    interval: int,
    policy: CheckpointPolicy,
) -> Exposure:
    """Fluid exposure of one rank as a function of its snapshot seconds."""
    usable = [max(0.0, s.idle_s - policy.spread_margin * s.spread_s) for s in bubble.slots]
    cap = sum(usable)
    cap_send = sum(u for u, s in zip(usable, bubble.slots, strict=True) if s.kind != "collective")
    i = min(interference, 1.0)
    if interval == 1:
        extra = max(0.0, send_s - cap_send)
        free = cap - min(send_s, cap_send)
        return Exposure(points=((0.0, extra), (free, extra + i * free)))
    only_snap = cap - cap_send

    def g(y: float) -> float:
        in_bubble = min(y, cap)
        sendable_used = min(max(0.0, in_bubble - only_snap), cap_send)
        send_spill = max(0.0, send_s - 2.0 * cap_send + sendable_used)
        return max(0.0, y - cap) + i * in_bubble + send_spill

    knots = {0.0, only_snap, cap}
    kink = only_snap + 2.0 * cap_send - send_s
    if 0.0 < kink < cap:
        knots.add(kink)
    return Exposure(points=tuple((y, g(y)) for y in sorted(knots)))


def lower_bound(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    cost: CostModel,
    policy: CheckpointPolicy,
    *,
    transfers: Transfers | None = None,
    interval_iters: int | None = None,
) -> float:
    """Least exposed seconds per iteration any plan can reach at this interval.

    Per replica group the best fluid DP split of the snapshot work; max over groups.
    """
    groups = validate_inputs(bubbles, layouts, transfers)
    return groups_lower_bound(
        bubbles, layouts, groups, cost, policy, transfers, interval_iters or policy.every
    )


def groups_lower_bound(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    groups: Sequence[tuple[int, ...]],
    cost: CostModel,
    policy: CheckpointPolicy,
    transfers: Transfers | None,
    interval: int,
    keys: Sequence[GroupKey] | None = None,
) -> float:
    """``lower_bound`` for already validated inputs and their replica groups (``keys``:
    their ``group_keys``, computed here if not given)."""
    keys = group_keys(groups, bubbles, layouts, transfers) if keys is None else keys
    a = cost.per_byte_s(TaskKind.SNAPSHOT, policy.max_chunk_bytes)
    best = 0.0
    done: set[GroupKey] = set()  # identical groups have identical levels
    for group, key in zip(groups, keys, strict=True):
        if key in done:
            continue
        done.add(key)
        curves = []
        for r, (_, sizes) in zip(group, key[1], strict=True):
            send_s = sum(
                n / cost.net_Bps + cost.task_overhead_s * math.ceil(n / policy.max_chunk_bytes)
                for n in sizes
            )
            curves.append(_curve(bubbles[r], send_s, cost.interference, interval, policy))
        level, _ = level_split(curves, a * layouts[group[0]].nbytes)
        best = max(best, level)
    return best / interval


def exact_exposed(
    bubbles: Mapping[int, BubbleMap],
    layouts: Mapping[int, StateLayout],
    cost: CostModel,
    policy: CheckpointPolicy,
    *,
    quantum: int,
) -> float:
    """Optimal exposed seconds per iteration by brute force (snapshot work only).

    Chunks are whole multiples of ``quantum`` bytes, at least ``min_chunk_bytes`` and at
    most ``max_chunk_bytes``; every chunk goes to one slot (if it fits) or is spilled.
    Exponential: for a handful of quanta, slots and replicas only.
    """
    groups = validate_inputs(bubbles, layouts)
    lo_units = max(1, math.ceil(policy.min_chunk_bytes / quantum))
    hi_units = policy.max_chunk_bytes // quantum
    if hi_units < lo_units:
        raise ValueError("quantum too coarse: no chunk size fits min/max_chunk_bytes")
    worst = 0.0
    for group in groups:
        total = layouts[group[0]].nbytes
        if total % quantum:
            raise ValueError(f"state size {total} is not a multiple of quantum={quantum}")
        units = total // quantum
        solvers = [
            _rank_solver(bubbles[r], quantum, lo_units, hi_units, cost, policy) for r in group
        ]
        best = math.inf
        for split in _compositions(units, len(group)):
            best = min(best, max(s(u) for s, u in zip(solvers, split, strict=True)))
        worst = max(worst, best)
    return worst / policy.every


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    return [(k, *rest) for k in range(total + 1) for rest in _compositions(total - k, parts - 1)]


def _rank_solver(
    bubble: BubbleMap,
    quantum: int,
    lo_units: int,
    hi_units: int,
    cost: CostModel,
    policy: CheckpointPolicy,
) -> Callable[[int], float]:
    caps0 = tuple(max(0.0, s.idle_s - policy.spread_margin * s.spread_s) for s in bubble.slots)

    @cache
    def go(rem: int, caps: tuple[float, ...]) -> float:
        if rem == 0:
            return 0.0
        best = math.inf
        for size in range(lo_units, min(hi_units, rem) + 1):
            if rem - size != 0 and rem - size < lo_units:
                continue
            est = cost.seconds(TaskKind.SNAPSHOT, size * quantum)
            best = min(best, est + go(rem - size, caps))
            for j, c in enumerate(caps):
                if est <= c * (1.0 + 1e-12):
                    new = caps[:j] + (c - est,) + caps[j + 1 :]
                    best = min(best, cost.interference * est + go(rem - size, new))
        return best

    def solve(units: int) -> float:
        return go(units, caps0)

    return solve
