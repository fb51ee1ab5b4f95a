"""baft as torchtitan's checkpoint manager: in-memory checkpoints of every step.

In a torchtitan config (``config_registry`` function)::

    from baft.integrations.torchtitan import BaftCheckpointManager
    checkpoint=BaftCheckpointManager.Config(enable=True, interval=50,
                                            policy="redundancy=xor:2,full_every=auto")

torchtitan's ``Trainer`` builds the manager with its model parts, ``OptimizersContainer``,
``LRSchedulersContainer``, dataloader and ``states={"train_state": trainer}``; the manager
finds the pipeline schedule (``trainer.pp_schedule``) and the device mesh
(``trainer.parallel_dims``) on that trainer and calls :func:`baft.protect` once, at
construction (a refusal happens there, before the first step). The Trainer's calls map
onto baft's:

* ``load()`` -> ``ft.restore()``: the newest version baft can rebuild (memory, else its
  DCP tier), then a check that the trainer's ``step`` equals the restored version.
* ``maybe_wait_for_staging()`` (just before ``optimizers.step()``): nothing to do; baft's
  optimizer step pre-hook, which runs first thing in that ``step()``, is the deadline.
* ``save(step)`` (after every step): baft's post-hook already ended the step (version
  ``step - 1`` committed, the state after ``step`` to be copied in the next step's idle
  windows); ``save`` checks that torchtitan's step and baft's optimizer-step count agree.
* ``close()`` -> ``ft.close()``.

What is saved with every version: each model part's parameters and persistent buffers,
the optimizer's state and hyperparameters, the RNG, the LR scheduler (torch's
``LambdaLR`` inside torchtitan's container, captured after its ``step()``), the
dataloader and the trainer's ``state_dict()`` (``step``, ``ntokens_seen``). Persisted
versions go to ``<dump_folder>/<checkpoint.folder>`` every ``interval`` steps, in baft's
DCP layout (``v%08d`` directories, baft's keys; see the README), not torchtitan's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from baft.config import CheckpointConfig, CheckpointPolicy, PersistConfig, StoreConfig
from baft.integrations.titan_base import TORCHTITAN_AVAILABLE, BaseManager

__all__ = ["TORCHTITAN_AVAILABLE", "BaftCheckpointManager"]

log = logging.getLogger("baft")

KEEP_ALL = 1 << 30
"""``keep_latest`` for torchtitan's ``keep_latest_k=0`` (keep every persisted version)."""


def _refuse_unsupported(config: Any) -> None:
    """ValueError naming the first torchtitan checkpoint option baft does not implement."""
    unsupported = {
        "load_step": (config.load_step != -1, "baft restores the newest version it can rebuild"),
        "initial_load_path": (
            bool(config.initial_load_path),
            "start from an initial checkpoint with torchtitan's CheckpointManager, then "
            "switch to baft",
        ),
        "create_seed_checkpoint": (config.create_seed_checkpoint, "use CheckpointManager"),
        "exclude_from_loading": (
            bool(config.exclude_from_loading),
            "a baft version is restored whole (model, optimizer, scheduler, data, RNG)",
        ),
        "load_only": (config.load_only, "baft checkpoints every step"),
        "last_save_in_hf": (config.last_save_in_hf, "no Hugging Face export"),
    }
    for name, (used, why) in unsupported.items():
        if used:
            raise ValueError(f"BaftCheckpointManager: checkpoint.{name} is not supported ({why})")
    if "://" in config.folder:
        raise ValueError(
            f"BaftCheckpointManager: checkpoint.folder {config.folder!r} is a remote URI; "
            "baft persists to a local or mounted file system"
        )


