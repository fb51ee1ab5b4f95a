"""``baft plan --run``: re-plan a run from its saved planner inputs, count where its
snapshot tasks ran, and print both (``plan_from_run`` and the command)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baft.cli import main
from baft.plan.inputs import PLAN_INPUT_FILE, bmap_to_json, layout_to_json
from baft.plan.types import BubbleMap, Slot, StateLayout, TensorSpec
from baft.profile.planrun import plan_from_run
from baft.profile.timeline import Event, IterationRecord, write_timelines

MIB = 1 << 20


def _run_dir(tmp_path: Path) -> Path:
    """pp=2, 4 MiB of state per rank, one 50 ms bubble each; rank 1 spills once."""
    ranks = []
    for rank in (0, 1):
        bubbles = BubbleMap(
            rank=rank,
            slots=(Slot("w0", 0.05), Slot("pre_step", 0.0, kind="pre_step")),
            iteration_s=0.2,
        )
        layout = StateLayout(rank=rank, tensors=(TensorSpec("w", 4 * MIB),), replicas=(rank,))
        ranks.append({"bubbles": bmap_to_json(bubbles), "layout": layout_to_json(layout)})
    cost = {"copy_Bps": 1e9, "net_Bps": 1e9, "encode_Bps": 1e9, "persist_Bps": 1e8}
    (tmp_path / PLAN_INPUT_FILE).write_text(json.dumps({"ranks": ranks, "cost": cost}))
    (tmp_path / "config.json").write_text(json.dumps({"checkpoint": {"redundancy": "none"}}))
    records = {}
    for rank in (0, 1):
        records[rank] = [
            IterationRecord(
                iteration=it,
                rank=rank,
                t0=100.0 + 0.2 * it,
                iter_s=0.2,
                events=(
                    Event(name="F", cat="compute", start=0.0, end=0.05, stage=rank, mb=0),
                    Event(name="wait", cat="wait", start=0.05, end=0.1, slot="w0", kind="p2p"),
                    Event(
                        name="snapshot",
                        cat="ckpt",
                        start=0.05,
                        end=0.06,
                        slot="w0",
                        nbytes=MIB,
                        exposed=rank == 1 and it == 2,
                    ),
                ),
            )
            for it in range(3)
        ]
    write_timelines(tmp_path, records)
    return tmp_path


def test_plan_from_run_replans_and_counts_placement(tmp_path: Path) -> None:
    r = plan_from_run(_run_dir(tmp_path))
    assert r.placement == {0: {"in_bubble": 3, "spilled": 0}, 1: {"in_bubble": 2, "spilled": 1}}
    assert sorted(r.bubbles) == [0, 1] and r.bubbles[1].capacity_s() == pytest.approx(0.05)
    assert {rank: (rp.owned_start, rp.owned_stop) for rank, rp in r.plan.ranks.items()} == {
        0: (0, 4 * MIB),
        1: (0, 4 * MIB),
    }
    assert r.png == tmp_path / "plan.png" and r.png.read_bytes()[:4] == b"\x89PNG"


def test_plan_run_command_text_json_and_missing_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path)
    assert main(["plan", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "rank 1: 2 snapshot tasks ran inside measured bubbles, 1 were spilled" in out
    assert f"timeline with the executed tasks: {run / 'plan.png'}" in out
    assert main(["plan", "--run", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["placement"]["0"] == {"in_bubble": 3, "spilled": 0}
    assert data["png"] == str(run / "plan.png")
    assert main(["plan", "--run", str(tmp_path / "nope")]) == 2
    assert "plan_input.json not found" in capsys.readouterr().err
