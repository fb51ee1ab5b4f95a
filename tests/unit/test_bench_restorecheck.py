"""The restore check of ``baft bench overhead`` on a one-process fake trainer: an exact
checkpoint restores ("yes"), one that drops a tensor, holds another version or differs in
one byte does not ("no"); the verdict of all ranks is one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from baft_bench.baselines import CheckFreqHooks, TorchSaveHooks
from baft_bench.restorecheck import (
    LiveHistory,
    canonical,
    check_iterations,
    check_saved,
    combine,
    compare,
    digests,
)
from tests.unit.test_bench_baselines import FakeTrainer


def _run(trainer: FakeTrainer, first: int, num: int, history: LiveHistory) -> int:
    """``num`` steps from ``first``, recording the state at every boundary."""
    for it in range(first, first + num):
        history.record(it, trainer.named_state())
        trainer.step(it)
    history.record(first + num, trainer.named_state())
    return first + num


def _saved_by(hooks: Any, tmp_path: Path, every: int = 1) -> tuple[FakeTrainer, Any, LiveHistory]:
    trainer = FakeTrainer()
    mode = hooks(trainer, tmp_path, every)
    trainer.hooks = mode
    history = LiveHistory()
    _run(trainer, 0, 5, history)
    mode.drain()
    return trainer, mode, history


def test_exact_checkpoints_restore(tmp_path: Path) -> None:
    for hooks in (TorchSaveHooks, CheckFreqHooks):
        trainer, mode, history = _saved_by(hooks, tmp_path / hooks.__name__)
        verdict, detail = check_saved(
            history, mode.saved_version, mode.checkpoint(), trainer.named_state()
        )
        assert verdict == "yes", detail
        n = len(list(trainer.named_state()))
        # torch-save writes after the step of iteration 4 (version 5), CheckFreq before it
        assert detail == f"v{5 if hooks is TorchSaveHooks else 4}: {n} tensors bit for bit"


def test_cadence_decides_the_version_saved(tmp_path: Path) -> None:
    trainer, mode, history = _saved_by(TorchSaveHooks, tmp_path, every=2)
    assert mode.saved_version == 5  # iterations 0, 2, 4 save; the newest after 4's step
    trainer, mode, history = _saved_by(CheckFreqHooks, tmp_path / "cf", every=3)
    assert mode.saved_version == 3  # iterations 0 and 3: the state before 3's step
    verdict, _ = check_saved(history, 3, mode.checkpoint(), trainer.named_state())
    assert verdict == "yes"


def test_a_checkpoint_that_drops_a_tensor_is_caught(tmp_path: Path) -> None:
    trainer, mode, history = _saved_by(TorchSaveHooks, tmp_path)
    saved, live = mode.checkpoint()
    del saved["optim"]["state"][0]["exp_avg_sq"]
    verdict, detail = check_saved(history, mode.saved_version, (saved, live), trainer.named_state())
    assert verdict == "no"
    assert detail == "v5: missing 1 (optim.weight.exp_avg_sq)"


def test_a_checkpoint_of_another_version_or_with_a_flipped_byte_is_caught(
    tmp_path: Path,
) -> None:
    trainer, mode, history = _saved_by(CheckFreqHooks, tmp_path)
    named = list(trainer.named_state())
    verdict, detail = check_saved(history, 3, mode.checkpoint(), named)  # it holds v4
    assert verdict == "no" and detail.startswith("v3: differ ")
    saved, live = mode.checkpoint()
    saved["model.bias"].view(torch.uint8)[0] ^= 1
    verdict, detail = check_saved(history, 4, (saved, live), named)
    assert (verdict, detail) == ("no", "v4: differ 1 (model.bias)")
    assert check_saved(history, 99, mode.checkpoint(), named) == (
        "no",
        "version 99 is not among the recorded live versions",
    )
    assert check_saved(history, None, None, named) == ("no", "no checkpoint to restore")


def test_canonical_names_by_storage_and_ignores_untracked_tensors() -> None:
    trainer = FakeTrainer()
    trainer.step(0)
    live = {"model": trainer.modules[0].state_dict(), "optim": trainer.optimizer.state_dict()}
    saved = {"model": {k: v.clone() for k, v in live["model"].items()}, "optim": live["optim"]}
    saved["extra"] = torch.ones(1)  # not in the live structure: not a state tensor
    names = sorted(canonical(saved, live, trainer.named_state()))
    assert names == sorted(n for n, _ in trainer.named_state())
    restored = canonical(saved, live, trainer.named_state())
    assert compare(digests(trainer.named_state()), restored, 1)[0] == "yes"


def test_every_rank_must_restore() -> None:
    assert combine([(0, "yes", "a"), (1, "yes", "b")]) == ("yes", "rank 0: a; rank 1: b")
    assert combine([(0, "yes", "a"), (1, "no", "b")]) == ("no", "rank 1: b")
    assert combine([(0, "n/a", "none"), (1, "n/a", "none")]) == ("n/a", "none")


def test_check_iterations_hold_a_whole_window() -> None:
    assert check_iterations(1, 4) == 6  # K=4 consecutive versions + 2
    assert check_iterations(5, 1) == 15  # three checkpoints at interval 5
    assert check_iterations(2, 0) == 6
