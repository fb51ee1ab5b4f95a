"""``baft.integrations.torchtitan`` without a process group: importing it without
torchtitan (its absence simulated in a subprocess), the base class it picks with and
without torchtitan (torchtitan 0.3.0's ``BaseCheckpointManager``, a dev dependency, or
baft's stand-in), the disabled manager, what it refuses before ``protect`` (torchtitan
options baft does not implement, no pipeline, several optimizers per rank, LR schedulers
it cannot place, expert and context parallelism), the mesh it asks torchtitan's
``ParallelDims`` for, and the baft configuration it derives. The optimizers and LR
schedulers are torchtitan's own containers. The trainer loop over real ranks is in
``tests/dist/test_torchtitan_manager.py``."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
    default_adamw,
)
from torchtitan.distributed import ParallelDims

from baft.integrations.titan_base import StandInCheckpointManager
from baft.integrations.torchtitan import (
    KEEP_ALL,
    BaftCheckpointManager,
    checkpoint_config,
    device_mesh_of,
    lr_scheduler_state,
    one_optimizer,
)

REPO = Path(__file__).resolve().parents[2]

# Makes torchtitan unimportable, as if not installed: the import system asks this finder
# first and it raises what a missing top-level package raises (name="torchtitan").
_BLOCK_TORCHTITAN = """
class _NoTorchtitan:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torchtitan" or name.startswith("torchtitan."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTorchtitan)
"""

_PROBE = """
import json, sys
{block}
import baft.integrations.torchtitan as m
base = m.BaftCheckpointManager.__mro__[1]
off = m.BaftCheckpointManager.Config(enable=False).build(
    dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={{}},
)
print(json.dumps({{
    "available": m.TORCHTITAN_AVAILABLE,
    "base": f"{{base.__module__}}.{{base.__qualname__}}",
    "config_base": m.BaftCheckpointManager.Config.__mro__[1].__qualname__,
    "owner": m.BaftCheckpointManager.Config._owner.__name__,
    "disabled": [off.load(), off.save(1), off.maybe_wait_for_staging()],
    "torchtitan": any(k.partition(".")[0] == "torchtitan" for k in sys.modules),
    "dist": __import__("torch").distributed.is_initialized(),
}}))
"""


def _probe(block: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(block=block)],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_imports_without_torchtitan_on_the_stand_in() -> None:
    assert _probe(_BLOCK_TORCHTITAN) == {
        "available": False,
        "base": "baft.integrations.titan_base.StandInCheckpointManager",
        "config_base": "StandInCheckpointManager.Config",
        "owner": "BaftCheckpointManager",
        "disabled": [False, False, None],
        "torchtitan": False,
        "dist": False,
    }


def test_derives_from_torchtitans_base_when_it_is_there() -> None:
    from importlib.metadata import version

    assert version("torchtitan") == "0.3.0"  # the version the stand-in restates
    assert _probe("") == {
        "available": True,
        "base": "torchtitan.components.checkpointer.base.BaseCheckpointManager",
        "config_base": "BaseCheckpointManager.Config",
        "owner": "BaftCheckpointManager",
        "disabled": [False, False, None],
        "torchtitan": True,
        "dist": False,
    }


def test_stand_in_config_restates_torchtitans_defaults() -> None:
    real = {f.name: f for f in dataclasses.fields(BaseCheckpointManager.Config)}
    stand_in = dataclasses.fields(StandInCheckpointManager.Config)
    assert len(stand_in) == 10
    for f in stand_in:
        assert f.name in real, f.name
        assert (f.default, f.default_factory) == (
            real[f.name].default,
            real[f.name].default_factory,
        ), f.name


def _parts(n: int = 1) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)) for _ in range(n)]


def _optimizers(parts: list[nn.Module]) -> OptimizersContainer:
    """torchtitan's container, as its Trainer builds it (``optimizer=default_adamw(...)``):
    one AdamW per model part."""
    return default_adamw(lr=0.1).build(model_parts=parts)


def _schedulers(optimizers: OptimizersContainer) -> LRSchedulersContainer:
    """torchtitan's warmup + decay container: one ``LambdaLR`` per inner optimizer."""
    return LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=10
    )


