"""Emulated stages: same parameters and names, right shapes, gradients, and the sleeps
called with the calibrated seconds (a recording sleep, no clock involved)."""

from __future__ import annotations

import pytest
import torch

from baft.model.config import ModelConfig
from baft.model.emulated import PARAM_GRAD, EmulatedStage, calibrate_stage, wrap_emulated
from baft.model.gpt import build_stage_module, loss_fn

CFG = ModelConfig(num_layers=4, d_model=16, num_heads=2, vocab_size=32, seq_len=8)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def _stage(stage: int, num_stages: int = 3) -> torch.nn.Module:
    return build_stage_module(CFG, stage, num_stages, seed=0)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_same_parameter_objects_under_same_names(stage: int) -> None:
    real = _stage(stage)
    names = {n: p for n, p in real.named_parameters()}
    emu = wrap_emulated(real, 0.01, 0.02, sleep=Recorder())
    assert isinstance(emu, EmulatedStage)
    assert [n for n, _ in emu.named_parameters()] == list(names)
    assert all(p is names[n] for n, p in emu.named_parameters())
    assert list(emu.state_dict()) == list(real.state_dict())


def _run(emu: torch.nn.Module, stage: int, num_stages: int = 3) -> torch.Tensor:
    if stage == 0:
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    else:
        x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    out = emu(x)
    if stage == num_stages - 1:
        loss_fn(out, torch.zeros(2, CFG.seq_len, dtype=torch.long)).backward()
    else:
        out.backward(torch.ones_like(out))
    if x.is_floating_point():
        assert x.grad is not None and x.grad.shape == x.shape
    return out


@pytest.mark.parametrize(("stage", "width"), [(0, CFG.d_model), (1, CFG.d_model), (2, 32)])
def test_output_shape_and_every_parameter_gets_a_gradient(stage: int, width: int) -> None:
    emu = wrap_emulated(_stage(stage), 0.0, 0.0, sleep=Recorder())
    out = _run(emu, stage)
    assert out.shape == (2, CFG.seq_len, width)
    for name, p in emu.named_parameters():
        assert p.grad is not None, name
        assert torch.equal(p.grad, torch.full_like(p, PARAM_GRAD)), name


def test_sleeps_called_with_calibrated_seconds_per_forward_and_backward() -> None:
    sleep = Recorder()
    emu = wrap_emulated(_stage(1), 0.125, 0.25, sleep=sleep)
    _run(emu, 1)
    _run(emu, 1)
    assert sleep.calls == [0.125, 0.25, 0.125, 0.25]


def test_outputs_are_deterministic() -> None:
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    full = build_stage_module(CFG, 0, 1, seed=0)  # embedding and head on one stage
    a = wrap_emulated(full, 0.0, 0.0, sleep=Recorder())(x)
    b = wrap_emulated(build_stage_module(CFG, 0, 1, seed=1), 0.0, 0.0, sleep=Recorder())(x)
    assert a.shape == (2, CFG.seq_len, CFG.vocab_size)
    assert torch.equal(a, b)


def test_rejects_non_gpt_modules_and_negative_times() -> None:
    with pytest.raises(ValueError, match="GPTStage"):
        wrap_emulated(torch.nn.Linear(2, 2), 0.1, 0.1)
    with pytest.raises(ValueError, match=">= 0"):
        wrap_emulated(_stage(0), -1.0, 0.1)


def test_calibrate_stage_returns_positive_times_and_clears_grads() -> None:
    stage = _stage(2)
    fwd, bwd = calibrate_stage(stage, CFG, microbatch=2, num_reps=2)
    assert fwd > 0 and bwd > 0
    assert all(p.grad is None for p in stage.parameters())
