"""Published in-memory checkpointers as ``baft bench overhead`` modes, through their public APIs.

- ``lm-resiliency``: lm-resiliency 0.2.0 (GEMINI in-memory checkpointing).
  ``enable_resiliency(model, optimizer, interval=N, ...)`` installs an optimizer post-step
  hook that, every N-th step, waits for the previous peer exchange, copies model and optimizer
  state synchronously into preallocated host buffers and replicates them in the
  background to the paired rank (``replication_jump`` = ranks per simulated node, so the
  pair spans two simulated nodes) over its own gloo groups. With FSDP2 stages
  (``--dp-shard``: DTensor parameters) the same call takes the library's FSDP2 runtime,
  which copies each rank's local shards (``to_local()`` of parameters and optimizer state). No disk flush (the library
  flushes on SIGTERM/exit). The bench switches modes without tearing them down, so the
  optimizer it hands the library forwards everything to the trainer's optimizer and runs
  the library's step hook only while the mode is on. Its cadence is the bench's
  ``--interval`` (the library's ``interval``; its docs recommend 5-10). Under the bench's
  emulated compute the library's host copy runs on a thread (:class:`ThreadCopier` in
  place of its ``AsyncDeviceCopier``, whose CPU path is a synchronous ``copy_``), standing
  in for its CUDA side-stream copy into pinned memory, as baft's copy thread stands in for
  the DMA engine; the next optimizer step waits for it (on CUDA the copy is done by then).
- ``dlrover-flash``: DLRover 0.6.1 Flash Checkpoint.
  ``DdpCheckpointer(dir, local_shard_num, global_shard_num)`` and, every step,
  ``save_checkpoint(step, state_dict, storage_type=StorageType.MEMORY)``: a try-lock on
  shared memory, an all-reduce of a ready flag, a synchronous copy into one POSIX
  shared-memory segment per rank. Its cross-node replica (``replica_count``) is broken in
  0.6.1 (a replica overwrites a node's own shard; ``load_checkpoint`` returns ``{}``),
  so it runs without one (``baft-noreplica`` is the matched baft arm). It saves on the
  iterations divisible by the bench's ``--interval``; its copy is synchronous on CUDA too.
  Its saver is a child of local rank 0 (no ``dlrover-run``:
  that launcher crashes on torch 2.13), so the memory copy does not outlive the job.
  DLRover names its segments and socket files after ``TORCHELASTIC_RUN_ID``; the adapter
  sets a fixed id per run directory while it builds the checkpointer, and
  :func:`clean_dlrover` removes ``/dev/shm/<id>_*`` and ``/tmp/ckpt_sock/<id>/`` (the
  adapter on close, the launcher before and after every run, so a crashed bench leaves
  nothing behind).

Both are optional (``pip install -e 'benchmarks[peers]'``); :func:`missing_peers` says which
cannot be imported, and the CLI refuses a mode whose library is missing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from baft.pipeline import IterationTimeline
from baft.train.trainer import Trainer
from baft_bench.baselines import _BaselineHooks, state_nbytes
from baft_bench.modes import PEER_MODES

__all__ = [
    "INSTALL_HINT",
    "PEER_MODES",
    "PROTECTS",
    "DlroverFlashHooks",
    "LmResiliencyHooks",
    "ThreadCopier",
    "clean_dlrover",
    "dlrover_run_id",
    "make_peer",
    "missing_peers",
    "peer_versions",
]

log = logging.getLogger("baft")

INSTALL_HINT = "pip install -e 'benchmarks[peers]'"
"""How to install the peer libraries (pinned versions) into baft's environment."""
_IMPORTS = {"lm-resiliency": ("lm_resiliency",), "dlrover-flash": ("dlrover", "grpc")}
"""Top-level modules each peer mode needs (DLRover imports grpc without declaring it)."""
DISTRIBUTIONS = {"lm-resiliency": "lm-resiliency", "dlrover-flash": "dlrover"}
"""The distribution (package) behind each peer mode, for :func:`peer_versions`."""

PROTECTS = {
    "lm-resiliency": "process crash: yes (peer replica, flushed to node-local disk on "
    "SIGTERM/exit); loss of a node: yes (replica on the paired rank of another simulated "
    "node); power loss / whole job: no (disk flush off)",
    "dlrover-flash": "process crash: no under torchrun (the shared-memory copy's saver is a "
    "child of local rank 0 and dies with the job; only dlrover-run, which crashes on torch "
    "2.13, keeps it); loss of a node: no (replica_count is broken in 0.6.1); power loss: no "
    "(no persist)",
}
"""What each peer mode's per-iteration snapshot survives, as configured in the bench."""

