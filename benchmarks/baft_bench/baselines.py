"""Checkpointing as people do it today, as :class:`~baft.train.trainer.StepHooks`.

Each mode checkpoints on the iterations divisible by its ``every`` (the engine's rule;
1 = every iteration: ``baft bench overhead`` passes ``--interval`` x ``--persist-every``,
so that ``baft-persist`` writes to disk on the same iterations) and reports, in ``last_metrics`` after each step,
the main-thread seconds it spent outside waits (``exposed_s``), inside waits
(``in_bubble_s``, always 0 here: none of these modes knows about bubbles) and the bytes
it protected (``bytes``). ``enabled`` switches a mode off without tearing it down;
``drain`` waits for its background work; ``close`` releases threads and stagers.

- ``torch-save``: synchronous ``torch.save`` + fsync of model and optimizer state dicts
  after the optimizer step.
- ``dcp-async``: ``torch.distributed.checkpoint.async_save`` (thread mode, like
  torchtitan's ``async``) on a dedicated gloo group; the previous save is awaited first.
  With ``async_staging`` (the bench's emulated compute, where baft gets a copy thread
  that plays the DMA engine) the staging copy runs on DCP's own staging thread too
  (explicit :class:`StagingOptions`: the defaults fail on CPU), and the next optimizer
  step waits for it, as torchtitan does; otherwise staging is synchronous.
- ``checkfreq``: CheckFreq's two phases: a synchronous copy into preallocated host
  buffers before the optimizer step, then ``torch.save`` + fsync of that copy on a
  background thread; the next snapshot waits for the previous persist.

Each mode also says which version its newest checkpoint holds (``saved_version``: the
state at the start of that iteration) and hands it back as saved
(:meth:`checkpoint`), for the restore check (:mod:`baft_bench.restorecheck`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from baft.engine.transport import destroy_group
from baft.pipeline import IterationTimeline
from baft.train.trainer import Trainer
from baft_bench.modes import ALL_MODES, BASELINE_MODES, ENGINE_MODES

__all__ = ["ALL_MODES", "BASELINE_MODES", "ENGINE_MODES", "make_baseline", "state_nbytes"]


class BenchMode(Protocol):
    """A StepHooks object with the switches and metrics the benchmark reads."""

    enabled: bool
    last_metrics: dict[str, float]

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None: ...

    def on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None: ...

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None: ...

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None: ...


def empty_metrics() -> dict[str, float]:
    return {"in_bubble_s": 0.0, "exposed_s": 0.0, "bytes": 0.0, "disk_saves": 0.0}


def state_nbytes(trainer: Trainer) -> int:
    """Bytes of this rank's checkpointable state (model + optimizer tensors)."""
    return sum(t.numel() * t.element_size() for _, t in trainer.named_state())


def _fsync_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, fsync, then atomically rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _BaselineHooks:
    """Shared bookkeeping: per-iteration metrics reset on the first hook of an iteration."""

    def __init__(self, trainer: Trainer, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        self.trainer = trainer
        self.every = every
        """Checkpoint on the iterations divisible by it."""
        self.saved_version: int | None = None
        """The version the newest checkpoint holds (once its background work is done)."""
        self.enabled = True
        self.last_metrics = empty_metrics()
        self._iteration = -1
        self._future: Future[Any] | None = None
        """The background save in flight, if the mode has one."""

    def _begin(self, iteration: int) -> None:
        if iteration != self._iteration:
            self._iteration = iteration
            self.last_metrics = empty_metrics()

    def due(self, iteration: int) -> bool:
        """Whether the mode checkpoints in ``iteration`` (on and on its cadence)."""
        return self.enabled and iteration % self.every == 0

    def checkpoint(self) -> tuple[Any, Any] | None:
        """The newest checkpoint as saved and the live object of the same structure it
        was saved from (:func:`baft_bench.restorecheck.canonical` maps both to state
        names); None when the mode has none. Collective for modes that save collectively."""
        return None

    def _account(self, start: float, nbytes: int = 0) -> None:
        self.last_metrics["exposed_s"] += time.perf_counter() - start
        self.last_metrics["bytes"] += nbytes
        self.last_metrics["disk_saves"] += 1 if nbytes else 0

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)

    def on_slot(self, slot_id: str, kind: str, timeline: IterationTimeline) -> None:
        self._begin(timeline.iteration)

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)

    def drain(self) -> None:
        """Wait for the background save in flight, if any."""
        if self._future is not None:
            self._future.result()
            self._future = None

    def close(self) -> None:
        self.drain()


class TorchSaveHooks(_BaselineHooks):
    """Synchronous ``torch.save`` + fsync of model and optimizer state after each step."""

    def __init__(self, trainer: Trainer, directory: Path, every: int = 1) -> None:
        super().__init__(trainer, every)
        self.path = Path(directory) / f"rank{trainer.mesh.rank}.pt"

    def _live(self) -> dict[str, Any]:
        model = {k: v for m in self.trainer.modules for k, v in m.state_dict().items()}
        return {"model": model, "optim": self.trainer.optimizer.state_dict()}

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)
        if not self.due(iteration):
            return
        start = time.perf_counter()
        _fsync_save(self._live(), self.path)
        self.saved_version = iteration + 1
        self._account(start, state_nbytes(self.trainer))

    def checkpoint(self) -> tuple[Any, Any] | None:
        if self.saved_version is None:
            return None
        return torch.load(self.path, weights_only=True), self._live()


