"""A small fake of torchtitan (not installed here) for the BaftCheckpointManager tests.

:func:`install` puts modules named ``torchtitan``, ``torchtitan.config`` and
``torchtitan.components.checkpointer`` into ``sys.modules`` with the parts of torchtitan's
interface the manager meets, restated from torchtitan's source (commit b5bcd76): the
``Configurable`` wiring (``Config`` dataclasses, ``build(**kw)``), ``BaseCheckpointManager``
(public methods dispatching to ``_``-hooks when enabled, its ``Config``),
``OptimizersContainer`` (a torch ``Optimizer`` subclass over one optimizer per model part,
``Optimizer.__init__`` called for its hooks), ``LRSchedulersContainer`` (one ``LambdaLR``
per optimizer, ``state_dict`` = ``last_epoch``) and a ``Trainer`` with the calls of
``Trainer.train``/``train_step`` in their order: ``load()`` before the loop; per step
``step += 1``, batches, ``zero_grad``, ``pp_schedule.step``, clipping,
``maybe_wait_for_staging()``, ``optimizers.step()``, ``lr_schedulers.step()``,
``save(step, last_step)``; ``close()``.
"""

from __future__ import annotations

import functools
import json
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
from torch import nn


class Configurable:
    @dataclass(kw_only=True, slots=True)
    class Config:
        _owner: ClassVar[type | None] = None

        def build(self, **kwargs: Any) -> Any:
            assert self._owner is not None, f"{type(self).__name__} has no owner class"
            overlap = {f.name for f in fields(self)} & kwargs.keys()
            if overlap:
                raise ValueError(f"build() kwargs {overlap} overlap with config fields")
            return self._owner(config=replace(self), **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_cls = cls.__dict__.get("Config")
        if config_cls is not None and issubclass(config_cls, Configurable.Config):
            if "__slots__" not in config_cls.__dict__:
                raise TypeError(
                    f"{cls.__name__}.Config must use @dataclass(kw_only=True, slots=True)"
                )
            for f in fields(config_cls):
                if f.init and not f.kw_only:
                    raise TypeError(f"{cls.__name__}.Config field {f.name!r} must be keyword-only")
            config_cls._owner = cls


class BaseCheckpointManager(Configurable, ABC):
    enable: bool
    save_future: Any

    def load(self, step: int = -1) -> bool:
        return self._load(step) if self.enable else False

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        return self._save(curr_step, last_step) if self.enable else False

    def maybe_wait_for_staging(self) -> None:
        if self.enable:
            self._maybe_wait_for_staging()

    def close(self) -> None:
        if getattr(self, "enable", False):
            self._close()

    def maybe_wait_for_saving(self) -> None:
        if self.enable and self.save_future is not None:
            self._wait_for_saving()

    @abstractmethod
    def _wait_for_saving(self) -> None: ...
    @abstractmethod
    def _load(self, step: int = -1) -> bool: ...
    @abstractmethod
    def _save(self, curr_step: int, last_step: bool = False) -> bool: ...
    @abstractmethod
    def _maybe_wait_for_staging(self) -> None: ...
    @abstractmethod
    def _close(self) -> None: ...

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enable: bool = False
        folder: str = "checkpoint"
        interval: int = 500
        initial_load_path: str | None = None
        initial_load_model_only: bool = True
        last_save_model_only: bool = True
        last_save_in_hf: bool = False
        keep_latest_k: int = 10
        load_step: int = -1
        exclude_from_loading: list[str] = field(default_factory=list)
        enable_first_step_checkpoint: bool = False
        create_seed_checkpoint: bool = False
        load_only: bool = False

        def __post_init__(self) -> None:
            if self.interval < 1:
                raise ValueError("Checkpoint interval needs to be at least 1 step.")
            if self.keep_latest_k == 1:
                raise ValueError("We need to maintain at least 2 checkpoint replicas")


def install() -> None:
    """Make ``import torchtitan.components.checkpointer`` find this fake."""
    if "torchtitan" in sys.modules:
        return
    mods = {
        name: types.ModuleType(name)
        for name in ("torchtitan", "torchtitan.config", "torchtitan.components",
                     "torchtitan.components.checkpointer")
    }  # fmt: skip
    for name, mod in mods.items():
        mod.__path__ = []  # type: ignore[attr-defined]  # a package
        sys.modules[name] = mod
    mods["torchtitan.config"].Configurable = Configurable  # type: ignore[attr-defined]
    ckpt = mods["torchtitan.components.checkpointer"]
    ckpt.BaseCheckpointManager = BaseCheckpointManager  # type: ignore[attr-defined]


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's container: one optimizer per model part, named param groups."""

    def __init__(self, model_parts: list[nn.Module], per_part: int = 1) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        all_params: list[nn.Parameter] = []
        for part in model_parts:
            named = list(part.named_parameters())
            for k in range(per_part):
                mine = named[k::per_part]
                group = {"params": [p for _, p in mine], "param_names": [n for n, _ in mine],
                         "lr": 0.01, "weight_decay": 0.1, "fused": True, "foreach": False}  # fmt: skip
                self.optimizers.append(torch.optim.AdamW([group]))
                all_params.extend(p for _, p in mine)
        torch.optim.Optimizer.__init__(self, all_params, {})  # for the step hooks

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _warmup(warmup: int, step: int) -> float:
    return min(1.0, (step + 1) / warmup)


class LRSchedulersContainer:
    def __init__(self, optimizers: OptimizersContainer) -> None:
        lr_lambda = functools.partial(_warmup, 3)  # torchtitan builds a partial too
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in optimizers.optimizers
        ]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.last_epoch = state_dict["last_epoch"]


