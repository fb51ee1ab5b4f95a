"""The overhead bench's per-thread attribution (baft_bench.threads): parsing and grouping."""

from __future__ import annotations

import threading

from baft_bench.threads import FIELDS, ThreadClock, ThreadTimes, deltas, parse_schedstat


def test_parse_schedstat_gives_seconds() -> None:
    t = parse_schedstat("1500000000 250000000 42\n")
    assert t == ThreadTimes(1.5, 0.25)


def test_deltas_group_main_baft_and_other_threads() -> None:
    before = {1: ThreadTimes(1.0, 0.5), 2: ThreadTimes(2.0, 0.0), 3: ThreadTimes(0.0, 0.0)}
    after = {
        1: ThreadTimes(1.25, 0.75),  # main: +0.25 cpu, +0.25 run queue
        2: ThreadTimes(2.5, 0.125),  # baft-worker: +0.5, +0.125
        3: ThreadTimes(0.0625, 1.0),  # a C++ thread: +0.0625 cpu (its run queue not kept)
        4: ThreadTimes(0.5, 0.0),  # born in between: counts from zero
    }
    d = deltas(before, after, main_tid=1, names={2: "baft-worker", 4: "baft-copy"})
    assert d == {
        "main_cpu_s": 0.25,
        "main_runq_s": 0.25,
        "baft_cpu_s": 1.0,
        "baft_runq_s": 0.125,
        "other_cpu_s": 0.0625,
    }


def test_clock_sees_a_busy_named_thread() -> None:
    clock = ThreadClock()
    clock.start()
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    t = threading.Thread(target=spin, name="baft-spin")
    t.start()
    threading.Event().wait(0.2)
    values = dict(zip(FIELDS, clock.stop(), strict=True))
    stop.set()
    t.join()
    assert values["baft_cpu_s"] > 0.0
    assert values["other_cpu_s"] >= 0.0
