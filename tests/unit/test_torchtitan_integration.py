"""``baft.integrations.torchtitan`` without a process group: importing it without
torchtitan, the base class it picks with and without torchtitan (a fake, ``titan_fake``),
the disabled manager, what it refuses before ``protect`` (torchtitan options baft does not
implement, no pipeline, several optimizers per rank, LR schedulers it cannot place, expert
and context parallelism), the mesh it asks torchtitan's ``ParallelDims`` for, and the
baft configuration it derives. The trainer loop over real ranks is in
``tests/dist/test_torchtitan_manager.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from baft.integrations.titan_base import StandInCheckpointManager
from baft.integrations.torchtitan import (
    KEEP_ALL,
    BaftCheckpointManager,
    checkpoint_config,
    device_mesh_of,
    lr_scheduler_state,
    one_optimizer,
)
from tests.dist.titan_fake import LRSchedulersContainer, OptimizersContainer

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
{install}
import baft.integrations.torchtitan as m
base = m.BaftCheckpointManager.__mro__[1]
print(json.dumps({{
    "available": m.TORCHTITAN_AVAILABLE,
    "base": f"{{base.__module__}}.{{base.__qualname__}}",
    "config_base": m.BaftCheckpointManager.Config.__mro__[1].__qualname__,
    "owner": m.BaftCheckpointManager.Config._owner.__name__,
    "torchtitan": "torchtitan" in sys.modules,
    "dist": __import__("torch").distributed.is_initialized(),
}}))
"""


def _probe(install: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(install=install)],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_imports_without_torchtitan_on_the_stand_in() -> None:
    assert _probe("") == {
        "available": False,
        "base": "baft.integrations.titan_base.StandInCheckpointManager",
        "config_base": "StandInCheckpointManager.Config",
        "owner": "BaftCheckpointManager",
        "torchtitan": False,
        "dist": False,
    }


def test_derives_from_torchtitans_base_when_it_is_there() -> None:
    got = _probe("from tests.dist import titan_fake; titan_fake.install()")
    assert got == {
        "available": True,
        "base": "tests.dist.titan_fake.BaseCheckpointManager",
        "config_base": "BaseCheckpointManager.Config",
        "owner": "BaftCheckpointManager",
        "torchtitan": True,
        "dist": False,
    }


def _parts() -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))]


def _build(**config: Any) -> Any:
    parts = _parts()
    opts = OptimizersContainer(parts)
    return BaftCheckpointManager.Config(**config).build(
        dataloader=None, model_parts=parts, optimizers=opts,
        lr_schedulers=LRSchedulersContainer(opts), states={"train_state": object()},
        sd_adapter=None, base_folder="/tmp/unused",
    )  # fmt: skip


def test_disabled_manager_does_nothing() -> None:
    manager = _build(enable=False)
    assert isinstance(manager, StandInCheckpointManager)
    assert (manager.load(), manager.save(1), manager.maybe_wait_for_staging()) == (
        False, False, None,
    )  # fmt: skip
    manager.close()
    assert not hasattr(manager, "ft")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("load_step", 5),
        ("initial_load_path", "/ckpt/hf"),
        ("create_seed_checkpoint", True),
        ("exclude_from_loading", ["dataloader"]),
        ("load_only", True),
        ("last_save_in_hf", True),
        ("folder", "gs://bucket/ckpt"),
    ],
)
def test_refuses_torchtitan_options_it_does_not_implement(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"checkpoint.{option} "):
        _build(enable=True, **{option: value})


def test_refuses_a_job_without_pipeline_parallelism() -> None:
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        _build(enable=True)


def test_one_optimizer_per_rank() -> None:
    single = OptimizersContainer(_parts())
    assert one_optimizer(single) is single.optimizers[0]
    plain = torch.optim.SGD(_parts()[0].parameters(), lr=0.1)
    assert one_optimizer(plain) is plain
    with pytest.raises(ValueError, match=r"OptimizersContainer holds 2 \(AdamW, AdamW\)"):
        one_optimizer(OptimizersContainer(_parts(), per_part=2))
    with pytest.raises(ValueError, match="expected a torch optimizer"):
        one_optimizer(object())


def test_lr_schedulers_are_registered_as_torch_schedulers() -> None:
    one = LRSchedulersContainer(OptimizersContainer(_parts()))
    assert lr_scheduler_state(one) == {"lr_scheduler": one.schedulers[0]}
    two = LRSchedulersContainer(OptimizersContainer(_parts(), per_part=2))
    assert lr_scheduler_state(two) == {
        "lr_scheduler.0": two.schedulers[0],
        "lr_scheduler.1": two.schedulers[1],
    }
    assert lr_scheduler_state(one.schedulers[0]) == {"lr_scheduler": one.schedulers[0]}
    assert lr_scheduler_state(None) == {}
    with pytest.raises(ValueError, match="expected a torch LRScheduler"):
        lr_scheduler_state(object())


class FakeParallelDims:
    """The part of torchtitan's ParallelDims the manager reads."""

    def __init__(self, spmd_backend: str = "partial_dtensor", cp: int = 1, ep: int = 1) -> None:
        self.spmd_backend, self.cp, self.ep = spmd_backend, cp, ep
        self.calls: list[tuple[list[str], dict[str, Any]]] = []
        self.mesh = object()

    def get_optional_mesh(self, dims: list[str], **kw: Any) -> Any:
        self.calls.append((dims, kw))
        return self.mesh


def test_device_mesh_is_torchtitans_dense_mesh_passed_through() -> None:
    assert device_mesh_of(None) is None
    default = FakeParallelDims()
    assert device_mesh_of(default) is default.mesh
    assert default.calls == [
        (["pp", "dp_replicate", "fsdp", "tp"], {"include_singleton_axes": True})
    ]
    spmd = FakeParallelDims("spmd_types")
    assert device_mesh_of(spmd) is spmd.mesh
    assert spmd.calls[0][0] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    for kw, what in (({"cp": 2}, "context"), ({"ep": 4}, "expert")):
        with pytest.raises(ValueError, match=f"{what} parallelism"):
            device_mesh_of(FakeParallelDims(**kw))


def test_checkpoint_config_from_torchtitans_options() -> None:
    cfg = BaftCheckpointManager.Config(
        enable=True, interval=20, keep_latest_k=3, policy="redundancy=xor:2,full_every=auto",
        store_root="/dev/shm/x", keep_on_close=True,
    )  # fmt: skip
    ck = checkpoint_config(cfg, "out/checkpoint")
    p = ck.policy
    assert (p.persist_every, p.keep_latest, p.redundancy, p.full_every) == (20, 3, "xor:2", 0)
    assert (ck.store.root, ck.store.keep_on_close, ck.persist.dir) == (
        "/dev/shm/x", True, "out/checkpoint",
    )  # fmt: skip
    keep_all = BaftCheckpointManager.Config(keep_latest_k=0, policy="persist=7")
    p = checkpoint_config(keep_all, "f").policy
    assert (p.persist_every, p.keep_latest) == (7, KEEP_ALL)
    with pytest.raises(ValueError, match="policy item 'bogus' not understood"):
        checkpoint_config(BaftCheckpointManager.Config(policy="bogus"), "f")
