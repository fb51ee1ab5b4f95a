"""Trace export: Chrome trace structure, PNG written, `baft trace` command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from baft.cli.trace import add_trace_parser, parse_iterations, run_trace
from baft.profile.timeline import Event, IterationRecord, write_timelines
from baft.profile.trace import chrome_trace, event_label, select_range, timeline_png


def pipeline_records(num_iterations: int = 4, num_mb: int = 4) -> dict[int, list[IterationRecord]]:
    """A GPipe-like pp=2 timeline (F 20 ms, B 40 ms) with checkpoint tasks in the waits."""
    f, b = 0.02, 0.04
    out: dict[int, list[IterationRecord]] = {0: [], 1: []}
    for it in range(num_iterations):
        t0 = 1000.0 + it * 0.5
        for rank in (0, 1):
            ev: list[Event] = []
            t = 0.0 if rank == 0 else f
            if rank == 1:
                ev.append(Event(name="wait", cat="wait", start=0.0, end=f, slot="w0", kind="p2p"))
                ev.append(
                    Event(
                        name="snapshot",
                        cat="ckpt",
                        start=0.0,
                        end=0.015,
                        slot="w0",
                        nbytes=1 << 20,
                        exposed=False,
                    )
                )
            for mb in range(num_mb):
                ev.append(Event(name="F", cat="compute", start=t, end=t + f, stage=rank, mb=mb))
                t += f
            if rank == 0:
                ev.append(
                    Event(name="wait", cat="wait", start=t, end=t + f + b, slot="w0", kind="p2p")
                )
                ev.append(
                    Event(
                        name="snapshot",
                        cat="ckpt",
                        start=t,
                        end=t + 0.03,
                        slot="w0",
                        nbytes=1 << 20,
                        exposed=False,
                    )
                )
                ev.append(
                    Event(
                        name="send",
                        cat="ckpt",
                        start=t + 0.03,
                        end=t + 0.05,
                        slot="w0",
                        nbytes=1 << 20,
                        exposed=False,
                    )
                )
                t += f + b
            for mb in range(num_mb):
                ev.append(Event(name="B", cat="compute", start=t, end=t + b, stage=rank, mb=mb))
                t += b
            if rank == 1:
                ev.append(Event(name="wait", cat="wait", start=t, end=t + b, slot="w1", kind="p2p"))
                t += b
            ev.append(
                Event(
                    name="wait",
                    cat="wait",
                    start=t,
                    end=t + 0.01,
                    slot="dp_allreduce",
                    kind="collective",
                )
            )
            ev.append(
                Event(
                    name="snapshot",
                    cat="ckpt",
                    start=t + 0.01,
                    end=t + 0.015,
                    slot="pre_step",
                    nbytes=4096,
                    exposed=True,
                )
            )
            ev.append(Event(name="optimizer", cat="compute", start=t + 0.015, end=t + 0.025))
            out[rank].append(
                IterationRecord(iteration=it, rank=rank, t0=t0, iter_s=t + 0.025, events=tuple(ev))
            )
    return out


def test_event_label() -> None:
    assert event_label(Event(name="F", cat="compute", start=0, end=1, stage=1, mb=3)) == "1F3"
    assert event_label(Event(name="optimizer", cat="compute", start=0, end=1)) == "optimizer"
    ckpt = Event(name="send", cat="ckpt", start=0, end=1, slot="w2", exposed=True)
    assert event_label(ckpt) == "send w2 (exposed)"


def test_chrome_trace_structure_and_microseconds() -> None:
    records = pipeline_records(num_iterations=2)
    trace = chrome_trace(records)
    json.dumps(trace)  # serialisable
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    num_events = sum(len(r.events) + 1 for recs in records.values() for r in recs)
    assert len(xs) == num_events  # every event plus one step span per iteration
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    assert {e["cat"] for e in xs} == {"step", "compute", "wait", "ckpt"}
    first_f = next(e for e in xs if e["name"] == "0F0" and e["args"]["iteration"] == 0)
    assert (first_f["ts"], first_f["dur"]) == (0.0, 20000.0)
    second_step = next(e for e in xs if e["name"] == "iteration 1" and e["tid"] < 1000)
    assert second_step["ts"] == 500000.0
    # compute, wait and ckpt of one rank sit on different tracks; no track has overlaps
    by_tid: dict[int, list[tuple[float, float]]] = {}
    for e in xs:
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_tid.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:], strict=False))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"rank 0 compute", "rank 0 wait", "rank 0 ckpt", "rank 1 step"} <= names
    exposed = [e for e in xs if e["cat"] == "ckpt" and e["args"].get("exposed")]
    assert exposed and all(e["cname"] == "terrible" for e in exposed)


def test_overlapping_ckpt_tasks_get_extra_track() -> None:
    ev = (
        Event(name="snapshot", cat="ckpt", start=0.0, end=0.5, slot="w0", exposed=False),
        Event(name="send", cat="ckpt", start=0.25, end=0.75, slot="w0", exposed=False),
    )
    trace = chrome_trace({0: [IterationRecord(iteration=0, rank=0, t0=5.0, iter_s=1.0, events=ev)]})
    tids = {e["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tids["snapshot w0"] != tids["send w0"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"rank 0 ckpt", "rank 0 ckpt 2"} <= names


def test_parse_iterations() -> None:
    assert parse_iterations("2:5") == (2, 5)
    assert parse_iterations("7") == (7, 7)
    assert parse_iterations(":3")[0] == 0 and parse_iterations("4:")[0] == 4
    with pytest.raises(ValueError, match="A:B"):
        parse_iterations("x:y")
    with pytest.raises(ValueError, match="after"):
        parse_iterations("5:2")


def test_select_range_inclusive() -> None:
    got = select_range(pipeline_records(), (1, 2))
    assert {r: [x.iteration for x in v] for r, v in got.items()} == {0: [1, 2], 1: [1, 2]}


@pytest.mark.timeout(60)
def test_timeline_png_writes_a_png(tmp_path: Path) -> None:
    out = timeline_png(pipeline_records(), tmp_path / "t.png", (1, 2))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no iterations"):
        timeline_png(pipeline_records(), tmp_path / "u.png", (50, 60))


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_trace_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.mark.timeout(60)
def test_run_trace_writes_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_timelines(tmp_path, pipeline_records())
    args = _args(["trace", str(tmp_path), "--iterations", "1:3"])
    assert args.func is run_trace
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "trace.json") in printed and str(tmp_path / "timeline.png") in printed
    trace = json.loads((tmp_path / "trace.json").read_text())
    its = {e["args"]["iteration"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert its == {1, 2, 3}
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_run_trace_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_trace(_args(["trace", str(tmp_path)])) == 2
    assert "no timelines" in capsys.readouterr().err
    write_timelines(tmp_path, pipeline_records(num_iterations=2))
    assert run_trace(_args(["trace", str(tmp_path), "--iterations", "8:9"])) == 2
    assert "the run has 0..1" in capsys.readouterr().err
