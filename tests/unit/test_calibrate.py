"""Cost-model calibration: structure only (keys, positive finite numbers), no timings."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from baft.plan.cost import CostModel
from baft.profile.calibrate import (
    COST_KEYS,
    measure_cost_model,
    measure_interference,
    measure_throughputs,
    shm_buffer,
)


@pytest.mark.timeout(60)
def test_cost_model_without_interference_has_positive_throughputs(tmp_path: Path) -> None:
    got = measure_cost_model(1 << 20, repeats=1, interference=False, persist_dir=tmp_path)
    assert CostModel.from_measurements(got).copy_Bps == got["copy_Bps"]
    assert set(got) == {"copy_Bps", "encode_Bps", "persist_Bps", "hash_Bps"}
    assert all(math.isfinite(v) and v > 0 for v in got.values())
    assert list(tmp_path.iterdir()) == []  # temporary files are gone


@pytest.mark.timeout(60)
def test_interference_is_a_nonnegative_pair() -> None:
    wall, cpu = measure_interference(num_runs=1, run_s=0.005)
    assert math.isfinite(wall) and wall >= 0.0
    assert math.isfinite(cpu) and cpu >= 0.0
    assert set(COST_KEYS) >= {"interference", "interference_wall"}


def test_shm_buffer_is_prefaulted_and_removed(tmp_path: Path) -> None:
    with shm_buffer(4096, tmp_path) as buf:
        assert buf.nbytes == 4096 and int(buf.min()) == 1
        assert len(os.listdir(tmp_path)) == 1
    assert os.listdir(tmp_path) == []


def test_bad_sizes_raise_with_fix() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        measure_throughputs(12)
    with pytest.raises(ValueError, match="repeats"):
        measure_throughputs(1 << 10, repeats=0)
    with pytest.raises(ValueError, match="num_runs"):
        measure_interference(num_runs=0)


def test_calibration_leaves_the_global_rng_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 calibrates on its training thread at the end of profiling: a draw from
    torch's global RNG there changed every later dropout mask, and a job with the default
    CheckpointConfig() (cost measured) trained differently from the same loop without
    baft, with no failure at all."""
    import torch

    from baft.profile.calibrate import measure_cost_model

    torch.manual_seed(1234)
    before = torch.get_rng_state().clone()
    measure_cost_model(1 << 20, repeats=1, interference=False, persist_dir=tmp_path)
    assert torch.equal(torch.get_rng_state(), before)
