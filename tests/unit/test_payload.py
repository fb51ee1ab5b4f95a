"""The differential payload layout (pure): what each version protects, in which order,
and the full_every the bubbles can afford."""

from __future__ import annotations

import pytest

from baft.plan.names import group_of
from baft.plan.payload import (
    AUTO_FILL,
    RECORD_META,
    SLICE,
    PayloadLayout,
    auto_full_every,
)
from baft.plan.types import TensorSpec

SPECS = (
    TensorSpec("model.a.weight", 4000),
    TensorSpec("model.a.bias", 40),
    TensorSpec("model.b.weight", 2000),
    TensorSpec("optim.a.weight.exp_avg", 4000),
    TensorSpec("optim.a.weight.exp_avg_sq", 4000),
    TensorSpec("optim.a.weight.step", 4),
    TensorSpec("optim.a.bias.exp_avg", 40),
    TensorSpec("optim.b.weight.exp_avg", 2000),
    TensorSpec("buffer.bn.running_mean", 64),
    TensorSpec("extra.pp0.tp0.rng", 5056),
)


def test_layout_sizes_and_order() -> None:
    lay = PayloadLayout.of(SPECS, k=2, meta_nbytes=1024)
    assert [s.name for s in lay.always] == ["buffer.bn.running_mean", "extra.pp0.tp0.rng"]
    assert [s.name for s in lay.grads] == ["grad.a.weight", "grad.a.bias", "grad.b.weight"]
    assert [s.nbytes for s in lay.grads] == [4000, 40, 2000]
    # groups with their optimizer state: a.weight 12004, a.bias 80, b.weight 4000
    assert sorted(lay.slice_sizes) == [4080, 12004]
    assert lay.head_nbytes == 64 + 5056 + 1024 + 6040
    assert lay.nbytes == lay.head_nbytes + 12004
    for j in range(2):  # every payload lists its slice's whole groups and fits the size
        names = [s.name for s in lay.order(j)]
        assert names[:3] == ["buffer.bn.running_mean", "extra.pp0.tp0.rng", RECORD_META]
        assert sum(s.nbytes for s in lay.order(j)) <= lay.nbytes
    members = {s.name for j in range(2) for s in lay.slice_members(j)}
    assert members == {s.name for s in SPECS if group_of(s.name) is not None}
    assert [s.name for s in lay.specs()][-1] == SLICE
    assert sum(s.nbytes for s in lay.specs()) == lay.nbytes


def test_layout_rejects_k1_and_orphan_state() -> None:
    with pytest.raises(ValueError, match="full_every >= 2"):
        PayloadLayout.of(SPECS, k=1)
    with pytest.raises(ValueError, match="without its parameter"):
        PayloadLayout.of((TensorSpec("optim.x.exp_avg", 8),), k=2)


def test_auto_full_every_follows_capacity() -> None:
    # four Adam-like groups of 1000 B params: full 12000 B, record 4000 B; k=2 -> 10000,
    # k=3 -> 10000 (the largest slice holds two groups), k=4 -> 7000 B per iteration
    adam = tuple(
        TensorSpec(f"{kind}.p{i}{suffix}", 1000)
        for i in range(4)
        for kind, suffix in (("model", ""), ("optim", ".exp_avg"), ("optim", ".exp_avg_sq"))
    )
    per_byte_s = 1 / 1e6 + 1 / 1e9

    def pick(capacity_bytes: float) -> tuple[int, str]:
        """auto with bubbles that copy and protect ``capacity_bytes`` per iteration."""
        return auto_full_every(
            adam, capacity_s=capacity_bytes * per_byte_s, copy_Bps=1e6, net_Bps=1e9, fanout=1.0
        )

    # a payload may fill AUTO_FILL (a quarter) of the capacity: copies in bubbles cost too
    assert AUTO_FILL == 0.25
    assert pick(48_000)[0] == 1  # the whole state fits a quarter: no records needed
    assert pick(47_996)[0] == 2
    assert pick(40_000)[0] == 2
    assert pick(32_000)[0] == 4
    assert "25% of the bubbles' capacity" in pick(48_000)[1]
    k, why = pick(0)
    assert k == 4 and "spills" in why  # nothing fits: the fewest bytes per iteration