class DataLoader:
    """Stateful like torchtitan's Grain loader: its rank's state as bytes."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        g = torch.Generator().manual_seed(self.position)
        return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "dp_rank_0": json.dumps({"position": self.position}).encode()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = json.loads(state["dp_rank_0"].decode())["position"]


class Trainer:
    """The calls of torchtitan's Trainer, in order, over a 2-stage GPipe pipeline."""

    def __init__(self, rank: int, world: int, checkpoint: Any, dump_folder: str) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        torch.manual_seed(100 + rank)
        part = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 8))
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        self.rank, self.last = rank, rank == world - 1
        self.pp_schedule = ScheduleGPipe(
            stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
        )
        self.parallel_dims = None
        self.model_parts: list[nn.Module] = [part]
        self.optimizers = OptimizersContainer(self.model_parts)
        self.lr_schedulers = LRSchedulersContainer(self.optimizers)
        self.step = 0
        self.ntokens_seen = 0
        self.dataloader = DataLoader()
        self.checkpointer = checkpoint.build(
            dataloader=self.dataloader, model_parts=self.model_parts,
            optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
            states={"train_state": self}, sd_adapter=None, base_folder=dump_folder,
        )  # fmt: skip

    def train_step(self) -> None:
        self.optimizers.zero_grad()
        x, y = self.dataloader.next_batch()
        self.ntokens_seen += x.numel()
        if self.rank == 0:
            self.pp_schedule.step(x)
        else:
            self.pp_schedule.step(target=y, losses=[] if self.last else None)
        nn.utils.clip_grad_norm_(self.model_parts[0].parameters(), 1.0)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()

    def train(self, steps: int, after_step: Callable[[Trainer], None] = lambda _: None) -> bool:
        loaded = self.checkpointer.load(step=-1)
        after_step(self)  # the state the loop starts from
        while self.step < steps:
            self.step += 1
            self.train_step()
            self.checkpointer.save(self.step, last_step=self.step == steps)
            after_step(self)
        return loaded

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]

    def close(self) -> None:
        self.checkpointer.close()

    def snapshot(self) -> dict[str, Any]:
        """Copies of everything a restore must bring back, by name."""
        opt = self.optimizers.optimizers[0]
        names = dict(
            zip(opt.param_groups[0]["params"], opt.param_groups[0]["param_names"], strict=True)
        )
        out: dict[str, Any] = {f"model.{k}": v.detach().clone()
                               for k, v in self.model_parts[0].state_dict().items()}  # fmt: skip
        for p, st in opt.state.items():
            out.update({f"optim.{names[p]}.{k}": v.clone() for k, v in st.items()})
        out["lr"] = [g["lr"] for g in opt.param_groups]
        out["scheduler"] = self.lr_schedulers.schedulers[0].state_dict()
        out["rng"] = torch.get_rng_state()
        out["train_state"] = self.state_dict()
        out["data"] = self.dataloader.position
        return out
