"""Canonical tensor names (pure): made, split and grouped by one module."""

from __future__ import annotations

import pytest

from baft.plan import names


def test_made_names_spell_the_canonical_prefixes() -> None:
    assert names.model("layers.0.w") == "model.layers.0.w"
    assert names.buffer("bn.running_mean") == "buffer.bn.running_mean"
    assert names.optim("layers.0.w", "exp_avg") == "optim.layers.0.w.exp_avg"
    assert names.grad("layers.0.w") == "grad.layers.0.w"
    assert names.meta("AdamW") == "extra.meta.AdamW"
    assert names.state("sampler") == "extra.state.sampler"
    assert names.rng("cpu") == "extra.rng.cpu"
    assert names.rng("cuda") == "extra.rng.cuda"
    assert names.OPTIM_CREATED == "extra.optim.created"


def test_split_and_kinds() -> None:
    assert names.split("optim.a.w.exp_avg") == ("optim", "a.w.exp_avg")
    assert names.split("extra.pp0.tp1.rng.cpu") == ("extra", "pp0.tp1.rng.cpu")
    assert [names.split(names.model("x"))[0], names.split(names.buffer("x"))[0]] == [
        "model",
        "buffer",
    ]
    for bad in ("grad.w", "record.meta", "model", "slice"):
        with pytest.raises(ValueError, match="no canonical tensor name"):
            names.split(bad)
    assert names.is_extra("extra.meta.SGD") and not names.is_extra("optim.extra.x")
    assert names.is_meta("extra.meta.SGD") and not names.is_meta("extra.state.meta")
    assert names.is_model("model.w") and not names.is_model("buffer.model.w")


def test_group_of_names() -> None:
    assert names.group_of("model.a.weight") == "a.weight"
    assert names.group_of("optim.a.weight.exp_avg_sq") == "a.weight"
    assert names.group_of("buffer.bn.running_mean") is None
    assert names.group_of("extra.pp0.tp0.rng") is None
    assert names.param_of_optim("optim.layers.3.attn.wq.weight.step") == "layers.3.attn.wq.weight"
    with pytest.raises(ValueError, match="no optimizer state name"):
        names.param_of_optim("model.a.weight")


def test_plain_fqn_and_coordinates() -> None:
    assert names.plain_fqn("model.layers.3.bias") == "layers.3.bias"
    assert names.plain_fqn("buffer.bn.running_var") == "bn.running_var"
    assert names.plain_fqn("optim.a.w.step") == "optim.a.w.step"
    assert names.plain_fqn("extra.rng.cpu") == "extra.rng.cpu"
    prefix = names.extra_prefix(2, 1)
    assert prefix == "extra.pp2.tp1."
    assert names.with_coords("extra.rng.cpu", prefix) == "extra.pp2.tp1.rng.cpu"
    assert names.with_coords("model.w", prefix) == "model.w"
    for n in ("extra.rng.cpu", "extra.state.sampler", "model.w", "optim.w.step"):
        assert names.without_coords(names.with_coords(n, prefix), prefix) == n
    # another rank's record keeps its coordinates
    assert names.without_coords("extra.pp0.tp1.rng.cpu", prefix) == "extra.pp0.tp1.rng.cpu"
