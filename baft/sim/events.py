"""Pure event loop of one pipeline's iteration, and the inputs it takes.

``run_pipeline`` evaluates one pipeline (one dp index) of a schedule: each rank runs its
actions in order, an action starts when the rank is free and its inputs have arrived, and
transfers between ranks rendezvous as on gloo and NCCL (see ``run_pipeline``). Checkpoint
work placed at a wait point delays the next action; a ``Background`` load slows compute
and links. ``baft.sim.simulator`` adds the DP all-reduce, the barrier, slots and plan
replay on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from baft.sim.schedules import (
    Action,
    build_schedule,
    recvs_posted_early,
    send_waits,
    stage_rank,
)

__all__ = ["Background", "Interval", "Pipe", "Run", "StageTimes", "overlap", "run_pipeline"]


@dataclass(kw_only=True, slots=True)
class StageTimes:
    """Seconds of one microbatch per stage, and of the communication around them."""

    forward_s: float | tuple[float, ...]
    """Forward seconds per stage (one value for all stages, or one per stage)."""
    backward_s: float | tuple[float, ...]
    """Full backward seconds per stage (I + W for split-backward schedules)."""
    weight_fraction: float = 0.5
    """Share of the backward that is the weight gradient (W) in split schedules."""
    p2p_s: float = 0.0
    """Activation/gradient transfer between adjacent pipeline ranks."""
    dp_allreduce_s: float = 0.0
    """Exposed DP gradient all-reduce after the last backward (0 when dp == 1)."""
    tp_s: float = 0.0
    """Tensor-parallel collective seconds added to every F, B and I."""
    optimizer_s: float = 0.0
    """Optimizer step seconds (after the barrier; no checkpoint work runs there)."""
    p2p_contention: float = 1.0
    """Slowdown of a transfer while checkpoint work shares the rank's link (1 = none)."""
    per_action: Mapping[tuple[int, str, int], float] | None = None
    """Seconds of individual actions ``(stage, kind, mb)`` that override the per-stage
    values (trace-driven replay of a measured iteration); TP time is not added to them."""
    start_s: tuple[float, ...] = ()
    """When each pipeline rank starts the iteration (default all at 0): the skew a measured
    iteration began with, for trace-driven replay. Not counted as waiting."""

    def per_stage(self, count: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(forward, backward) seconds for each of ``count`` stages."""
        out = []
        for name in ("forward_s", "backward_s"):
            value = getattr(self, name)
            values = (float(value),) * count if isinstance(value, (int, float)) else tuple(value)
            if len(values) != count or min(values) < 0.0:
                raise ValueError(
                    f"{name} needs one non-negative value or {count} (one per stage), got {value!r}"
                )
            out.append(values)
        if not 0.0 <= self.weight_fraction <= 1.0 or self.p2p_contention < 1.0:
            raise ValueError("weight_fraction must be in [0, 1] and p2p_contention >= 1")
        return out[0], out[1]


@dataclass(frozen=True, slots=True)
class Background:
    """Checkpoint work running alongside compute from the start of the iteration."""

    compute_until_s: float = 0.0
    """Compute of this rank is slowed until this time."""
    compute_factor: float = 1.0
    """Slowdown factor of compute meanwhile."""
    link_until_s: float = 0.0
    """Transfers to/from this rank are slowed until this time."""
    link_factor: float = 1.0
    """Slowdown factor of those transfers."""
    done_by_step_s: float = 0.0
    """The optimizer step cannot start before this (the snapshot must be complete)."""


@dataclass(frozen=True, slots=True)
class Interval:
    """One span of a rank's timeline."""

    start: float
    end: float
    kind: str
    """"F", "B", "I", "W", "wait", "ckpt", "allreduce", "pre_step", "spill"."""
    label: str


@dataclass(slots=True)
class Run:
    """Raw result of one pipeline (one dp index)."""

    timeline: dict[int, list[Interval]] = field(default_factory=dict)
    waits: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    finish: dict[int, float] = field(default_factory=dict)


def _stretch(start: float, work: float, until: float, factor: float) -> float:
    """Elapsed seconds of ``work`` starting at ``start`` when slowed by ``factor`` until
    ``until``."""
    if factor == 1.0 or start >= until or work <= 0.0:
        return work
    slow = until - start
    if work * factor <= slow:
        return work * factor
    return slow + (work - slow / factor)


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Length of the intersection of [a0, a1] and [b0, b1] (0 if disjoint)."""
    return max(0.0, min(a1, b1) - max(a0, b0))


def _arrival(
    sent: float, times: StageTimes, links: tuple[Background, ...], busy0: float, busy1: float
) -> float:
    """When a transfer leaving at ``sent`` arrives: slowed by either end's background load,
    and by ``p2p_contention`` while the receiver runs checkpoint work in [busy0, busy1]."""
    link = max(_stretch(sent, times.p2p_s, b.link_until_s, b.link_factor) for b in links)
    share = overlap(busy0, busy1, sent, sent + link)
    return sent + link + share * (times.p2p_contention - 1.0)


def _key(a: Action) -> tuple[str, int, int]:
    return ("W" if a.kind == "W" else "F" if a.kind == "F" else "G", a.stage, a.mb)


def _deps(a: Action, last_stage: int) -> list[tuple[str, int, int]]:
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [("G", a.stage, a.mb)]
    deps = [("F", a.stage, a.mb)]
    if a.stage < last_stage:
        deps.append(("G", a.stage + 1, a.mb))
    return deps


@dataclass(frozen=True, slots=True)
class Pipe:
    """One schedule's fixed facts: action orders, where sends are waited, stage ranks."""

    orders: Mapping[int, tuple[Action, ...]]
    """Per pipeline rank, its compute actions in order."""
    send_waits: Mapping[int, Mapping[int, tuple[int, ...]]]
    """Per rank: action index -> actions whose sends are waited right before it."""
    ranks_of: tuple[int, ...]
    """Pipeline rank of each stage."""
    early_recvs: bool
    """Receives are posted at the start of the step (looped schedules)."""

    @classmethod
    def build(cls, schedule: str, num_ranks: int, m: int, num_virtual: int) -> Pipe:
        orders = build_schedule(schedule, num_ranks, m, num_virtual)
        return cls(
            orders=orders,
            send_waits={r: send_waits(schedule, order) for r, order in orders.items()},
            ranks_of=stage_rank(schedule, num_ranks, num_virtual),
            early_recvs=recvs_posted_early(schedule),
        )


def run_pipeline(
    pipe: Pipe,
    times: StageTimes,
    durations: Mapping[str, tuple[float, ...]],
    slot_work: Mapping[tuple[int, int], float],
    background: Mapping[int, Background],
) -> Run:
    """Longest-path evaluation of one pipeline; a rank blocks on a missing input.

    Transfers rendezvous: one starts when the sender has fired it (its compute ended) and
    the receiver has posted the receive (at the wait before the consuming action, or at
    the start with ``early_recvs``), and takes ``p2p_s``. A sender waits for its sends
    where ``send_waits`` says (the end of the step is index ``len(order)``). Every wait
    point is a possible slot.
    """
    orders, ranks_of, early_recvs = pipe.orders, pipe.ranks_of, pipe.early_recvs
    run = Run()
    last = len(ranks_of) - 1
    done: dict[tuple[str, int, int], float] = {}
    posted: dict[tuple[str, int, int], tuple[float, float]] = {}
    """Transfer (producer key) -> (receive posted at, receiver's slot work there ends)."""
    waiting: dict[object, list[int]] = {}  # producer key, or ("posted", producer key)
    ptr = dict.fromkeys(orders, 0)
    free = {r: times.start_s[r] if r < len(times.start_s) else 0.0 for r in orders}
    idle = Background()
    for r in orders:
        run.timeline[r], run.waits[r] = [], []

    def arrival(
        d: tuple[str, int, int], src: int, dst: int, busy: tuple[float, float] | None
    ) -> float:
        """When transfer ``d`` lands; ``busy``: the receiver's slot work at the receive
        (None: as recorded when it was posted, or none)."""
        t_post, busy1 = posted.get(d, (0.0, 0.0))
        links = (background.get(dst, idle), background.get(src, idle))
        start = max(done[d], t_post)
        if times.p2p_s <= 0.0:
            return start
        b0, b1 = (t_post, busy1) if busy is None else busy
        return _arrival(start, times, links, b0, b1)

    stack = sorted(orders, reverse=True)
    while stack:
        r = stack.pop()
        bg = background.get(r, idle)
        n = len(orders[r])
        while ptr[r] <= n:
            idx = ptr[r]
            a = orders[r][idx] if idx < n else None
            t_free = free[r]
            work = slot_work.get((r, idx), 0.0)
            deps = _deps(a, last) if a is not None else []
            remote = [d for d in deps if ranks_of[d[1]] != r]
            for d in () if early_recvs else remote:  # post this wait point's receives once
                if d not in posted:
                    posted[d] = (t_free, t_free + work)
                    stack.extend(waiting.pop(("posted", d), ()))
            sends = [_key(orders[r][i]) for i in pipe.send_waits[r].get(idx, ())]
            sends = [k for k in sends if _crosses(k, ranks_of, r, last)]
            missing: object = next((d for d in deps if d not in done), None)
            if missing is None:
                gone = next((k for k in sends if k not in posted and not early_recvs), None)
                missing = None if gone is None else ("posted", gone)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            ready = 0.0
            for d in deps:
                if d in remote:
                    ready = max(ready, arrival(d, ranks_of[d[1]], r, (t_free, t_free + work)))
                else:
                    ready = max(ready, done[d])
            for k in sends:
                ready = max(ready, arrival(k, r, _receiver(k, ranks_of), None))
            start = max(ready, t_free + work)
            label = f"slot@{a}" if a is not None else "slot@end"
            if work > 0.0:
                run.timeline[r].append(Interval(t_free, t_free + work, "ckpt", label))
            if start > t_free + work:
                what = f"wait {a}" if a is not None else "wait for sends"
                run.timeline[r].append(Interval(t_free + work, start, "wait", what))
            if ready > t_free:
                run.waits[r].append((idx, ready - t_free))
            ptr[r] = idx + 1
            if a is None:
                free[r] = start
                break
            dur = durations[a.kind][a.stage]
            if times.per_action is not None:
                dur = times.per_action.get((a.stage, a.kind, a.mb), dur)
            end = start + _stretch(start, dur, bg.compute_until_s, bg.compute_factor)
            run.timeline[r].append(Interval(start, end, a.kind, str(a)))
            done[_key(a)] = end
            free[r] = end
            stack.extend(waiting.pop(_key(a), ()))
    stuck = {
        r: str(orders[r][ptr[r]]) if ptr[r] < len(orders[r]) else "end"
        for r in orders
        if ptr[r] <= len(orders[r])
    }
    if stuck:
        raise ValueError(f"schedule deadlocks: ranks wait forever at {stuck}")
    run.finish = dict(free)
    return run


def _receiver(key: tuple[str, int, int], ranks_of: tuple[int, ...]) -> int:
    """The rank that consumes the output ``key`` of another rank."""
    kind, stage, _ = key
    return ranks_of[stage + 1] if kind == "F" else ranks_of[stage - 1]


def _crosses(key: tuple[str, int, int], ranks_of: tuple[int, ...], rank: int, last: int) -> bool:
    """Whether the output ``key`` of ``rank`` is sent to another rank."""
    kind, stage, _ = key
    if kind == "F":
        return stage < last and ranks_of[stage + 1] != rank
    if kind == "G":
        return stage > 0 and ranks_of[stage - 1] != rank
    return False