def _build(**config: Any) -> Any:
    parts = _parts()
    opts = _optimizers(parts)
    return BaftCheckpointManager.Config(**config).build(
        dataloader=None, model_parts=parts, optimizers=opts,
        lr_schedulers=_schedulers(opts), states={"train_state": object()},
        sd_adapter=None, base_folder="/tmp/unused",
    )  # fmt: skip


def test_disabled_manager_does_nothing() -> None:
    manager = _build(enable=False)
    assert isinstance(manager, BaseCheckpointManager)
    assert (
        manager.load(), manager.save(1), manager.maybe_wait_for_staging(),
        manager.maybe_wait_for_saving(),
    ) == (False, False, None, None)  # fmt: skip
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
    single = _optimizers(_parts())
    assert len(single.optimizers) == 1
    assert one_optimizer(single) is single.optimizers[0]
    plain = torch.optim.SGD(_parts()[0].parameters(), lr=0.1)
    assert one_optimizer(plain) is plain
    with pytest.raises(ValueError, match=r"OptimizersContainer holds 2 \(AdamW, AdamW\)"):
        one_optimizer(_optimizers(_parts(2)))  # two model parts on this rank
    mixed = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r"^0\.", optimizer_name="Adam", optimizer_kwargs={"lr": 0.1}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.1}),
        ]
    ).build(model_parts=_parts())
    with pytest.raises(ValueError, match=r"OptimizersContainer holds 2 \(Adam, AdamW\)"):
        one_optimizer(mixed)  # two optimizer types in one part's param_groups
    with pytest.raises(ValueError, match="expected a torch optimizer"):
        one_optimizer(object())


def test_lr_schedulers_are_registered_as_torch_schedulers() -> None:
    one = _schedulers(_optimizers(_parts()))
    assert lr_scheduler_state(one) == {"lr_scheduler": one.schedulers[0]}
    two = _schedulers(_optimizers(_parts(2)))
    assert len(two.schedulers) == 2
    assert lr_scheduler_state(two) == {
        "lr_scheduler.0": two.schedulers[0],
        "lr_scheduler.1": two.schedulers[1],
    }
    assert lr_scheduler_state(one.schedulers[0]) == {"lr_scheduler": one.schedulers[0]}
    assert lr_scheduler_state(None) == {}
    with pytest.raises(ValueError, match="expected a torch LRScheduler"):
        lr_scheduler_state(object())


def _parallel_dims(spmd_backend: str = "partial_dtensor", cp: int = 1, ep: int = 1) -> Any:
    """torchtitan's own ``ParallelDims`` (pp=2, its degrees validated by its
    ``__post_init__``) whose ``get_optional_mesh`` only records the call: the real one
    builds the meshes with ``init_device_mesh``, which needs a process group. Each call is
    bound to the real method's signature first, so a keyword torchtitan does not take
    fails here."""
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=cp, tp=1, pp=2, ep=ep, world_size=2 * cp,
        spmd_backend=spmd_backend,  # type: ignore[arg-type]
    )  # fmt: skip
    real = inspect.signature(ParallelDims.get_optional_mesh)
    calls: list[tuple[list[str], dict[str, Any]]] = []
    mesh = object()

    def get_optional_mesh(names: list[str], **kw: Any) -> Any:
        real.bind(dims, names, **kw)
        calls.append((names, kw))
        return mesh

    dims.get_optional_mesh = get_optional_mesh  # type: ignore[method-assign]
    dims.calls, dims.mesh = calls, mesh  # type: ignore[attr-defined]
    return dims


def test_device_mesh_is_torchtitans_dense_mesh_passed_through() -> None:
    assert device_mesh_of(None) is None
    default = _parallel_dims()
    assert device_mesh_of(default) is default.mesh
    assert default.calls == [
        (["pp", "dp_replicate", "fsdp", "tp"], {"include_singleton_axes": True})
    ]
    for backend in ("spmd_types", "full_dtensor"):  # their meshes keep dp_shard, no fsdp
        spmd = _parallel_dims(backend)
        assert device_mesh_of(spmd) is spmd.mesh
        assert spmd.calls[0][0] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    for refused, what in ((_parallel_dims(cp=2), "context"), (_parallel_dims(ep=4), "expert")):
        with pytest.raises(ValueError, match=f"{what} parallelism"):
            device_mesh_of(refused)
        assert refused.calls == []


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
