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
        "main_sys_s": 0.0,
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


def test_attribution_parts_add_up_to_the_overhead_per_rank() -> None:
    from baft_bench.attribution import attribute, markdown

    def mode(it: float, main: float, runq: float, exposed: float, blocked: float) -> dict:
        return {
            "per_rank_mean": {
                "iter_s": [it, it], "main_cpu_s": [main, main], "main_runq_s": [runq, 0.0],
                "exposed_s": [exposed, 0.0], "blocked_s": [blocked, blocked + 0.004],
                "baft_cpu_s": [0.03, 0.03], "other_cpu_s": [0.01, 0.01],
            }
        }  # fmt: skip

    result = {"modes": {"none": mode(0.300, 0.090, 0.001, 0.0, 0.050),
                        "baft": mode(0.316, 0.095, 0.003, 0.006, 0.050)}}  # fmt: skip
    result["modes"]["none"]["per_rank_mean"]["baft_cpu_s"] = [0.0, 0.0]
    r0, r1 = attribute(result, "baft")
    assert round(r0["overhead"], 6) == 16.0
    assert [round(r0[k], 6) for k in ("main_cpu", "main_runq", "exposed_wait")] == [5.0, 2.0, 6.0]
    assert round(r0["residual"], 6) == 3.0 and round(r0["measured_share"], 4) == 0.8125
    assert round(r1["pipeline_wait"], 6) == 0.0 and round(r1["residual"], 6) == 11.0
    assert round(r0["baft_threads"], 6) == 30.0
    table = markdown(result, ["baft"])
    assert (
        "| baft | 0 | +16.0 | +5.0 | +2.0 | +6.0 | +0.0 | +3.0 | +0.0 | +30.0 | +0.0 | 81% |"
        in table
    )


def test_stime_is_field_15_after_the_command_name() -> None:
    import os

    from baft_bench.threads import parse_stime

    tick = os.sysconf("SC_CLK_TCK")
    line = "123 (python (x) y) S 1 2 3 4 5 6 7 8 9 10 " + f"{3 * tick} {2 * tick} 0 0\n"
    assert parse_stime(line) == 2.0
