"""The rules of a DCP restore into another shard layout, and of who writes what along the
shard axis (pure, in process): :func:`baft.recover.reshard.layout_change`, the check that
per-rank records agree across the saved shard ranks, and
:func:`baft.engine.persisting.writes_of`."""

from __future__ import annotations

import pytest
import torch

from baft.engine.persisting import writes_of
from baft.pipeline.encoding import encode_blob
from baft.recover.reshard import _check_equal, layout_change
from baft.store.keys import PersistKeys


def _blob(obj: object, size: int = 256) -> torch.Tensor:
    """A record tensor as TrainingState writes it (magic, length, payload, zeros)."""
    import struct

    payload = encode_blob(obj, "test")
    raw = struct.pack("<4sI", b"BFTS", len(payload)) + payload
    t = torch.zeros(size, dtype=torch.uint8)
    t[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return t


def test_layout_change_names_the_degrees_and_refuses_another_pipeline_split() -> None:
    four = {"pp0.tp0": "a", "pp0.tp1": "b", "pp1.tp0": "c", "pp1.tp1": "d"}
    two = {"pp0.tp0": "e", "pp1.tp0": "f"}
    assert layout_change(four, dict(four)) is None
    assert layout_change({"pp0.tp0": "x"}, {"pp0.tp0": "y"}) is None  # same keys: strict path
    assert layout_change(None, two) is None  # written before layouts were recorded
    why = layout_change(four, two)
    assert why is not None and "shard ranks per stage pp0: 2 -> 1, pp1: 2 -> 1" in why
    assert "RNG states not restored" in why
    with pytest.raises(ValueError, match="written by 2 pipeline stages, this job has 1"):
        layout_change(four, {"pp0.tp0": "g", "pp0.tp1": "h"})


def test_records_must_agree_across_saved_shard_ranks() -> None:
    meta = {"optimizer": "torch.optim.adamw.AdamW", "state_keys": ["s"], "hypers": [{"lr": 0.1}]}
    other_layout = dict(meta, layout="per-rank digest", groups=[[2, "x"]])
    scratch = {
        "extra.pp0.tp0.meta.AdamW": _blob(dict(meta, layout="d0", groups=[[2, "y"]])),
        "extra.pp0.tp1.meta.AdamW": _blob(other_layout),
        "extra.pp0.tp0.state.s": _blob({"class": "S", "state": {"position": 3}}),
        "extra.pp0.tp1.state.s": _blob({"class": "S", "state": {"position": 3}}),
    }
    records = {
        "meta.AdamW": ["extra.pp0.tp0.meta.AdamW", "extra.pp0.tp1.meta.AdamW"],
        "state.s": ["extra.pp0.tp0.state.s", "extra.pp0.tp1.state.s"],
    }
    _check_equal(records, scratch)  # per-rank digests differ; that is by design
    scratch["extra.pp0.tp1.state.s"] = _blob({"class": "S", "state": {"position": 4}})
    with pytest.raises(ValueError) as e:
        _check_equal(records, scratch)
    assert str(e.value).startswith(
        "per-rank state cannot be resharded: extra.pp0.tp1.state.s differ from shard rank 0's"
    )
    scratch["extra.pp0.tp1.state.s"] = scratch["extra.pp0.tp0.state.s"]
    scratch["extra.pp0.tp1.meta.AdamW"] = _blob(dict(meta, hypers=[{"lr": 0.2}]))
    with pytest.raises(ValueError, match="extra.pp0.tp1.meta.AdamW differ"):
        _check_equal(records, scratch)


def test_one_writer_per_key_along_the_shard_axis() -> None:
    meta = {"hypers": [{"lr": 0.5, "betas": (0.9, 0.95)}]}
    state = {
        "w": torch.ones(2),  # a DTensor piece
        "optimizer.state.w.step": torch.tensor(3.0),  # plain: the same on every shard rank
        "extra.pp0.tp0.meta.AdamW": _blob(meta),
    }
    args = dict(keys=PersistKeys(), sharded={"w"}, meta_key="extra.pp0.tp0.meta.AdamW")
    first = writes_of(state, shard=0, param_groups=[["w"]], **args)  # type: ignore[arg-type]
    assert sorted(first) == [
        "extra.pp0.tp0.meta.AdamW",
        "optimizer.param_groups.w.betas",
        "optimizer.param_groups.w.lr",
        "optimizer.state.w.step",
        "w",
    ]
    assert first["optimizer.param_groups.w.betas"] == (0.9, 0.95)
    state["extra.pp0.tp1.meta.AdamW"] = state.pop("extra.pp0.tp0.meta.AdamW")
    args["meta_key"] = "extra.pp0.tp1.meta.AdamW"
    second = writes_of(state, shard=1, param_groups=[["w"]], **args)  # type: ignore[arg-type]
    assert sorted(second) == ["extra.pp0.tp1.meta.AdamW", "w"]
