"""Timeline records: parsing, tolerant reading, round trip through the writer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from baft.profile.timeline import (
    Event,
    IterationRecord,
    parse_lines,
    parse_record,
    read_timelines,
    record_to_json,
    write_timelines,
)

LINE = {
    "iteration": 3,
    "rank": 1,
    "t0": 1764680000.125,
    "iter_s": 0.5,
    "future_key": {"x": 1},
    "events": [
        {"name": "F", "stage": 1, "mb": 0, "cat": "compute", "start": 0.0, "end": 0.25},
        {"name": "wait", "slot": "w0", "cat": "wait", "kind": "p2p", "start": 0.25, "end": 0.5},
        {
            "name": "snapshot",
            "slot": "w0",
            "cat": "ckpt",
            "start": 0.25,
            "end": 0.375,
            "bytes": 1048576,
            "exposed": False,
            "extra": "ignored",
        },
    ],
}


def test_parse_record_reads_known_keys_and_ignores_others() -> None:
    rec = parse_record(LINE)
    assert (rec.iteration, rec.rank, rec.t0, rec.iter_s) == (3, 1, 1764680000.125, 0.5)
    assert rec.events[0] == Event(name="F", cat="compute", start=0.0, end=0.25, stage=1, mb=0)
    assert rec.events[1].slot == "w0" and rec.events[1].kind == "p2p"
    snap = rec.events[2]
    assert (snap.nbytes, snap.exposed, snap.duration) == (1048576, False, 0.125)


def test_round_trip_through_json() -> None:
    rec = parse_record(LINE)
    assert parse_record(json.loads(json.dumps(record_to_json(rec)))) == rec


def test_truncated_last_line_is_skipped() -> None:
    good = json.dumps(LINE)
    recs = parse_lines([good, "", good[:40]])
    assert len(recs) == 1 and recs[0].iteration == 3


def test_bad_middle_line_raises_with_location() -> None:
    good = json.dumps(LINE)
    with pytest.raises(ValueError, match=r"f\.jsonl:2"):
        parse_lines([good, "{not json", good], source="f.jsonl")


def test_read_timelines_sorts_and_uses_file_rank(tmp_path: Path) -> None:
    def rec(rank: int, it: int) -> IterationRecord:
        return IterationRecord(iteration=it, rank=rank, t0=100.0 + it, iter_s=1.0, events=())

    write_timelines(tmp_path, {0: [rec(0, 2), rec(0, 1)], 1: [rec(1, 1)]})
    # a rankless line in rank1's file takes the rank from the file name
    path = tmp_path / "timeline" / "rank1.jsonl"
    with path.open("a") as f:
        f.write(json.dumps({"iteration": 2, "t0": 1.0, "iter_s": 1.0, "events": []}) + "\n")
        f.write('{"iteration": 3, "rank": 1, "t0": 1.')  # killed mid-write
    got = read_timelines(tmp_path)
    assert sorted(got) == [0, 1]
    assert [r.iteration for r in got[0]] == [1, 2]
    assert [(r.rank, r.iteration) for r in got[1]] == [(1, 1), (1, 2)]


def test_read_timelines_without_files_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="rank<r>.jsonl"):
        read_timelines(tmp_path)


def test_an_unfinished_iteration_reports_its_length_so_far(monkeypatch) -> None:
    from types import SimpleNamespace

    from baft.pipeline import recorder

    clock = [100.0]  # logical time: the recorder's perf_counter reads this
    monkeypatch.setattr(
        recorder, "time", SimpleNamespace(time=time.time, perf_counter=lambda: clock[0])
    )
    tl = recorder.IterationTimeline(3, 0)
    clock[0] += 0.25
    so_far = tl.to_json()["iter_s"]  # what a hook (the engine's profile) reads
    assert so_far == 0.25
    clock[0] += 0.5
    assert tl.finish() == 0.75 and tl.to_json()["iter_s"] == 0.75
