"""``BaftCheckpointManager`` in torchtitan's Trainer loop over torchtitan 0.3.0's own
components (``titan_fake``: its ``BaseCheckpointManager``, ``OptimizersContainer`` with
AdamW, warmup ``LambdaLR`` in its ``LRSchedulersContainer``, its HF text data loader),
over 2 real gloo ranks (a 2-stage GPipe pipeline with dropout).

1. The reference: the same trainer with ``checkpoint.enable=False`` (the manager does
   nothing), 6 steps; every step's state is recorded.
2. Launch A with baft, 4 steps, a clean end keeping the stores: the same bytes as the
   reference at every step (baft does not change the trajectory).
3. Launch B (fresh objects, as after a restart): ``load()`` restores from memory the
   newest committed version, v3 (the state after step 4 is copied in step 5's idle
   windows, so a job that ends after step 4 has committed v3); the trainer's step equals
   it, and parameters, optimizer state, LR, scheduler, RNG, dataloader and train state
   equal the reference after step 3 (``torch.equal``); it trains on to step 6 on the
   reference's bytes. ``save`` with a step baft did not count raises and says why.
4. Launch C persists every version (``interval=1``) into torchtitan's checkpoint folder
   (``<dump_folder>/checkpoint/v0000000N``) and ends without keeping the stores; launch D
   restores the newest persisted version from there (baft's DCP tier), bit-exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist.titan_fake import make_assets

pytestmark = pytest.mark.timeout(300)


pytest.importorskip("torchtitan")


def _manager_config(base: Path, *, enable: bool = True, **kw: Any) -> Any:
    from baft.integrations.torchtitan import TORCHTITAN_AVAILABLE, BaftCheckpointManager

    assert TORCHTITAN_AVAILABLE  # the manager derives from torchtitan's own base class

    return BaftCheckpointManager.Config(
        enable=enable,
        store_root=str(base / "shm"),
        policy="redundancy=replicate:1",
        ranks_per_node=1,
        **kw,
    )


def _run(rank: int, world: int, base: Path, steps: int, **kw: Any) -> tuple[bool, list[Any], Any]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(base.parent / "hf_cache"))
    from tests.dist.titan_fake import Trainer

    cfg = _manager_config(base, **kw)
    trainer = Trainer(rank, world, cfg, base, base.parent / "assets")
    seen: list[Any] = []

    def after_step(t: Any) -> None:
        seen.append(t.snapshot())
        if len(seen) == 1 and t.checkpointer.enable:  # right after load()
            report = t.checkpointer.ft.recovery
            seen[0]["source"] = report.record["source"] if report is not None else None

    loaded = trainer.train(steps, after_step=after_step)
    return loaded, seen, trainer


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else bool(a == b)


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Names whose values differ; state baft created up front (the optimizer's before
    its first step, as that step creates it) must be zeros where ``want`` has none."""
    extra = [k for k in got.keys() - want.keys() if not _same(got[k], torch.zeros_like(got[k]))]
    return sorted(extra + [k for k in want if k not in got or not _same(got[k], want[k])])


def _titan_job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    _, ref, trainer = _run(rank, world, base / "ref", 6, enable=False)
    trainer.close()
    out["ref_steps"] = [s["train_state"]["step"] for s in ref]

    a = base / "mem"
    loaded, seen, trainer = _run(rank, world, a, 4, keep_on_close=True, interval=100)
    out["a_loaded"], out["a_source"] = loaded, seen[0].pop("source")
    out["a_diff"] = [_differences(s, ref[i]) for i, s in enumerate(seen)]
    trainer.close()
    dist.barrier()

    loaded, seen, trainer = _run(rank, world, a, 6, interval=100)
    resumed = seen[0]["train_state"]["step"]
    out["b_loaded"], out["b_resumed"], out["b_source"] = loaded, resumed, seen[0].pop("source")
    out["b_diff"] = [_differences(s, ref[resumed + i]) for i, s in enumerate(seen)]
    out["b_mismatch"] = None
    try:
        trainer.checkpointer.save(trainer.step + 1)
    except RuntimeError as e:
        out["b_mismatch"] = str(e)
    trainer.close()
    dist.barrier()

    c = base / "disk"
    _run(rank, world, c, 6, interval=1)[2].close()
    dist.barrier()
    out["c_folder"] = sorted(os.listdir(c / "outputs" / "checkpoint"))
    loaded, seen, trainer = _run(rank, world, c, 6, interval=1)
    out["d_loaded"], out["d_resumed"] = loaded, seen[0]["train_state"]["step"]
    out["d_source"] = seen[0].pop("source")
    out["d_diff"] = _differences(seen[0], ref[out["d_resumed"]])
    trainer.close()
    return out


