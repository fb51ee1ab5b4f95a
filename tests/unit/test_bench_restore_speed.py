"""``benchmarks/restore_speed.py``'s summary: per repeat the slowest rank, then medians."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from restore_speed import summarize  # noqa: E402 - a script under benchmarks/


def _rank(memory: list[float], disk: list[float], *, identical: bool = True) -> dict[str, Any]:
    return {
        "version": 8,
        "memory": [
            {"total": t, "inventory": t / 4, "transfer_decode": 0.0, "load": t / 2} for t in memory
        ],
        "disk": [{"total": t} for t in disk],
        "first_memory": {"total": 2 * max(memory)},
        "identical": identical,
        "state_bytes": 100,
        "baft": "/x/baft",
    }


def test_each_repeat_counts_its_slowest_rank_and_medians_follow() -> None:
    res = summarize(
        [_rank([0.1, 0.4, 0.2], [0.3, 0.3, 0.6]), _rank([0.2, 0.1, 0.3], [0.5, 0.2, 0.1])]
    )
    assert res["memory_s"] == [0.2, 0.4, 0.3]
    assert res["disk_s"] == [0.5, 0.3, 0.6]
    assert (res["memory_median_s"], res["disk_median_s"]) == (0.3, 0.5)
    assert res["disk_over_memory"] == 0.5 / 0.3
    # the phases of the rank that was slowest in each repeat
    assert res["memory_phases_median_s"] == {
        "inventory": 0.075,
        "transfer_decode": 0.0,
        "load": 0.15,
    }
    assert res["first_memory_s"] == 0.8
    assert res["identical"] is True


def test_one_rank_with_other_bytes_makes_the_run_not_identical() -> None:
    res = summarize([_rank([0.1], [0.2]), _rank([0.1], [0.2], identical=False)])
    assert res["identical"] is False