def one_optimizer(optimizers: Any) -> torch.optim.Optimizer:
    """The one torch optimizer ``baft.protect`` takes, from torchtitan's
    ``OptimizersContainer`` (an ``Optimizer`` subclass holding one optimizer per model
    part and optimizer type in ``.optimizers``): the container's ``step()`` calls the inner
    optimizer's, so baft's hooks on the inner one run inside ``optimizers.step()``. A
    container with several inner optimizers is refused (baft protects one optimizer per
    rank); a plain torch optimizer is taken as it is."""
    inner = getattr(optimizers, "optimizers", None)
    if inner is None:
        if not isinstance(optimizers, torch.optim.Optimizer):
            raise ValueError(f"optimizers: expected a torch optimizer, got {type(optimizers)}")
        return optimizers
    inner = list(inner)
    if len(inner) != 1:
        kinds = ", ".join(type(o).__name__ for o in inner)
        raise ValueError(
            f"BaftCheckpointManager protects one optimizer per rank; this rank's "
            f"OptimizersContainer holds {len(inner)} ({kinds}): use one model part per "
            "pipeline rank (a single-stage schedule: 1F1B, GPipe) and one optimizer type "
            "in optimizer.param_groups"
        )
    return inner[0]


def lr_scheduler_state(lr_schedulers: Any) -> dict[str, Any]:
    """The LR schedulers as ``state=`` entries: torch's ``LRScheduler`` objects inside
    torchtitan's ``LRSchedulersContainer`` (``.schedulers``), registered one by one because
    baft recognises LR schedulers by type and captures them after their ``step()``, which
    follows ``optimizers.step()``; the container itself is no ``LRScheduler``."""
    kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if lr_schedulers is None:
        return {}
    if isinstance(lr_schedulers, kinds):
        return {"lr_scheduler": lr_schedulers}
    inner = list(getattr(lr_schedulers, "schedulers", None) or ())
    if not inner or not all(isinstance(s, kinds) for s in inner):
        raise ValueError(
            "lr_schedulers: expected a torch LRScheduler or a container of them in "
            f".schedulers (torchtitan's LRSchedulersContainer), got {type(lr_schedulers)}"
        )
    if len(inner) == 1:
        return {"lr_scheduler": inner[0]}
    return {f"lr_scheduler.{i}": s for i, s in enumerate(inner)}


def device_mesh_of(parallel_dims: Any) -> Any:
    """The dense mesh of torchtitan's ``ParallelDims`` with every axis, size-1 ones too:
    ``(pp, dp_replicate, fsdp, tp)`` (``spmd_backend="partial_dtensor"`` folds ``dp_shard``
    and ``cp`` into ``fsdp``) or ``(pp, dp_replicate, dp_shard, cp, tp)`` with
    ``"spmd_types"`` (0.3.0's default) and ``"full_dtensor"``, whose meshes keep
    ``dp_shard`` and ``cp`` apart (torchtitan ``ParallelDims.build_mesh``). None without ``parallel_dims`` (``protect`` then makes
    its own). baft interprets the axes (``protect``); refused here are the torchtitan
    dimensions outside this mesh: expert parallelism, and context parallelism (hidden in
    ``fsdp``)."""
    if parallel_dims is None:
        return None
    for dim, what in (("ep", "expert"), ("cp", "context")):
        if getattr(parallel_dims, dim, 1) > 1:
            raise ValueError(
                f"BaftCheckpointManager: {what} parallelism ({dim}>1) is not supported"
            )
    if getattr(parallel_dims, "spmd_backend", "") in ("spmd_types", "full_dtensor"):
        dims = ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    else:
        dims = ["pp", "dp_replicate", "fsdp", "tp"]
    return parallel_dims.get_optional_mesh(dims, include_singleton_axes=True)


def checkpoint_config(config: Any, folder: str) -> CheckpointConfig:
    """baft's configuration from a ``BaftCheckpointManager.Config``: its ``policy`` text,
    with torchtitan's ``interval`` as ``persist_every`` and ``keep_latest_k`` as
    ``keep_latest`` unless the text sets ``persist=``/``keep=``; persisted into ``folder``."""
    given = {i.partition("=")[0].strip() for i in config.policy.split(",") if i.strip()}
    overrides: dict[str, Any] = {}
    if "persist" not in given:
        overrides["persist_every"] = config.interval
    if "keep" not in given:
        overrides["keep_latest"] = config.keep_latest_k or KEEP_ALL
    return CheckpointConfig(
        policy=dataclasses.replace(CheckpointPolicy.parse(config.policy), **overrides),
        store=StoreConfig(root=config.store_root, keep_on_close=config.keep_on_close),
        persist=PersistConfig(dir=folder),
    )


