"""Schedule orders match torch.distributed.pipelining (as recorded on a real 2-rank run)."""

from __future__ import annotations

from collections import Counter

import pytest

from baft.sim.schedules import (
    build_schedule,
    num_stages,
    recvs_posted_early,
    send_waits,
    stage_rank,
)


def names(actions: tuple) -> str:
    return " ".join(str(a) for a in actions)


def test_interleaved_rank0_matches_torch_order() -> None:
    # torch 2.13 ScheduleInterleaved1F1B, 2 ranks, 4 microbatches, rank 0, idle slots dropped
    got = build_schedule("interleaved-1f1b", 2, 4, 2)[0]
    assert names(got) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"


def test_zbv_rank0_matches_torch_order() -> None:
    got = names(build_schedule("zbv", 2, 4, 2)[0])
    assert got.startswith("0F0 0F1 0F2 3F0 3I0 3W0") and got.endswith("0I3 0W3")
    assert stage_rank("zbv", 2, 2) == (0, 1, 1, 0)


def test_one_f_one_b_and_gpipe_orders() -> None:
    s = build_schedule("1f1b", 3, 4)
    assert names(s[0]) == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"
    assert names(s[2]) == "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    assert names(build_schedule("gpipe", 2, 2)[1]) == "1F0 1F1 1B0 1B1"


def test_send_waits_follow_torch_schedule_code() -> None:
    """Read off torch 2.13 schedules.py: where each fired send is waited for."""
    s = build_schedule("1f1b", 2, 4)
    # rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3. Warm-up waits for F0's send after F1; F1's
    # send is fused with B0's receive; steady sends with the next receive; B2 (the break)
    # and B3 (cool-down) are waited at the end.
    assert send_waits("1f1b", s[0]) == {2: (0, 1), 3: (2,), 4: (3,), 5: (4,), 6: (5,), 8: (6, 7)}
    # rank 1 (last stage): a single warm-up forward, every send fused with the next wait
    assert send_waits("1f1b", s[1]) == {k: (k - 1,) for k in range(1, 9)}
    g = build_schedule("gpipe", 2, 3)[0]  # forward sends before the first backward
    assert send_waits("gpipe", g) == {3: (0, 1, 2), 6: (3, 4, 5)}
    z = build_schedule("zbv", 2, 4, 2)[0]  # runtime schedules: every send at the end
    assert send_waits("zbv", z) == {len(z): tuple(i for i, a in enumerate(z) if a.kind != "W")}
    assert not recvs_posted_early("1f1b") and recvs_posted_early("interleaved-1f1b")


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [
        ("gpipe", 4, 3, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved-1f1b", 4, 8, 3),
        ("interleaved-1f1b", 4, 2, 2),
        ("zbv", 4, 5, 2),
        ("zbv", 3, 9, 2),
    ],
)
def test_every_stage_runs_every_microbatch_once(name: str, p: int, m: int, v: int) -> None:
    sched = build_schedule(name, p, m, v)
    owner = stage_rank(name, p, v)
    counts: Counter[tuple[int, str]] = Counter()
    for rank, actions in sched.items():
        for a in actions:
            assert owner[a.stage] == rank
            counts[(a.stage, a.kind)] += 1
    for stage in range(num_stages(name, p, v)):
        kinds = ("F", "I", "W") if name == "zbv" else ("F", "B")
        assert all(counts[(stage, k)] == m for k in kinds)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("ring", 2, 4, 1), "unknown"),
        (("1f1b", 4, 2, 1), "num_microbatches >= num_stages_pp"),
        (("zbv", 2, 4, 1), "num_virtual=2"),
        (("interleaved-1f1b", 4, 9, 2), "multiple of"),
        (("gpipe", 2, 4, 2), "one stage per rank"),
    ],
)
def test_schedule_errors(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)
