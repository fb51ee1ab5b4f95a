"""The typed records the engine writes and recovery reads (baft.store.records)."""

from __future__ import annotations

import json

import pytest

from baft.plan.inputs import PLAN_INPUT_FILE
from baft.store.records import DiffMeta, PlanInput, window_of


def test_diff_meta_round_trips_through_a_manifest_meta() -> None:
    d = DiffMeta(k=3, slice=1, first_version=4, has_record=True, payload_nbytes=96)
    meta = {"position": 7, "diff": d.to_json()}
    assert DiffMeta.of_meta(json.loads(json.dumps(meta))) == d
    assert DiffMeta.of_meta({"position": 7}) is None
    assert d.same_rotation(
        DiffMeta(k=3, slice=2, first_version=4, has_record=False, payload_nbytes=1)
    )
    assert not d.same_rotation(
        DiffMeta(k=3, slice=1, first_version=5, has_record=True, payload_nbytes=96)
    )


@pytest.mark.parametrize(
    ("version", "k", "first", "expected"),
    [
        (7, 3, 0, range(5, 8)),
        (5, 3, 4, None),
        (6, 3, 4, range(4, 7)),
        (3, 1, 3, range(3, 4)),
        (2, 3, 4, None),
    ],
)
def test_window_is_the_rotation_rule(
    version: int, k: int, first: int, expected: range | None
) -> None:
    assert window_of(version, k, first) == expected
    meta = DiffMeta(k=k, slice=version % k, first_version=first, has_record=True, payload_nbytes=1)
    assert meta.window(version) == expected


def test_plan_input_saves_atomically_and_keeps_unknown_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert PlanInput.load(tmp_path) is None
    raw = {
        "ranks": [{"bubbles": {}, "layout": {"rank": 0, "tensors": [["model.w", 16]]}}],
        "cost": {"copy_Bps": 1e9},
        "world_size": 1,
        "future": [1, 2],
    }
    (tmp_path / PLAN_INPUT_FILE).write_text(json.dumps(raw))
    p = PlanInput.load(tmp_path)
    assert p is not None and not p.replanned and p.world_size == 1
    assert p.saved_tensors(0) == [("model.w", 16)] and p.saved_tensors(1) is None
    q = p.with_copy_rate(2e9)
    q.replanned = True
    q.save(tmp_path)
    back = json.loads((tmp_path / PLAN_INPUT_FILE).read_text())
    assert back == {**raw, "cost": {"copy_Bps": 2e9}, "replanned": True}
    assert p.cost == {"copy_Bps": 1e9}  # with_copy_rate copies
    assert not (tmp_path / (PLAN_INPUT_FILE + ".tmp")).exists()