SHM_DIR = Path("/dev/shm")
SOCKET_DIR = Path("/tmp/ckpt_sock")
"""DLRover's socket root (``dlrover.python.common.multi_process.SOCKET_TMP_DIR``)."""


def missing_peers(modes: list[str] | tuple[str, ...]) -> list[str]:
    """The peer modes in ``modes`` whose libraries cannot be imported here."""
    return [
        m
        for m in modes
        if m in _IMPORTS and any(importlib.util.find_spec(name) is None for name in _IMPORTS[m])
    ]


def peer_versions() -> dict[str, str | None]:
    """Installed version of each peer mode's library (None when not installed)."""
    out: dict[str, str | None] = {}
    for mode, dist_name in DISTRIBUTIONS.items():
        try:
            out[mode] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[mode] = None
    return out


def dlrover_run_id(out_dir: str) -> str:
    """The ``TORCHELASTIC_RUN_ID`` the dlrover-flash mode uses for run directory ``out_dir``
    (names its shared-memory segments and socket directory)."""
    digest = hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:10]
    return f"baft-bench-dlrover-{digest}"


def clean_dlrover(run_id: str) -> list[str]:
    """Remove DLRover's shared-memory segments and socket files of ``run_id``; returns
    the removed paths. Safe when nothing is there."""
    removed = []
    for path in sorted(SHM_DIR.glob(f"{run_id}_*")):
        path.unlink(missing_ok=True)
        removed.append(str(path))
    sock = SOCKET_DIR / run_id
    if sock.exists():
        shutil.rmtree(sock, ignore_errors=True)
        removed.append(str(sock))
    return removed


def _model_state(trainer: Trainer) -> dict[str, Any]:
    return {k: v for m in trainer.modules for k, v in m.state_dict().items()}


