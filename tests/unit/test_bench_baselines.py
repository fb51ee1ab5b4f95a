"""Baseline checkpointing modes on a one-process fake trainer: what they write is the state
of the right version, and they report the bytes they protected."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from baft.pipeline import IterationTimeline
from baft_bench.baselines import CheckFreqHooks, TorchSaveHooks, make_baseline, state_nbytes


class FakeTrainer:
    """What the baselines use of a Trainer: modules, optimizer, named_state, mesh.rank."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.modules = [torch.nn.Linear(4, 3)]
        self.optimizer = torch.optim.AdamW(self.modules[0].parameters(), foreach=False)
        self.mesh = SimpleNamespace(rank=0)
        self.hooks: Any = None

    def named_state(self) -> Any:
        names = {}
        for fqn, p in self.modules[0].named_parameters():
            names[id(p)] = fqn
            yield f"model.{fqn}", p.data
        for p in self.modules[0].parameters():
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                yield f"optim.{names[id(p)]}.{key}", value

    def step(self, iteration: int) -> None:
        """One training step calling the hooks like Trainer.train_step does."""
        tl = IterationTimeline(iteration, 0)
        if self.hooks is not None:
            self.hooks.before_iteration(iteration, tl)
        self.optimizer.zero_grad()
        self.modules[0](torch.ones(2, 4)).sum().backward()
        if self.hooks is not None:
            self.hooks.on_slot("w0", "p2p", tl)
            self.hooks.before_optimizer_step(iteration, tl)
        self.optimizer.step()
        if self.hooks is not None:
            self.hooks.after_step(iteration, tl)


def _state(trainer: FakeTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.named_state()}


def test_checkfreq_persists_the_state_before_the_step(tmp_path: Path) -> None:
    trainer = FakeTrainer()
    trainer.step(0)  # optimizer state exists from here on
    hooks = CheckFreqHooks(trainer, tmp_path)  # type: ignore[arg-type]
    trainer.hooks = hooks
    before = _state(trainer)
    trainer.step(1)
    hooks.drain()
    saved = torch.load(tmp_path / "rank0.pt")
    assert list(saved) == list(before)
    assert all(torch.equal(saved[n], before[n]) for n in before)
    assert not torch.equal(saved["model.weight"], trainer.modules[0].weight)  # stepped since
    assert hooks.last_metrics["bytes"] == state_nbytes(trainer)  # type: ignore[arg-type]
    assert hooks.last_metrics["in_bubble_s"] == 0.0
    assert hooks.last_metrics["exposed_s"] > 0.0
    assert hooks.last_metrics["disk_saves"] == 1.0
    hooks.close()


def test_torch_save_writes_the_state_after_the_step(tmp_path: Path) -> None:
    trainer = FakeTrainer()
    hooks = TorchSaveHooks(trainer, tmp_path)  # type: ignore[arg-type]
    trainer.hooks = hooks
    trainer.step(0)
    trainer.step(1)
    saved = torch.load(tmp_path / "rank0.pt")
    assert torch.equal(saved["model"]["weight"], trainer.modules[0].weight)
    state = trainer.optimizer.state_dict()["state"][0]
    assert torch.equal(saved["optim"]["state"][0]["exp_avg"], state["exp_avg"])
    assert hooks.last_metrics["bytes"] == state_nbytes(trainer)  # type: ignore[arg-type]
    assert not (tmp_path / "rank0.pt.tmp").exists()


def test_disabled_mode_does_nothing_and_reports_zero(tmp_path: Path) -> None:
    trainer = FakeTrainer()
    hooks = TorchSaveHooks(trainer, tmp_path)  # type: ignore[arg-type]
    hooks.enabled = False
    trainer.hooks = hooks
    trainer.step(0)
    assert not (tmp_path / "rank0.pt").exists()
    assert hooks.last_metrics == {
        "in_bubble_s": 0.0,
        "exposed_s": 0.0,
        "bytes": 0.0,
        "disk_saves": 0.0,
    }


def test_unknown_baseline_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose one of"):
        make_baseline("rsync", FakeTrainer(), tmp_path)  # type: ignore[arg-type]