def _check_model_parts(stages: Sequence[Any], model_parts: Sequence[nn.Module]) -> None:
    parts = [s.submod for s in stages]
    if len(parts) != len(model_parts) or any(
        a is not b for a, b in zip(parts, model_parts, strict=True)
    ):
        raise ValueError(
            "BaftCheckpointManager: the pipeline schedule's stages do not run the model "
            "parts torchtitan gave the checkpointer (model_parts[i] must be stage i's submod)"
        )


class _RngNeutralLoader:
    """torchtitan's data loader (a ``torchdata`` ``StatefulDataLoader``) as a ``state=``
    object whose ``state_dict()`` leaves the RNG and the loader as they were.

    ``StatefulDataLoader.state_dict()`` before the loop's ``iter()`` creates the iterator,
    which draws its base seed from the global RNG (torch's ``_BaseDataLoaderIter``), and
    takes the state loaded by ``load_state_dict`` (``next_iter_state``); ``iter()`` then
    reuses it. baft reads the state at ``protect`` and after a restore, before the loop:
    the draw would move there (after a restore: one draw more than the run that never
    failed). Here that iterator is dropped and the RNG and the loaded state put back, so
    the loop's ``iter()`` creates it and draws as without baft."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @staticmethod
    def wrap(loader: Any) -> Any:
        if not hasattr(loader, "_initial_iter_for_state_dict"):
            return loader  # not a torchdata StatefulDataLoader: taken as it is
        return _RngNeutralLoader(loader)

    def state_dict(self) -> dict[str, Any]:
        loader = self.loader
        if loader._iterator is not None:
            return dict(loader.state_dict())
        rng, pending = torch.get_rng_state(), loader.next_iter_state
        try:
            return dict(loader.state_dict())
        finally:
            loader._iterator, loader._initial_iter_for_state_dict = None, False
            loader.next_iter_state = pending
            torch.set_rng_state(rng)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


class BaftCheckpointManager(BaseManager):
    """torchtitan checkpoint manager that protects every step with baft (module docstring).

    Pipeline parallel jobs only (baft protects a ``torch.distributed.pipelining``
    schedule), one model part and one optimizer per rank. ``schedule`` and
    ``device_mesh`` override what is found on ``states["train_state"]``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseManager.Config):
        """torchtitan's checkpoint options (``interval``: persist every N-th version;
        ``keep_latest_k``: persisted versions kept) plus baft's."""

        policy: str = ""
        """baft's ``CheckpointPolicy.parse`` text, e.g. ``redundancy=xor:2,full_every=auto``;
        its ``persist=``/``keep=`` override ``interval``/``keep_latest_k``."""
        store_root: str = "/dev/shm/baft"
        """Where the in-memory snapshot stores live (a tmpfs that survives the trainer)."""
        keep_on_close: bool = False
        """Keep the stores when the job ends cleanly (to continue it from memory)."""
        ranks_per_node: int = 0
        """Ranks per host (0: torchrun's ``LOCAL_WORLD_SIZE``, else baft's default)."""
        state_capacity_bytes: int = 64 << 10
        """Bytes reserved for each small state object (dataloader, train state, scheduler)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
        schedule: Any = None,
        device_mesh: Any = None,
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        from baft.api import protect
        from baft.pipeline.adapter import schedule_stages

        self.save_future = None
        self.folder = os.path.join(base_folder, config.folder)
        self.keep_latest_k = config.keep_latest_k
        _refuse_unsupported(config)
        train_state = states.get("train_state")
        schedule = schedule if schedule is not None else getattr(train_state, "pp_schedule", None)
        if schedule is None:
            raise ValueError(
                "BaftCheckpointManager needs pipeline parallelism (a torch pipelining "
                "schedule: trainer.pp_schedule, or schedule=): set "
                "parallelism.pipeline_parallel_degree > 1"
            )
        if device_mesh is None:
            device_mesh = device_mesh_of(getattr(train_state, "parallel_dims", None))
        optimizer = one_optimizer(optimizers)
        stages = schedule_stages(schedule)
        _check_model_parts(stages, model_parts)
        self._train_state = train_state
        self._schedule = schedule
        self.ft = protect(
            schedule=schedule,
            stages=stages,
            optimizer=optimizer,
            run_dir=os.path.join(self.folder, "baft"),
            device_mesh=device_mesh,
            checkpoint=self.checkpoint_config(config),
            ranks_per_node=config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)),
            state=self._state_objects(states, dataloader, lr_schedulers),
            average_gradients=False,  # torchtitan's FSDP2/DDP reduce the gradients
            extra_capacity_bytes=config.state_capacity_bytes,
        )
        """The :class:`baft.api.Protected` run (``metrics``, ``last_step``, ``inject``)."""

    def checkpoint_config(self, config: Config) -> CheckpointConfig:
        """baft's configuration (override to set more of baft's options)."""
        return checkpoint_config(config, self.folder)

    @staticmethod
    def _state_objects(
        states: Mapping[str, Any], dataloader: Any, lr_schedulers: Any
    ) -> dict[str, Any]:
        out = dict(states)
        if dataloader is not None:
            out["dataloader"] = _RngNeutralLoader.wrap(dataloader)
        out.update(lr_scheduler_state(lr_schedulers))
        return out

    @property
    def metrics(self) -> dict[str, Any]:
        """baft's metrics of the last step (committed version, bytes, seconds)."""
        return self.ft.metrics

    def _load(self, step: int = -1) -> bool:
        if step != -1:
            raise ValueError(
                f"BaftCheckpointManager.load(step={step}): baft restores the newest "
                "version it can rebuild (load_step=-1)"
            )
        resume = self.ft.restore()
        trainer_step = getattr(self._train_state, "step", None)
        if isinstance(trainer_step, int) and trainer_step != resume:
            raise RuntimeError(
                f"baft restored version {resume} (the state after {resume} optimizer "
                f"steps) but the restored train_state says step {trainer_step}"
            )
        log.info("torchtitan: %s", f"resumed at step {resume}" if resume else "fresh start")
        if resume > 0:
            self._rng_again_at_next_step()
        return resume > 0

    def _rng_again_at_next_step(self) -> None:
        """Put the restored RNG back when the next step's pipeline schedule runs.

        ``Trainer.train()`` calls ``load()`` and then creates its data iterator
        (``batch_generator(self.dataloader)``), and a torch ``DataLoader`` iterator draws
        its base seed from the global RNG when created (``_BaseDataLoaderIter``). A run
        that never failed drew it before step 1, so the restored version already holds that
        draw: without this, a resumed job would draw once more, and dropout of every later
        step would differ from the run that never failed."""
        schedule = self._schedule
        inner = schedule.step
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None

        def step(*args: Any, **kwargs: Any) -> Any:
            if schedule.__dict__.get("step") is step:
                schedule.step = inner
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)
            return inner(*args, **kwargs)

        schedule.step = step

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        taken = self.ft.iteration
        if self.ft.runner.in_iteration or taken != curr_step:
            raise RuntimeError(
                f"torchtitan saves step {curr_step} but baft counted {taken} optimizer "
                "steps" + (" and the step's optimizer.step() has not run" if
                           self.ft.runner.in_iteration else "") + ": call save(step) "
                "after the step's optimizers.step(), once per step, with trainer.step "
                "counting optimizer steps (as torchtitan's Trainer does)"
            )  # fmt: skip
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Nothing: ``optimizers.step()`` follows at once and baft's step pre-hook in it is
        the snapshot deadline (the state is unchanged until then)."""

    def _wait_for_saving(self) -> None:
        """Never called: ``save_future`` stays None (baft persists in the background)."""

    def _close(self) -> None:
        if getattr(self, "ft", None) is not None:
            self.ft.close()