class DcpAsyncHooks(_BaselineHooks):
    """``dcp.async_save`` in thread mode on a dedicated gloo group, after each step.

    Staging is synchronous (a copy into CPU memory inside ``async_save``): on CPU the
    default staging options (pinned memory, non-blocking copies) are unavailable, so the
    stager gets explicit all-False :class:`StagingOptions`. ``group`` must be created
    collectively (``dist.new_group(backend="gloo")``) on every rank.
    """

    def __init__(
        self,
        trainer: Trainer,
        directory: Path,
        group: dist.ProcessGroup,
        every: int = 1,
        *,
        async_staging: bool = False,
    ) -> None:
        super().__init__(trainer, every)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.directory = Path(directory)
        self.group: dist.ProcessGroup | None = group
        self.async_staging = async_staging
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=async_staging,
                use_non_blocking_copy=False,
            )
        )
        self._staging: Future[Any] | None = None
        """The staging copy in flight (``async_staging``): the next step waits for it."""
        self._pending_version: int | None = None

    def _wait_staging(self) -> None:
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)
        if self._staging is None:
            return
        start = time.perf_counter()
        self._wait_staging()  # the step must not change what is being staged
        self._account(start)

    def drain(self) -> None:
        self._wait_staging()
        super().drain()
        if self._pending_version is not None:
            self.saved_version, self._pending_version = self._pending_version, None

    def checkpoint(self) -> tuple[Any, Any] | None:
        import torch.distributed.checkpoint as dcp

        self.drain()
        if self.saved_version is None:
            return None
        live = dict(self.trainer.named_state())
        # poisoned buffers of the live layout: a tensor DCP does not write stays NaN
        fresh = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else
                 torch.full_like(v, -1) for k, v in live.items()}  # fmt: skip
        dcp.load(fresh, checkpoint_id=self.directory, process_group=self.group)
        return fresh, live

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
        )

        self._begin(iteration)
        if not self.due(iteration):
            return
        start = time.perf_counter()
        self.drain()
        state = dict(self.trainer.named_state())
        writer = dcp.FileSystemWriter(self.directory, sync_files=True, overwrite=True)
        response = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=self.group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self._stager,
        )
        if isinstance(response, AsyncSaveResponse):
            self._staging = response.staging_completion if self.async_staging else None
            response = response.upload_completion
        self._future = response
        self._pending_version = iteration + 1
        self._account(start, sum(t.numel() * t.element_size() for t in state.values()))

    def close(self) -> None:
        super().close()
        self._stager.close()
        group, self.group = self.group, None
        destroy_group(group)


class CheckFreqHooks(_BaselineHooks):
    """CheckFreq: synchronous snapshot into preallocated buffers, background persist."""

    def __init__(self, trainer: Trainer, directory: Path, every: int = 1) -> None:
        super().__init__(trainer, every)
        self.path = Path(directory) / f"rank{trainer.mesh.rank}.pt"
        self._buffers: dict[str, torch.Tensor] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkfreq")

    def _ensure_buffers(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """(Re)allocate and pre-fault buffers when the state's layout changed."""
        layout = [(n, t.shape, t.dtype) for n, t in named]
        current = [(n, b.shape, b.dtype) for n, b in self._buffers.items()]
        if layout != current:
            self._buffers = {n: torch.zeros_like(t, device="cpu") for n, t in named}

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)
        if not self.due(iteration):
            return
        start = time.perf_counter()
        self.drain()
        named = list(self.trainer.named_state())
        self._ensure_buffers(named)
        for name, t in named:
            self._buffers[name].copy_(t)
        self._future = self._executor.submit(_fsync_save, dict(self._buffers), self.path)
        self.saved_version = iteration  # the state before this step: version ``iteration``
        self._account(start, sum(t.numel() * t.element_size() for _, t in named))

    def checkpoint(self) -> tuple[Any, Any] | None:
        self.drain()
        if self.saved_version is None:
            return None
        return torch.load(self.path, weights_only=True), dict(self.trainer.named_state())

    def close(self) -> None:
        super().close()
        self._executor.shutdown(wait=True)


def make_baseline(
    mode: str, trainer: Trainer, directory: Path, *, every: int = 1, emulated: bool = False
) -> _BaselineHooks:
    """The hooks of baseline ``mode``, writing under ``directory/<mode>/`` on the
    iterations divisible by ``every``; ``emulated``: DCP stages on its own thread.

    Collective for ``dcp-async`` (creates a gloo group): call on every rank in the same
    order.
    """
    where = Path(directory) / mode
    if mode == "torch-save":
        return TorchSaveHooks(trainer, where, every)
    if mode == "dcp-async":
        group = dist.new_group(backend="gloo")
        return DcpAsyncHooks(trainer, where, group, every, async_staging=emulated)
    if mode == "checkfreq":
        return CheckFreqHooks(trainer, where, every)
    raise ValueError(f"unknown baseline mode {mode!r}: choose one of {', '.join(BASELINE_MODES)}")