@pytest.mark.slow  # default tier: test_crashed_torchtitan_trainer_resumes_from_memory
def test_torchtitan_trainer_restores_bit_exactly(gloo, tmp_path: Path) -> None:
    make_assets(tmp_path / "assets")
    got = gloo.run(_titan_job, 2, args=(str(tmp_path),), timeout_s=280)
    for rank, out in enumerate(got):
        assert out["ref_steps"] == list(range(7)), out
        assert (out["a_loaded"], out["a_source"]) == (False, None), out
        assert out["a_diff"] == [[]] * 5, (rank, out["a_diff"])
        assert (out["b_loaded"], out["b_source"]) == (True, "memory"), out
        # the newest committed version of 4 steps: v3 (the state after step 4 would be
        # copied in step 5's idle windows; a clean end does not commit it)
        assert out["b_resumed"] == 3, out
        assert out["b_diff"] == [[]] * 4, (rank, out["b_diff"])
        assert "torchtitan saves step 7 but baft counted 6 optimizer steps" in out["b_mismatch"]
        # persisted every version (interval=1) after baft's 3 profiling steps; the state
        # after the last step (v6) lived in the stores only, freed by the clean end
        assert out["c_folder"] == ["baft", "latest", "v00000003", "v00000004", "v00000005"]
        assert (out["d_loaded"], out["d_resumed"], out["d_source"]) == (True, 5, "disk"), out
        assert out["d_diff"] == [], out


def _crash_job(rank: int, world: int, root: str) -> None:
    """Trains with baft and dies right after ``save(4)``, without ``close()``."""
    from tests.dist.titan_fake import Trainer

    base = Path(root) / "run"
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(Path(root) / "hf_cache"))
    trainer = Trainer(rank, world, _manager_config(base, interval=100), base, Path(root) / "assets")

    def die_after_step_4(t: Any) -> None:
        if t.step == 4:
            os._exit(9)  # a crash: no close(), no interpreter teardown

    trainer.train(6, after_step=die_after_step_4)


def _restart_job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    _, ref, trainer = _run(rank, world, base / "ref", 6, enable=False)
    trainer.close()
    loaded, seen, trainer = _run(rank, world, base / "run", 6, interval=100)
    resumed = seen[0]["train_state"]["step"]
    out = {"loaded": loaded, "resumed": resumed, "source": seen[0].pop("source")}
    out["diff"] = [_differences(s, ref[resumed + i]) for i, s in enumerate(seen)]
    trainer.close()
    return out


def test_crashed_torchtitan_trainer_resumes_from_memory(gloo, tmp_path: Path) -> None:
    make_assets(tmp_path / "assets")
    crashed = gloo.start(_crash_job, 2, args=(str(tmp_path),), timeout_s=120).wait(130)
    assert [o.returncode for o in crashed] == [9, 9], [o.log[-3000:] for o in crashed]
    got = gloo.run(_restart_job, 2, args=(str(tmp_path),), timeout_s=200)
    for rank, out in enumerate(got):
        # step 4's optimizer.step() committed v3; the state after step 4 died uncommitted
        assert (out["loaded"], out["resumed"], out["source"]) == (True, 3, "memory"), out
        assert out["diff"] == [[]] * 4, (rank, out["diff"])
