"""The disk tier hands DCP its state nested by first key part: the same checkpoint, key
for key, loaded by a flat ``dcp.load`` (DCP's per-top-level-key cost is why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from baft.store.dcp_state import SavePlanner, nested_by_head


def test_nesting_groups_by_first_part_and_keeps_what_cannot_nest() -> None:
    t = torch.ones(2)
    state = {"model.a.w": t, "model.b": t, "optimizer.param_groups.a.w.lr": 0.1, "top": 3,
             "extra": 1, "extra.meta": t}  # fmt: skip
    assert nested_by_head(state) == {
        "model": {"a.w": t, "b": t}, "optimizer": {"param_groups.a.w.lr": 0.1},
        "top": 3, "extra": 1, "extra.meta": t,
    }  # fmt: skip


def test_a_nested_save_is_the_flat_checkpoint(tmp_path: Path) -> None:
    state = {
        "model.layers.0.weight": torch.arange(6.0).view(2, 3),
        "optimizer.state.layers.0.weight.step": torch.tensor(4.0),
        "optimizer.param_groups.layers.0.weight.betas": (0.9, 0.999),
        "optimizer.param_groups.layers.0.weight.foreach": None,
        "optimizer.param_groups.layers.0.weight.lr": 0.01,
    }
    dcp.save(nested_by_head(state), checkpoint_id=tmp_path, no_dist=True)
    meta = dcp.FileSystemReader(tmp_path).read_metadata()
    assert sorted(meta.state_dict_metadata) == sorted(state)
    target = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()
    }
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    for k, v in state.items():
        assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v, k


def test_the_planner_serializes_each_distinct_plain_value_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeated hyperparameters are one ``torch.save`` each, and every key loads back
    with its own value and type (1 and 1.0 and True, a tuple and a list, stay apart)."""
    values = [0.01, (0.9, 0.999), [0.9, 0.999], 1, 1.0, True, None, "adamw"]
    state: dict[str, object] = {"model.w": torch.arange(3.0)}
    for p in range(20):
        state.update({f"optimizer.param_groups.p{p}.k{i}": v for i, v in enumerate(values)})
    calls: list[object] = []
    real = torch.save

    def counting(obj: object, f: object, *args: object, **kwargs: object) -> None:
        calls.append(obj)
        real(obj, f, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", counting)
    dcp.save(nested_by_head(state), checkpoint_id=tmp_path, no_dist=True, planner=SavePlanner())
    monkeypatch.undo()
    assert len([c for c in calls if not isinstance(c, torch.Tensor)]) == len(values)
    target = {k: torch.zeros(3) if k == "model.w" else None for k in state}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v)
        else:
            assert target[k] == v and type(target[k]) is type(v), (k, target[k], v)