class ThreadCopier:
    """lm-resiliency's ``AsyncDeviceCopier`` interface (``start_copy``, ``wait``,
    ``is_complete``, ``in_flight``) with the copies on a background thread: the stand-in
    for its CUDA copy stream under emulated compute (the library's CPU path copies
    synchronously on the training thread)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start_copy(self, src_tensors: list[torch.Tensor], dst_buffers: list[torch.Tensor]) -> None:
        if self._thread is not None:
            raise RuntimeError("Previous copy still in flight. Call wait() first.")
        if len(src_tensors) != len(dst_buffers):
            raise ValueError(f"src ({len(src_tensors)}) and dst ({len(dst_buffers)}) differ")
        pairs = list(zip(src_tensors, dst_buffers, strict=True))

        def run() -> None:
            try:
                for src, dst in pairs:
                    dst.copy_(src)
            except BaseException as exc:  # noqa: BLE001 - raised again by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="gemini-copy-standin", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def is_complete(self) -> bool:
        return self._thread is None or not self._thread.is_alive()


class _GatedOptimizer:
    """The trainer's optimizer as lm-resiliency sees it: step post-hooks registered
    through it run only while ``gate.enabled`` (so a switched-off mode does no work),
    and each run is timed into the mode's metrics; everything else is forwarded."""

    def __init__(self, optimizer: torch.optim.Optimizer, gate: LmResiliencyHooks) -> None:
        self._optimizer = optimizer
        self._gate = gate

    def register_step_post_hook(self, hook: Any) -> Any:
        gate = self._gate

        def gated(opt: Any, args: Any, kwargs: Any) -> None:
            if not gate.enabled:
                return
            tl = gate.timeline
            gate._begin(tl.iteration if tl is not None else -1)
            start, t0 = time.perf_counter(), tl.now() if tl is not None else 0.0
            hook(opt, args, kwargs)
            gate.hook_ran(tl.iteration if tl is not None else -1)
            gate._account(start, gate.nbytes)
            if tl is not None:  # inside the trainer's "optimizer" event, on the main thread
                tl.add("gemini-save", "ckpt", t0, tl.now(), slot="optimizer", exposed=True)

        return self._optimizer.register_step_post_hook(gated)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class LmResiliencyHooks(_BaselineHooks):
    """lm-resiliency (GEMINI): per-step snapshot into host buffers, async peer replica.

    Collective to build (creates gloo groups, agrees on a run id). ``ranks_per_node``
    sets ``replication_jump``, so rank r's replica lives on rank r +/- ranks_per_node.
    """

    def __init__(
        self,
        trainer: Trainer,
        directory: Path,
        *,
        ranks_per_node: int,
        interval: int = 1,
        copy_thread: bool = False,
    ) -> None:
        super().__init__(trainer, interval)
        from lm_resiliency import InMemoryCkptConfig, enable_resiliency

        world = dist.get_world_size()
        if world % (2 * ranks_per_node):
            raise ValueError(
                f"lm-resiliency pairs rank r with r +/- {ranks_per_node} (ranks per node): "
                f"the world size {world} must be a multiple of {2 * ranks_per_node}"
            )
        self.nbytes = state_nbytes(trainer)
        self.timeline: IterationTimeline | None = None
        """The iteration in progress (the library's hook runs inside optimizer.step())."""
        self.module = nn.ModuleList(trainer.modules)
        self.handle: Any = enable_resiliency(
            self.module,
            _GatedOptimizer(trainer.optimizer, self),
            framework="pytorch",
            interval=interval,
            enable_detection=False,  # SCOUT detection builds NCCL groups: not on CPU
            checkpoint=InMemoryCkptConfig(
                replication_jump=ranks_per_node,
                disk_flush_interval=0,
                disk_folder=str(directory),
                run_id=f"baft-bench-{hashlib.sha1(str(directory).encode()).hexdigest()[:10]}",
                pin_memory=False,  # no accelerator: page-locking buys nothing
            ),
            group=dist.group.WORLD,
            device=torch.device("cpu"),
        )
        # a ResiliencyHandle, typed as the ResiliencySession protocol (no ckpt_manager there)
        self.manager: Any = cast(Any, self.handle).ckpt_manager
        self.copier: ThreadCopier | None = None
        """The copy-thread stand-in (``copy_thread``), in place of the library's copier."""
        if copy_thread:  # no public switch: the manager's copier is replaced
            self.copier = self.manager._copier = ThreadCopier()
        self._versions: dict[int, int] = {}
        """The library's step count -> the version (iteration + 1) its save holds."""

    def hook_ran(self, iteration: int) -> None:
        """The library's step hook ran after the optimizer step of ``iteration``: remember
        which version its step count stands for (its saves are named by that count)."""
        step = getattr(self.handle, "_step_count", None)
        if isinstance(step, int):
            self._versions[step] = iteration + 1

    def before_iteration(self, iteration: int, timeline: IterationTimeline) -> None:
        self.timeline = timeline
        self._begin(iteration)

    def before_optimizer_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)
        if self.copier is None or not self.enabled:
            return
        start = time.perf_counter()
        self.manager.maybe_wait()  # the step must not change what the copy thread reads
        self._account(start)

    def checkpoint(self) -> tuple[Any, Any] | None:
        """The newest snapshot as the library loads it (collective); its version from the
        step count the library names it by."""
        assert self.manager is not None
        self.drain()
        loaded = self.manager.load()
        if loaded is None:
            return None
        state, step = loaded
        self.saved_version = self._versions.get(int(step))
        if self.saved_version is None:
            return None
        if "model" not in state:
            # FSDP2 stages (DTensor parameters): the library's FSDP2 runtime saves the
            # local shards of its tensor list (parameters, then each one's optimizer
            # state by sorted key), keyed by position; no public accessor for that list
            tensors = cast(Any, self.handle)._collect()
            return state, {str(i): t for i, t in enumerate(tensors)}
        live = {"model": self.module.state_dict(), "optimizer": self.trainer.optimizer.state_dict()}
        return {"model": state["model"], "optimizer": state["optimizer"]}, live

    def drain(self) -> None:
        """Wait for the peer exchange in flight (the library's own wait)."""
        if self.manager is not None:
            self.manager.finalize_replication()

    def restore(self) -> int:
        """Load the newest snapshot into the live model and optimizer (collective);
        returns its step, or -1 when there is none."""
        assert self.manager is not None
        loaded = self.manager.load()
        if loaded is None:
            return -1
        state, step = loaded
        self.module.load_state_dict(state["model"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        return int(step)

    def peer_replica(self) -> dict[str, Any] | None:
        """The replica this rank holds of its paired rank's newest snapshot, as the
        library would restore it after that rank is lost (after :meth:`drain`)."""
        assert self.manager is not None
        pool = self.manager._buffer_pool  # no public accessor for the held replica
        slot = pool.peer_current
        if slot.step <= 0:
            return None
        from lm_resiliency.checkpointing.state_dict import unflatten

        state: dict[str, Any] = unflatten(self.manager._slot_metadata(slot), list(slot.tensors))
        return state

    def close(self) -> None:
        self.handle.close()  # removes the hook, finishes replication, restores signals


class DlroverFlashHooks(_BaselineHooks):
    """DLRover Flash Checkpoint: per-step synchronous copy into POSIX shared memory.

    Collective to build (the saver handshake and an all-reduce per save). One shard per
    rank (``local_shard_num`` = ranks on this launcher, ``global_shard_num`` = world).
    """

    def __init__(
        self, trainer: Trainer, directory: Path, *, run_id: str, interval: int = 1
    ) -> None:
        super().__init__(trainer, interval)
        self.run_id = run_id
        self.directory = Path(directory)
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        with _env(TORCHELASTIC_RUN_ID=run_id, DLROVER_LOG_LEVEL="WARNING"):
            from dlrover.trainer.torch.flash_checkpoint.ddp import (
                DdpCheckpointer,
                StorageType,
            )

            # importing dlrover calls logging.basicConfig(level=INFO): undo it, so the
            # other modes in this process do not start logging at INFO
            root.handlers[:], root.level = handlers, level

            self._memory = StorageType.MEMORY
            self.checkpointer = DdpCheckpointer(
                str(self.directory), local_shard_num=local, global_shard_num=world
            )
        self.nbytes = state_nbytes(trainer)
        self.skipped = 0
        """Saves the library skipped (its saver held the shared memory)."""

    def _state(self) -> dict[str, Any]:
        return {"model": _model_state(self.trainer), "optim": self.trainer.optimizer.state_dict()}

    def after_step(self, iteration: int, timeline: IterationTimeline) -> None:
        self._begin(iteration)
        if not self.due(iteration):
            return
        start, t0 = time.perf_counter(), timeline.now()
        engine = self.checkpointer._engine
        before = engine._cached_step  # save_checkpoint does not say whether it skipped
        self.checkpointer.save_checkpoint(iteration + 1, self._state(), storage_type=self._memory)
        saved = engine._cached_step != before
        self.skipped += 0 if saved else 1
        self.saved_version = iteration + 1 if saved else self.saved_version
        self._account(start, self.nbytes if saved else 0)
        timeline.add("dlrover-save", "ckpt", t0, timeline.now(), slot="after_step", exposed=True)

    def restore(self) -> dict[str, Any]:
        """The newest snapshot as the library loads it (collective), ``{}`` if none.

        The library's tensors view its shared-memory segment, which :meth:`close` unmaps
        (an optimizer that kept them then crashes on its next step), so they are cloned.
        """
        state: dict[str, Any] = self.checkpointer.load_checkpoint()
        return _clone_tensors(state)

    def checkpoint(self) -> tuple[Any, Any] | None:
        """The newest snapshot as the library loads it (collective)."""
        state = self.restore()
        if not state or self.saved_version is None:
            return None
        return {"model": state.get("model"), "optim": state.get("optim")}, self._state()

    def shm_paths(self) -> list[Path]:
        """This rank's shared-memory segments (named after the run id and local rank)."""
        local = os.environ.get("LOCAL_RANK", "0")
        return [p for p in SHM_DIR.glob(f"{self.run_id}_*") if p.name.endswith(f"_{local}")]

    def close(self) -> None:
        engine = self.checkpointer._engine
        engine.close()
        saver = getattr(engine, "saver_proc", None)
        if saver is not None and saver.is_alive():
            # SIGKILL: nothing to persist in memory-only mode, and a forked saver may have
            # inherited another library's SIGTERM handler (lm-resiliency flushes on it)
            saver.kill()
            saver.join(timeout=10)
        if dist.is_initialized():
            dist.barrier()  # every rank has closed its mapping before local rank 0 unlinks
        if int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)) == 0:
            for path in clean_dlrover(self.run_id):
                log.debug("removed %s", path)
        if dist.is_initialized():
            dist.barrier()  # close returns once this host's segments are gone


def _clone_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone_tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_clone_tensors(v) for v in value)
    return value


@contextmanager
def _env(**values: str) -> Any:
    """Set environment variables for the duration of the block (then restore them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_peer(
    mode: str,
    trainer: Trainer,
    directory: Path,
    *,
    out_dir: str,
    ranks_per_node: int,
    interval: int = 1,
    emulated: bool = False,
) -> _BaselineHooks:
    """The hooks of peer ``mode``, writing under ``directory/<mode>/`` every ``interval``
    iterations; ``emulated``: lm-resiliency copies on a thread. Collective."""
    missing = missing_peers([mode])
    if missing:
        raise RuntimeError(f"{mode} is not installed: {INSTALL_HINT}")
    where = Path(directory) / mode
    if mode == "lm-resiliency":
        return LmResiliencyHooks(
            trainer, where, ranks_per_node=ranks_per_node, interval=interval, copy_thread=emulated
        )
    if mode == "dlrover-flash":
        return DlroverFlashHooks(trainer, where, run_id=dlrover_run_id(out_dir), interval=interval)
    raise ValueError(f"unknown peer mode {mode!r}: choose one of {', '.join(PEER_MODES)}")
