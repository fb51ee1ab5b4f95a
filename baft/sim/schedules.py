"""Pure pipeline schedules: per-rank ordered compute actions, as torch.distributed.pipelining
orders them (``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``).

An action is (stage, kind, microbatch) with kind F (forward), B (full backward), I
(backward for inputs) or W (backward for weights). Idle slots (``None`` in torch's
``pipeline_order``) are not listed: in a run they are simply time spent waiting.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "build_schedule",
    "num_stages",
    "recvs_posted_early",
    "send_waits",
    "stage_rank",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
"""Schedule names understood by ``build_schedule``."""


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a pipeline rank."""

    stage: int
    """Global stage index (0 .. num_stages-1)."""
    kind: str
    """"F", "B", "I" or "W"."""
    mb: int
    """Microbatch index."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def _check(name: str, num_ranks: int, num_microbatches: int, num_virtual: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r} unknown: use one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or num_microbatches < 1:
        raise ValueError("num_stages_pp and num_microbatches must be >= 1")
    if name == "zbv" and num_virtual != 2:
        raise ValueError(
            f"zbv runs exactly 2 stages per rank: pass num_virtual=2 (got {num_virtual})"
        )
    if name in ("gpipe", "1f1b") and num_virtual != 1:
        raise ValueError(
            f"{name} has one stage per rank: pass num_virtual=1 or use interleaved-1f1b"
        )
    if name == "1f1b" and num_microbatches < num_ranks:
        raise ValueError(
            f"1f1b needs num_microbatches >= num_stages_pp ({num_microbatches} < {num_ranks}): "
            "raise the microbatches or use gpipe"
        )
    if name == "interleaved-1f1b":
        if num_virtual < 1:
            raise ValueError("num_virtual must be >= 1")
        rounds = max(1, num_microbatches // num_ranks)
        if num_microbatches % rounds:
            raise ValueError(
                f"interleaved-1f1b needs num_microbatches to be a multiple of {rounds} "
                f"(= max(1, microbatches // pp)); got {num_microbatches}"
            )


def num_stages(name: str, num_ranks: int, num_virtual: int = 1) -> int:
    """Total pipeline stages of a schedule."""
    return num_ranks * (2 if name == "zbv" else num_virtual)


def stage_rank(name: str, num_ranks: int, num_virtual: int = 1) -> tuple[int, ...]:
    """Rank running each stage: loop order (s % p) or, for zbv, the V shape."""
    total = num_stages(name, num_ranks, num_virtual)
    if name == "zbv":
        return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(total))
    return tuple(s % num_ranks for s in range(total))


def build_schedule(
    name: str, num_ranks: int, num_microbatches: int, num_virtual: int = 1
) -> dict[int, tuple[Action, ...]]:
    """Per-rank ordered actions of one iteration. Raises ``ValueError`` with the fix."""
    _check(name, num_ranks, num_microbatches, num_virtual)
    builders = {
        "gpipe": _gpipe,
        "1f1b": _one_f_one_b,
        "interleaved-1f1b": _interleaved,
        "zbv": _zbv,
    }
    return {
        r: tuple(builders[name](r, num_ranks, num_microbatches, num_virtual))
        for r in range(num_ranks)
    }


def send_waits(name: str, order: tuple[Action, ...]) -> dict[int, tuple[int, ...]]:
    """Where torch's implementation of the schedule waits for the send each action fires.

    ``{j: (i, ...)}``: the send fired after action ``i`` is waited for right before action
    ``j`` (``j == len(order)``: at the end of the step). A send completes only once the
    peer has posted its receive (gloo and NCCL p2p rendezvous), so these waits are where a
    sender idles for a slower receiver. Mirrors torch 2.13's ``ScheduleGPipe`` (all
    forward sends before the first backward, backward sends at the end), ``Schedule1F1B``
    (warm-up and cool-down wait for the previous send after the next compute; the steady
    phase fuses each send with the next receive) and ``_PipelineScheduleRuntime`` (the
    looped schedules wait for every send at the end). Which sends cross ranks is the
    caller's business; every F, B and I is listed.
    """
    n = len(order)
    out: dict[int, list[int]] = defaultdict(list)
    senders = [i for i, a in enumerate(order) if a.kind != "W"]
    if name == "gpipe":
        first_b = next((i for i, a in enumerate(order) if a.kind != "F"), n)
        for i in senders:
            out[first_b if order[i].kind == "F" else n].append(i)
    elif name == "1f1b":
        warmup = next((i for i, a in enumerate(order) if a.kind != "F"), n)
        last_f = max(i for i, a in enumerate(order) if a.kind == "F")
        brk = next((i for i in range(last_f + 1, n) if order[i].kind == "B"), n)
        for i in senders:
            steady = warmup - 1 <= i < brk
            out[min(n, i + 1 if steady else i + 2)].append(i)
    else:
        out[n] = senders
    return {j: tuple(v) for j, v in sorted(out.items())}


def recvs_posted_early(name: str) -> bool:
    """Whether torch posts a receive well before the compute that needs it.

    ``ScheduleGPipe`` and ``Schedule1F1B`` post each receive right before waiting for it,
    so a transfer cannot start before the receiver gets there; the looped schedules
    (``_PipelineScheduleRuntime``) post receives as early as the lowered action list
    allows, modelled as posted from the start of the step."""
    return name not in ("gpipe", "1f1b")


def _gpipe(rank: int, p: int, m: int, v: int) -> list[Action]:
    return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> list[Action]:
    warmup = min(m, p - rank)
    ops = [Action(rank, "F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < m:
        ops.append(Action(rank, "B", bwd))
        bwd += 1
        if fwd < m:
            ops.append(Action(rank, "F", fwd))
            fwd += 1
    return ops


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """torch's ScheduleInterleaved1F1B order (depth first), idle slots dropped."""
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    steady = total - warmup

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    next_mb: dict[tuple[int, str], int] = defaultdict(int)

    def act(stage: int, kind: str) -> Action:
        mb = next_mb[(stage, kind)]
        next_mb[(stage, kind)] += 1
        return Action(stage, kind, mb)

    ops: list[Action] = []
    for step in range(warmup + steady + warmup):
        if step < warmup:
            ops.append(act(fwd_stage(step), "F"))
        elif step < warmup + steady:
            ops.append(act(fwd_stage(step), "F"))
            ops.append(act(bwd_stage(step), "B"))
        else:
            ops.append(act(bwd_stage(step), "B"))
    return ops


def _zbv(rank: int, p: int, m: int, v: int) -> list[Action]:
    """torch's ScheduleZBVZeroBubble order (V shape, B split into I and W)."""
    n_micro = max(2 * p - 1, m)
    s0, s1 = rank, 2 * p - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append(Action(s0, "F", f0))
        f0 += 1
    for _ in range(rank):
        ops += [Action(s1, "F", f1), Action(s0, "F", f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        ops += [Action(s1, "F", f1), Action(s1, "I", b1), Action(s1, "W", b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            ops.append(Action(s0, "F", f0))
            f0 += 1
        ops += [Action(s0, "I", b0), Action(s0, "W", b0)]
        b0 += 1
        ops += [Action(s1, "F", f1), Action(s1, "I", b1), Action(s1, "W", b1)]
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [Action(s0, "I", b0), Action(s1, "I", b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        ops += [Action(s0, "I", b0), Action(s0, "W", w0)]
        b0 += 1
        w0 += 1
    while w1 < b1:
        ops.append(Action(s1, "W", w1))
        w1 += 1
    while w0 < b0:
        ops.append(Action(s0, "W", w0))
        w0 += 1
    assert w0 == b0 == f0 and w1 == b1 == f1
    return [a for a in ops if a.mb < m]
