"""BubbleMap from hand-made timelines: exact medians, spreads, order, pre_step."""

from __future__ import annotations

import pytest

from baft.plan.types import BubbleMap, Slot
from baft.profile.bubbles import (
    blocked_fraction,
    bubble_map,
    bubble_maps,
    median,
    quantile,
    select_iterations,
)
from baft.profile.timeline import Event, IterationRecord


def wait(slot: str, start: float, end: float, kind: str = "p2p") -> Event:
    return Event(name="wait", cat="wait", start=start, end=end, slot=slot, kind=kind)


def rec(it: int, events: list[Event], iter_s: float = 1.0, rank: int = 0) -> IterationRecord:
    return IterationRecord(
        iteration=it, rank=rank, t0=1000.0 + it, iter_s=iter_s, events=tuple(events)
    )


def compute(start: float, end: float) -> Event:
    return Event(name="F", cat="compute", start=start, end=end, stage=0, mb=0)


def snap(slot: str, start: float, end: float, exposed: bool = False) -> Event:
    return Event(
        name="snapshot", cat="ckpt", start=start, end=end, slot=slot, nbytes=8, exposed=exposed
    )


def test_quantile_matches_numpy_linear() -> None:
    assert quantile([4.0, 1.0, 2.0, 3.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.1) == pytest.approx(1.4)
    assert median([7.0]) == 7.0


RECORDS = [
    # warm-up, skipped by default: huge waits that must not count
    rec(0, [wait("w0", 0.0, 0.5), wait("w1", 0.0, 0.5)], iter_s=9.0),
    rec(
        1,
        [
            compute(0.0, 0.125),
            wait("w0", 0.25, 0.5),
            snap("w0", 0.25, 0.375),
            wait("w1", 0.125, 0.25),
            wait("dp_allreduce", 0.75, 0.875, kind="collective"),
            snap("pre_step", 0.875, 0.9375, exposed=True),
        ],
        iter_s=1.0,
    ),
    rec(2, [wait("w0", 0.25, 0.375), wait("w1", 0.125, 0.1875)], iter_s=1.5),
    rec(
        3,
        [wait("w0", 0.25, 0.75), wait("w1", 0.125, 0.25), wait("w1", 0.5, 0.625)],
        iter_s=0.5,
    ),
]


def test_bubble_map_exact_medians_order_and_pre_step() -> None:
    bm = bubble_map(0, RECORDS)
    assert isinstance(bm, BubbleMap) and bm.rank == 0
    assert [s.slot_id for s in bm.slots] == ["w1", "w0", "dp_allreduce", "pre_step"]
    by_id = {s.slot_id: s for s in bm.slots}
    # w0 idle per iteration: 0.25, 0.125, 0.5 -> median 0.25
    assert by_id["w0"].idle_s == 0.25
    assert by_id["w0"].spread_s == pytest.approx((0.45 - 0.15) / 2)
    # w1: 0.125, 0.0625, 0.125 + 0.125 (two waits in one iteration add up)
    assert by_id["w1"].idle_s == 0.125
    # dp_allreduce only in one of three iterations -> absent counts as 0
    dp = by_id["dp_allreduce"]
    assert (dp.idle_s, dp.kind) == (0.0, "collective")
    assert dp.spread_s == pytest.approx(0.05)
    assert by_id["w0"].kind == "p2p"
    # checkpoint events never add idle time; pre_step is 0 unless a wait was measured
    assert bm.slots[-1] == Slot(slot_id="pre_step", idle_s=0.0, spread_s=0.0, kind="pre_step")
    assert bm.iteration_s == 1.0


def test_measured_pre_step_wait_stays_last() -> None:
    recs = [rec(1, [wait("pre_step", 0.0, 0.25), wait("w0", 0.5, 0.625)])]
    bm = bubble_map(0, recs, skip=0)
    assert [(s.slot_id, s.idle_s, s.kind) for s in bm.slots] == [
        ("w0", 0.125, "p2p"),
        ("pre_step", 0.25, "pre_step"),
    ]


def test_skip_and_last_select_iterations() -> None:
    assert [r.iteration for r in select_iterations(RECORDS, skip=1, last=2)] == [2, 3]
    bm = bubble_map(0, RECORDS, skip=1, last=2)
    by_id = {s.slot_id: s.idle_s for s in bm.slots}
    assert by_id["w0"] == (0.125 + 0.5) / 2
    assert bm.iteration_s == 1.0  # median of 1.5 and 0.5
    assert bubble_map(0, RECORDS, skip=0).iteration_s == 1.25


def test_skip_that_drops_everything_raises_with_fix() -> None:
    with pytest.raises(ValueError, match="lower skip"):
        bubble_map(0, RECORDS[:1], skip=1)
    with pytest.raises(ValueError, match="last"):
        select_iterations(RECORDS, last=0)


def test_bubble_maps_per_rank() -> None:
    other = [rec(i, [wait("w0", 0.0, 0.0625 * i)], rank=1) for i in range(4)]
    maps = bubble_maps({1: other, 0: RECORDS})
    assert list(maps) == [0, 1]
    assert maps[1].rank == 1
    assert [(s.slot_id, s.idle_s) for s in maps[1].slots] == [("w0", 0.125), ("pre_step", 0.0)]


def test_no_waits_gives_only_pre_step() -> None:
    bm = bubble_map(3, [rec(0, [compute(0.0, 0.5)]), rec(1, [compute(0.0, 0.5)])])
    assert bm.slots == (Slot(slot_id="pre_step", idle_s=0.0, spread_s=0.0, kind="pre_step"),)


def test_blocked_fraction_counts_overlaps_once() -> None:
    recs = [
        rec(0, [wait("w0", 0.0, 1.0)], iter_s=1.0),  # warm-up, skipped
        rec(1, [wait("w0", 0.0, 0.25), wait("w1", 0.125, 0.375)], iter_s=1.0),
        rec(2, [wait("w0", 0.5, 0.625), snap("w0", 0.5, 0.75)], iter_s=1.0),
    ]
    assert blocked_fraction({0: recs}) == {0: (0.375 + 0.125) / 2.0}
    assert blocked_fraction({0: recs}, skip=0) == {0: (1.0 + 0.375 + 0.125) / 3.0}


def test_in_bubble_tasks_before_the_wait_give_the_bubble_back() -> None:
    recs = [
        rec(
            0,
            [
                # synchronous in-bubble task right before the wait: the bubble was 0.375
                snap("w0", 0.125, 0.375),
                wait("w0", 0.375, 0.5),
                # background task running past the end of the wait: cut at the wait end
                wait("w1", 0.5, 0.5625),
                snap("w1", 0.5, 0.75),
                # exposed task before the wait: not a bubble
                snap("w2", 0.75, 0.875, exposed=True),
                wait("w2", 0.875, 0.9375),
            ],
        )
    ]
    bm = bubble_map(0, recs, skip=0)
    assert [(s.slot_id, s.idle_s) for s in bm.slots] == [
        ("w0", 0.375),
        ("w1", 0.0625),
        ("w2", 0.0625),
        ("pre_step", 0.0),
    ]
