"""Side-by-side checkpoint overhead: the benchmark worker and its configuration.

One torchrun launch runs ``python -m baft_bench.overhead CONFIG_JSON`` on every rank. Each
rank builds one :class:`~baft.train.trainer.Trainer` and one hooks object per mode, then
interleaves blocks of iterations across modes, each round in another order (a Williams
design: every mode follows every other equally often). Before each block the mode runs
``num_switch_iters`` unmeasured iterations, and after it its background work is drained,
so no mode's work leaks into another's numbers. Per measured iteration every rank
records its wall seconds and the mode's ``last_metrics``; one all-reduce per block brings
them to rank 0, which writes ``OUT/overhead-raw.json``. :mod:`baft_bench.aggregate` (pure)
turns that into the reported numbers; :mod:`baft_bench.command` renders the results page.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baft.engine.priority import ENV as PRIORITY_ENV
from baft_bench.aggregate import COMPONENTS, FIELDS, block_order
from baft_bench.memory import MemoryTracker, allocated_bytes
from baft_bench.modes import (
    ALL_MODES,  # noqa: F401 - re-exported (the CLI and tests import it from here)
    BASELINE_MODES,
    DISK_MODES,
    ENGINE_ARMS,
    ENGINE_MODES,
    PEER_MODES,
    REFERENCE_MODES,
    engine_transport,
    mode_transport,
    resolve_modes,
)
from baft_bench.threads import ThreadClock

RAW_FILE = "overhead-raw.json"
"""Name of the per-iteration raw results rank 0 writes under the run directory."""
ENGINE_OPTIONS = {"host_work": "host_work", "snapshot_copy": "snapshot_copy", "exchange": "paths"}
"""``--engine`` keys -> the :class:`baft.config.ExchangeConfig` fields they set."""
AUTO_K_GUESS = 8
"""The K ``full_every=auto`` is assumed to choose when counting iterations up front."""
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184"}
"""glibc malloc settings every mode runs with (the launcher keeps values already set):
freed memory up to 32 MiB a block stays in the process instead of going back to the
kernel. With glibc's defaults the reference mode ``none`` took 10-16 thousand minor page
faults per iteration and rank here (gradients and optimizer temporaries handed back and
faulted in again), and baft's gradient record, which keeps the last gradients alive,
happened to avoid most of them, so baft measured faster than no checkpointing; with these
settings no mode faults and every mode pays the same for its memory."""


def engine_job_id(out_dir: str, mode: str) -> str:
    """Store name of engine mode ``mode`` for the run directory ``out_dir``."""
    digest = hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:10]
    return f"bench-{mode}-{digest}"


@dataclass(kw_only=True, slots=True)
class OverheadConfig:
    """What ``baft bench overhead`` runs; every mode sees the same model, data and ranks."""

    num_pp: int = 2
    """Pipeline ranks."""
    num_dp: int = 1
    """Data-parallel replicas."""
    num_dp_shard: int = 1
    """FSDP2 degree inside each replica (``baft train --dp-shard``: every GPT block and
    stage ``fully_shard``-ed over torchtitan's ``dp_shard`` dim); real compute only."""
    schedule: str = "1f1b"
    """Pipeline schedule (one of baft.config.SCHEDULES)."""
    num_microbatches: int = 4
    """Microbatches per iteration per replica."""
    num_layers: int = 8
    """Transformer blocks."""
    d_model: int = 512
    """Hidden size (a wide model: large state relative to compute)."""
    num_heads: int = 8
    """Attention heads."""
    seq_len: int = 32
    """Tokens per sequence."""
    global_batch: int = 4
    """Sequences per iteration over all replicas (small: checkpoint-heavy)."""
    num_blocks: int = 8
    """Measured blocks per mode (blocks of different modes are interleaved)."""
    block_iters: int = 4
    """Measured iterations per block."""
    num_switch_iters: int = 1
    """Unmeasured iterations a mode runs after being switched on, before its block."""
    num_warmup: int = 2
    """Unmeasured iterations without checkpointing at the start, then per mode once."""
    modes: list[str] = field(default_factory=list)
    """Modes to compare, in order; must include ``none`` (the reference)."""
    compute: str = "real"
    """``real`` or ``emulated`` (stage compute becomes calibrated sleeps)."""
    emulated_ms: str = ""
    """Emulated per-stage forward/backward milliseconds, ``F/B,F/B,...`` (one pair per
    stage); empty = calibrate on the real stages at start-up (slow on a loaded machine)."""
    out_dir: str = "runs/bench-overhead"
    """Run directory: config, raw results and the checkpoint files the modes write."""
    seed: int = 0
    """Seed for initialisation and data order."""
    ranks_per_node: int = 1
    """Ranks per simulated node (failure domain) for the engine's redundancy."""
    checkpoint: str = "every=1,redundancy=xor:2,persist=0"
    """Policy of the engine modes, CheckpointPolicy syntax (``baft-full`` and
    ``naive-async`` always use ``full_every=1``)."""
    store_root: str = "/dev/shm/baft"
    """Shared-memory root of the engine modes' snapshot stores."""
    engine: str = ""
    """Engine options of the engine modes, ``key=value,...`` over :data:`ENGINE_OPTIONS`
    (e.g. ``host_work=always,snapshot_copy=thread``: to measure them); empty = defaults.
    ``exchange=`` sets the transport of every engine mode but ``baft-shm``."""
    interval: int = 1
    """Iterations between checkpoints, for every mode (the engine's ``every``, the
    baselines' and peers' cadence): a sweep over intervals is one flag per launch."""
    persist_every: int = 1
    """Disk cadence in checkpoints: the disk baselines (torch-save, dcp-async, checkfreq)
    write every ``persist_every``-th checkpoint iteration, ``baft-persist`` persists with
    ``persist=persist_every`` (the same iterations)."""
    restore_check: bool = True
    """After the timed blocks, restore each mode's newest checkpoint and compare it bit
    for bit with the live state of that version (:mod:`baft_bench.restorecheck`)."""

    @property
    def world_size(self) -> int:
        """Ranks of one launch: pp x dp x dp_shard."""
        return self.num_pp * self.num_dp * self.num_dp_shard

    def validate(self) -> None:
        for name in ("num_blocks", "block_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('num_', '').replace('_', '-')} must be >= 1")
        if self.num_switch_iters < 0 or self.num_warmup < 0:
            raise ValueError("--warmup and the switch iterations must be >= 0")
        self.modes = resolve_modes(self.modes)
        self._validate_cadence()
        if "none" not in self.modes:
            raise ValueError("--modes must include none (the reference every ratio is against)")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"--modes lists a mode twice: {self.modes}")
        if self.compute not in ("real", "emulated"):
            raise ValueError(f"--compute must be real or emulated, got {self.compute!r}")
        if self.emulated_ms:
            times = self.fixed_emulated_times()
            if times is not None and len(times["fwd"]) != self.train_config().parallel.num_stages:
                raise ValueError(
                    f"--emulated-ms gives {len(times['fwd'])} stages, the layout has "
                    f"{self.train_config().parallel.num_stages}"
                )
        cfg = self.train_config()
        if any(m in ENGINE_MODES for m in self.modes):
            cfg.checkpoint = self.engine_checkpoint("baft")
        cfg.validate()

    def _validate_cadence(self) -> None:
        if self.interval < 1 or self.persist_every < 1:
            raise ValueError("--interval and --persist-every must be >= 1")
        longest = max((self.cadence(m) for m in self.modes), default=1)
        if self.block_iters % longest:
            raise ValueError(
                f"--block-iters {self.block_iters} must be a multiple of the longest "
                f"checkpoint cadence, {longest} iterations (--interval {self.interval} x "
                f"--persist-every {self.persist_every}), so that every block holds the same "
                "number of checkpoints"
            )

    def cadence(self, mode: str) -> int:
        """Iterations between the checkpoints (disk writes, for disk modes) of ``mode``:
        a checkpoint falls on the iterations divisible by it (the engine's rule)."""
        if mode in DISK_MODES or (mode in ENGINE_ARMS and ENGINE_ARMS[mode].persist):
            return self.interval * self.persist_every
        return self.interval

    def transport(self, mode: str) -> str:
        """How ``mode``'s redundancy moves: "network", "shm" or "n/a"."""
        if mode in ENGINE_MODES:
            ck = self.engine_checkpoint(mode)
            return engine_transport(ck.exchange.paths, ck.policy.redundancy)
        return mode_transport(mode)

    def fixed_emulated_times(self) -> dict[str, list[float]] | None:
        """``emulated_ms`` as {"fwd": [s, ...], "bwd": [s, ...]}, or None when unset."""
        if not self.emulated_ms:
            return None
        fwd, bwd = [], []
        for pair in self.emulated_ms.split(","):
            try:
                f, b = (float(x) / 1e3 for x in pair.split("/"))
            except ValueError:
                raise ValueError(
                    f"--emulated-ms {self.emulated_ms!r}: expected FWD/BWD milliseconds per "
                    "stage, e.g. 15.7/29.4,15.2/28.4"
                ) from None
            if f < 0 or b < 0:
                raise ValueError(f"--emulated-ms {self.emulated_ms!r}: times must be >= 0")
            fwd.append(f)
            bwd.append(b)
        return {"fwd": fwd, "bwd": bwd}

    def engine_checkpoint(self, mode: str) -> Any:
        """The CheckpointConfig of engine mode ``mode`` (own store, own DCP directory)."""
        from baft.config import CheckpointConfig

        ck = CheckpointConfig.parse(self.checkpoint)
        arm = ENGINE_ARMS.get(mode, ENGINE_ARMS["baft"])
        if ck.policy.every not in (1, self.interval):
            raise ValueError(
                f"--checkpoint every={ck.policy.every} and --interval {self.interval} differ: "
                "set the interval with --interval"
            )
        ck.policy.every = self.interval
        if arm.full:  # the baselines of the engine protect the whole state
            ck.policy.full_every = 1
        if arm.redundancy is not None:
            ck.policy.redundancy = arm.redundancy
        if arm.persist:
            ck.policy.persist_every = self.persist_every
        ck.store.root = self.store_root
        ck.store.job_id = engine_job_id(self.out_dir, mode)
        ck.store.keep_on_close = True  # the restore check reads it after close (then removed)
        ck.persist.dir = str(Path(self.out_dir) / "ckpt" / f"{mode}-dcp")
        ck.persist.writer = arm.writer
        ck.exchange.paths = arm.paths
        if self.compute == "emulated":
            ck.exchange.snapshot_copy = "thread"  # the host is free while the device computes
        for key, value in self.engine_options().items():
            if key == "exchange" and arm.fixed_paths:
                continue
            setattr(ck.exchange, ENGINE_OPTIONS[key], value)
        return ck

    def engine_options(self) -> dict[str, str]:
        """``engine`` as a dict; ValueError names a malformed or unknown option."""
        options: dict[str, str] = {}
        for item in filter(None, (x.strip() for x in self.engine.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ENGINE_OPTIONS:
                raise ValueError(
                    f"--engine {self.engine!r}: expected key=value with key one of "
                    f"{', '.join(ENGINE_OPTIONS)}, got {item!r}"
                )
            options[key] = value
        return options

    def train_config(self) -> Any:
        """The TrainConfig every mode trains with."""
        from baft.model.config import ModelConfig
        from baft.train.config import ParallelConfig, TrainConfig

        return TrainConfig(
            model=ModelConfig(
                num_layers=self.num_layers,
                d_model=self.d_model,
                num_heads=self.num_heads,
                seq_len=self.seq_len,
            ),
            parallel=ParallelConfig(
                num_dp=self.num_dp,
                num_dp_shard=self.num_dp_shard,
                num_pp=self.num_pp,
                schedule=self.schedule,
                num_microbatches=self.num_microbatches,
                ranks_per_node=self.ranks_per_node,
            ),
            num_iterations=self.total_iterations(),
            global_batch=self.global_batch,
            seed=self.seed,
            out_dir=self.out_dir,
        )

    def replan_iters(self) -> int:
        """Unmeasured iterations an engine mode runs after its plan, to its one re-plan
        (``REPLAN_AFTER_CHECKPOINTS`` checkpoints): a one-time cost like profiling and
        allocation (in the first measured iteration it took ~200 ms and 77 MiB of page
        faults here, 0.3-1% of an 80-iteration ratio)."""
        from baft.engine.planning import REPLAN_AFTER_CHECKPOINTS

        return REPLAN_AFTER_CHECKPOINTS * self.interval

    def total_iterations(self) -> int:
        per_mode = self.num_warmup + self.num_blocks * (self.num_switch_iters + self.block_iters)
        profile = sum(
            self.engine_checkpoint(m).profile_iters + self.replan_iters()
            for m in self.modes
            if m in ENGINE_MODES
        )
        return self.num_warmup + len(self.modes) * per_mode + profile + self.check_iterations()

    def check_iterations(self) -> int:
        """Iterations the restore check runs (an estimate: K is planned at run time)."""
        from baft_bench.restorecheck import check_iterations

        if not self.restore_check:
            return 0
        k = self.engine_checkpoint("baft").policy.full_every or AUTO_K_GUESS
        return sum(
            check_iterations(self.cadence(m), k if m in ENGINE_MODES else 1)
            for m in self.modes
            if m not in REFERENCE_MODES
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OverheadConfig:
        return cls(**d)


# ------------------------------------------------------------------ the worker
def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def calibrate_emulated(cfg: Any, mesh: Any) -> dict[str, list[float]]:
    """Per-stage (fwd, bwd) seconds of the real stages, measured on each rank's own stages
    with one microbatch and shared with every rank (median over DP replicas). Collective."""
    import torch.distributed as dist

    from baft.model.emulated import calibrate_stage
    from baft.model.gpt import build_stage_module
    from baft.pipeline import stage_indices

    par = cfg.parallel
    micro = cfg.global_batch // par.num_dp // par.num_microbatches
    mine = {}
    for s in stage_indices(par.schedule, mesh.coords.pp, par.num_pp, par.num_virtual):
        module = build_stage_module(cfg.model, s, par.num_stages, cfg.seed)
        mine[s] = calibrate_stage(module, cfg.model, micro)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    per_stage: dict[int, list[tuple[float, float]]] = {}
    for part in gathered:
        for s, fb in part.items():
            per_stage.setdefault(s, []).append(fb)
    stages = range(par.num_stages)
    return {
        "fwd": [statistics.median(f for f, _ in per_stage[s]) for s in stages],
        "bwd": [statistics.median(b for _, b in per_stage[s]) for s in stages],
    }


def measure_sync_snapshot(trainer: Any, num_reps: int = 5) -> float:
    """Median seconds of one synchronous ``copy_`` of the rank's whole state into
    preallocated, pre-faulted buffers."""
    import torch

    live = [t for _, t in trainer.named_state()]
    buffers = [torch.empty_like(t).copy_(t) for t in live]
    times = []
    for _ in range(num_reps):
        start = time.perf_counter()
        for b, t in zip(buffers, live, strict=True):
            b.copy_(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class BareMode:
    """The ``bare`` mode: the bare torch schedule (``TrainConfig(instrument=False)``: no
    slots, no timeline) on a Trainer of its own, built like the shared one (same seed,
    same layout); it prices baft's instrumentation against ``none``. Its model and
    optimizer are a second copy of the state on each rank (in every mode's RSS)."""

    def __init__(self, cfg: Any, mesh: Any) -> None:
        from dataclasses import replace

        from baft.train.trainer import Trainer

        self.trainer = Trainer(replace(cfg, instrument=False, checkpoint=None), mesh)
        self.enabled = False
        self.last_metrics: dict[str, Any] = {}

    def close(self) -> None:
        self.trainer.close()


def _share_layout_digests(trainer: Any, mesh: Any) -> None:
    """Give the shared runner every ``(pp, tp)``'s state layout digest, as ``baft.protect``
    does before the first step, so that the engine modes' shards record their identity
    and a fresh ``protect`` can restore them (the restore check). Collective."""
    import torch.distributed as dist

    c = mesh.coords
    state = trainer.runner.state
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (f"pp{c.pp}.tp{c.tp}", state.layout_digest))
    trainer.runner.layout_digests = dict(gathered)


def _make_mode(mode: str, bcfg: OverheadConfig, cfg: Any, mesh: Any, trainer: Any) -> Any:
    """The hooks object of ``mode`` (None for ``none``). Collective."""
    from baft_bench.baselines import make_baseline

    emulated = bcfg.compute == "emulated"
    if mode == "none":
        return None
    if mode == "bare":
        return BareMode(cfg, mesh)
    if mode in BASELINE_MODES:
        return make_baseline(
            mode, trainer, Path(bcfg.out_dir) / "ckpt", every=bcfg.cadence(mode), emulated=emulated
        )
    if mode in PEER_MODES:
        from baft_bench.peers import make_peer

        return make_peer(
            mode,
            trainer,
            Path(bcfg.out_dir) / "ckpt",
            out_dir=bcfg.out_dir,
            ranks_per_node=bcfg.ranks_per_node,
            interval=bcfg.cadence(mode),
            emulated=emulated,
        )
    from baft.engine.build import build_engine
    from baft.engine.scheduling import AllAtStart, BubbleAware

    run_dir = Path(bcfg.out_dir) / f"engine-{mode}"
    run_dir.mkdir(parents=True, exist_ok=True)
    scheduling = AllAtStart() if mode == "naive-async" else BubbleAware()
    ck = bcfg.engine_checkpoint(mode)
    arm = ENGINE_ARMS.get(mode)
    if arm is not None and arm.budget_x is not None:
        from baft_bench.baselines import state_nbytes

        ck.store.budget_bytes = int(arm.budget_x * state_nbytes(trainer))
    priority = arm.priority if arm is not None else None
    if priority is None:
        return build_engine(ck, run_dir, mesh, trainer.runner, scheduling=scheduling)
    before = os.environ.get(PRIORITY_ENV)
    os.environ[PRIORITY_ENV] = priority  # read as the engine's threads start
    try:
        return build_engine(ck, run_dir, mesh, trainer.runner, scheduling=scheduling)
    finally:
        if before is None:
            os.environ.pop(PRIORITY_ENV, None)
        else:
            os.environ[PRIORITY_ENV] = before


def _build_modes(bcfg: OverheadConfig, cfg: Any, mesh: Any, trainer: Any) -> tuple[dict, dict]:
    """Hooks per mode (None for ``none``) and {mode: reason} for modes that could not be
    built on some rank. Collective: every rank builds the modes in the same order."""
    import torch
    import torch.distributed as dist

    hooks: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    # DLRover forks its saver process when built: build it before the other modes start
    # their threads (forked after the other seven modes, its saver once never came up:
    # "Timed out waiting for socket server: ckpt_lock_rank_0"; fork-with-threads suspected)
    for mode in sorted(bcfg.modes, key=lambda m: m != "dlrover-flash"):
        obj, error = None, ""
        _MEMORY.held(mode, start=True)
        try:
            obj = _make_mode(mode, bcfg, cfg, mesh, trainer)
        except Exception as exc:  # a missing or broken engine must not sink the baselines
            error = f"{type(exc).__name__}: {exc}"
        flag = torch.tensor([1.0 if error else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            skipped[mode] = error or "failed on another rank"
            _close(obj)
        else:
            if obj is not None:
                obj.enabled = False
            hooks[mode] = obj
            _MEMORY.names[id(obj)] = mode
        _MEMORY.held(mode, start=False)
        trainer.hooks = None  # the engine installs itself; the harness decides
    return {m: hooks[m] for m in bcfg.modes if m in hooks}, skipped


def _close(hooks: Any) -> None:
    for name in ("drain", "close", "shutdown"):
        fn = getattr(hooks, name, None)
        if callable(fn):
            fn()
            if name != "drain":
                return


class _MemoryWatch:
    """The worker's :class:`~baft_bench.memory.MemoryTracker` as :func:`_switch` feeds it:
    modes by their hooks object (``id``), counted only while ``active`` (the blocks)."""

    def __init__(self) -> None:
        self.tracker: Any = None
        self.names: dict[int, str] = {}
        self.active = False

    def held(self, mode: str, *, start: bool) -> None:
        if self.tracker is not None:
            (self.tracker.held_start if start else self.tracker.held_stop)(mode)

    def switched(self, hooks: Any, on: bool) -> None:
        name = self.names.get(id(hooks))
        if self.tracker is None or not self.active or name is None:
            return
        (self.tracker.switched_on if on else self.tracker.switched_off)(name)


_MEMORY = _MemoryWatch()
"""This worker's memory per mode (one process per rank)."""


def _switch(trainer: Any, hooks: Any, on: bool) -> None:
    """Turn a mode on (install its hooks) or off (disable, drain background work)."""
    if on:
        _MEMORY.switched(hooks, True)
    if hooks is None or isinstance(hooks, BareMode):
        trainer.hooks = None
        if hooks is not None:
            hooks.enabled = on
        if not on:
            _MEMORY.switched(hooks, False)
        return
    hooks.enabled = on
    if on:
        trainer.hooks = hooks
        return
    drain = getattr(hooks, "drain", None)
    if callable(drain):
        drain()
    trainer.hooks = None
    _MEMORY.switched(hooks, False)


def _run_block(trainer: Any, hooks: Any, first: int, num: int) -> list[list[float]]:
    """Run ``num`` iterations from ``first``; rows of this rank's FIELDS values."""
    rows = []
    clock = ThreadClock()
    if isinstance(hooks, BareMode):  # the bare schedule runs on its own trainer
        trainer = hooks.trainer
    persisted = float((getattr(hooks, "last_metrics", None) or {}).get("persisted", 0))
    for it in range(first, first + num):
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        clock.start()
        start, cpu0 = time.perf_counter(), time.process_time()
        res = trainer.run_step(it)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
        threads = clock.stop()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        m = getattr(hooks, "last_metrics", None) or {}
        nbytes = m.get("bytes", 0.0)
        pull = net = 0.0
        if isinstance(nbytes, dict):  # the engine reports {"snapshot", "send", "recv", "pull"}
            pull, net = float(nbytes.get("pull", 0)), float(nbytes.get("recv", 0))
            nbytes = nbytes.get("snapshot", 0)
        seconds = m.get("seconds") or {}
        saves = float(m.get("disk_saves", 0.0))
        if "persisted" in m:  # the engine counts its DCP saves since it started
            saves, persisted = float(m["persisted"]) - persisted, float(m["persisted"])
        blocked = res.timeline.blocked_s() if hasattr(res, "timeline") else 0.0
        rows.append(
            [
                elapsed,
                m.get("exposed_s", 0.0),
                m.get("in_bubble_s", 0.0),
                float(nbytes),
                cpu,
                blocked,
                *(float(seconds.get(c, 0.0)) for c in COMPONENTS),
                pull,
                net,
                float(faults),
                saves,
                *threads,
            ]
        )
    return rows


def _gather_rows(rows: list[list[float]], rank: int, world: int) -> list[list[list[float]]]:
    """All ranks' rows of one block: [iteration][rank][field] (one all-reduce)."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(len(rows), world, len(FIELDS), dtype=torch.float64)
    t[:, rank, :] = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(t)
    out: list[list[list[float]]] = t.tolist()
    return out


def _measure(
    bcfg: OverheadConfig, trainer: Any, hooks: dict[str, Any], it: int, rank: int, world: int
) -> dict[str, dict[str, list[list[float]]]]:
    """The interleaved blocks, from iteration ``it``: {mode: {field: [iteration][rank]}}."""
    samples: dict[str, dict[str, list[list[float]]]] = {m: {f: [] for f in FIELDS} for m in hooks}
    names = list(hooks)
    for block in range(bcfg.num_blocks):
        for mode in block_order(names, block):
            h = hooks[mode]
            _switch(trainer, h, True)
            _run_block(trainer, h, it, bcfg.num_switch_iters)
            it += bcfg.num_switch_iters
            rows = _run_block(trainer, h, it, bcfg.block_iters)
            it += bcfg.block_iters
            _switch(trainer, h, False)
            for per_iter in _gather_rows(rows, rank, world):
                for i, name in enumerate(FIELDS):
                    samples[mode][name].append([r[i] for r in per_iter])
            if rank == 0:
                med = statistics.median(max(r) for r in samples[mode]["iter_s"])
                _log(f"block {block + 1}/{bcfg.num_blocks} {mode}: median {med * 1e3:.1f} ms")
    return samples


def run_worker(bcfg: OverheadConfig) -> dict[str, Any] | None:
    """Run the benchmark on this rank; rank 0 returns the raw results, others None."""
    import torch
    import torch.distributed as dist

    from baft.pipeline.mesh import init_mesh
    from baft.train.trainer import Trainer
    from baft_bench.baselines import state_nbytes

    torch.set_num_threads(1)
    cfg = bcfg.train_config()
    mesh = init_mesh(cfg.parallel)
    rank, world = mesh.rank, dist.get_world_size()
    if bcfg.compute == "emulated":
        cfg.compute = "emulated"
        cfg.emulated_times = bcfg.fixed_emulated_times() or calibrate_emulated(cfg, mesh)
    trainer = Trainer(cfg, mesh)
    _share_layout_digests(trainer, mesh)
    _MEMORY.tracker = MemoryTracker()
    it = 0
    _run_block(trainer, None, it, bcfg.num_warmup)
    it += bcfg.num_warmup
    hooks, skipped = _build_modes(bcfg, cfg, mesh, trainer)
    for mode, why in skipped.items():
        if rank == 0:
            _log(f"skipping {mode}: {why}")
    for mode, h in hooks.items():  # first-call costs (allocation, profiling, planning) unmeasured
        _MEMORY.held(mode, start=True)
        num = bcfg.num_warmup
        if callable(getattr(h, "start", None)):  # the engine profiles, plans, re-plans once
            h.start(it)
            num += getattr(getattr(h, "ck", None), "profile_iters", 0) + bcfg.replan_iters()
        _switch(trainer, h, True)
        _run_block(trainer, h, it, num)
        it += num
        _switch(trainer, h, False)
        _MEMORY.held(mode, start=False)
    facts = torch.zeros(2, world, dtype=torch.float64)
    facts[0, rank] = measure_sync_snapshot(trainer)
    facts[1, rank] = state_nbytes(trainer)
    dist.all_reduce(facts)
    _MEMORY.active = True
    samples = _measure(bcfg, trainer, hooks, it, rank, world)
    _MEMORY.active = False
    mode_facts = _after_blocks(bcfg, cfg, mesh, trainer, hooks)
    if rank != 0:
        return None
    return {
        **mode_facts,
        "config": bcfg.to_dict(),
        "world_size": world,
        "snapshot_s": facts[0].tolist(),
        "state_bytes": [int(b) for b in facts[1].tolist()],
        "emulated_times": cfg.emulated_times,
        "skipped": skipped,
        "modes": samples,
    }


# ------------------------------------------------- after the blocks: facts and restores
def _next_iteration(trainer: Any, hooks: dict[str, Any]) -> int:
    """The iteration after the newest any trainer ran (``bare`` has its own)."""
    runners = [trainer.runner] + [
        h.trainer.runner for h in hooks.values() if isinstance(h, BareMode)
    ]
    return max(r.iteration for r in runners)


def _engine_k(hooks: Any) -> int | None:
    """The K (``full_every``) an engine mode planned; None for other modes."""
    rotation = getattr(hooks, "rotation", None)
    return int(rotation.k) if rotation is not None and rotation.layout is not None else None


def _record_bytes(hooks: Any) -> int | None:
    """Bytes of the gradient set the differential record keeps alive (None: no record)."""
    records = getattr(getattr(hooks, "rotation", None), "records", None)
    if records is None:
        return None
    last = getattr(records, "last", None)
    grads = last.grads.values() if last is not None else ()
    return sum(g.numel() * g.element_size() for g in grads if g is not None)


def _shm_bytes(mode: str, hooks: Any) -> int:
    """Shared memory this rank's part of ``mode`` holds: its store or its segments."""
    store = getattr(hooks, "store", None)
    if mode in ENGINE_MODES and store is not None:
        return allocated_bytes([Path(store.path)])
    paths = getattr(hooks, "shm_paths", None)
    return allocated_bytes(paths()) if callable(paths) else 0


def _restore_verdict(
    bcfg: OverheadConfig, cfg: Any, mesh: Any, mode: str, hooks: Any, history: Any, trainer: Any
) -> tuple[str, str]:
    """This rank's verdict on ``mode``'s newest checkpoint (:mod:`baft_bench.restorecheck`).
    An engine mode is closed (its store kept) and restored by a fresh Trainer on its
    store through ``baft.protect``'s ``restore()``. Collective."""
    from dataclasses import replace

    from baft.train.trainer import Trainer
    from baft_bench.restorecheck import check_saved, compare

    if mode not in ENGINE_MODES:
        saved = hooks.checkpoint()
        return check_saved(history, hooks.saved_version, saved, trainer.named_state())
    _close(hooks)
    ck = bcfg.engine_checkpoint(mode)
    ck.store.keep_on_close = False
    run_dir = str(Path(bcfg.out_dir) / f"engine-{mode}")
    fresh = Trainer(replace(cfg, checkpoint=ck, out_dir=run_dir), mesh)
    try:
        version = fresh.restore()
        return compare(history.versions.get(version), dict(fresh.named_state()), version)
    finally:
        fresh.close()


def _restore_check(
    bcfg: OverheadConfig, cfg: Any, mesh: Any, trainer: Any, mode: str, hooks: Any, it: int
) -> tuple[tuple[str, str], int]:
    """Run ``mode`` long enough to hold a whole window, recording the live state's
    digests at the last boundaries, then its verdict on every rank; returns it and the
    next iteration. Collective."""
    from baft_bench.restorecheck import LiveHistory, agree, check_iterations

    if mode in REFERENCE_MODES:
        return ("n/a", "no checkpoints"), it
    cadence = bcfg.interval if mode in ENGINE_MODES else bcfg.cadence(mode)
    num = check_iterations(cadence, _engine_k(hooks) or 1)
    history = LiveHistory()
    _switch(trainer, hooks, True)
    for i in range(num):
        if i >= num - 2 * cadence - 2:
            history.record(it, trainer.named_state())
        _run_block(trainer, hooks, it, 1)
        it += 1
    history.record(it, trainer.named_state())
    _switch(trainer, hooks, False)
    try:
        verdict = _restore_verdict(bcfg, cfg, mesh, mode, hooks, history, trainer)
    except Exception as exc:  # a failed restore is a verdict, not the bench's end
        verdict = ("no", f"{type(exc).__name__}: {exc}")
    return agree(verdict, mesh.rank), it


def _after_blocks(
    bcfg: OverheadConfig, cfg: Any, mesh: Any, trainer: Any, hooks: dict[str, Any]
) -> dict[str, Any]:
    """Each mode's facts (transport, K, note, memory per rank) and restore verdict, then
    every mode closed; rank 0 gets ``{"mode_facts", "peer_versions", "memory_method"}``.
    Collective."""
    import torch.distributed as dist

    from baft_bench.facts import mode_note
    from baft_bench.memory import per_rank
    from baft_bench.peers import peer_versions

    tracker = _MEMORY.tracker
    local = {
        m: tracker.mode_memory(m, _shm_bytes(m, h), _record_bytes(h)) for m, h in hooks.items()
    }
    ks = {m: _engine_k(h) for m, h in hooks.items()}
    verdicts: dict[str, tuple[str, str]] = {}
    it = _next_iteration(trainer, hooks)
    for mode, h in hooks.items():
        if bcfg.restore_check:
            verdicts[mode], it = _restore_check(bcfg, cfg, mesh, trainer, mode, h, it)
            if mesh.rank == 0:
                _log(f"restore check {mode}: {verdicts[mode][0]} ({verdicts[mode][1]})")
        if mode not in ENGINE_MODES or not bcfg.restore_check:
            _close(h)  # engine modes were closed by their restore check
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    facts = {
        m: {
            "transport": bcfg.transport(m),
            "k": ks[m],
            "note": mode_note(m, bcfg.compute),
            "memory": per_rank([g[m] for g in gathered]),
            "restores": verdicts.get(m, ("n/a", "restore check off"))[0],
            "restores_detail": verdicts.get(m, ("n/a", "restore check off"))[1],
        }
        for m in hooks
    }
    return {
        "mode_facts": facts,
        "peer_versions": peer_versions(),
        "memory_method": tracker.method,
    }


def main(argv: list[str] | None = None) -> int:
    """Worker entry (one process per rank, under torchrun)."""
    import warnings

    from baft.train.worker import process_main

    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    bcfg = OverheadConfig.from_dict(json.loads(Path(argv[0]).read_text()))

    def body() -> None:
        start = time.time()
        raw = run_worker(bcfg)
        if raw is not None:
            raw["wall_s"] = time.time() - start
            (Path(bcfg.out_dir) / RAW_FILE).write_text(json.dumps(raw) + "\n")

    return process_main(body)


if __name__ == "__main__":
    sys.exit(main())
