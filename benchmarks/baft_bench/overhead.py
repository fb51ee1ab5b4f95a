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
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baft_bench.aggregate import COMPONENTS, FIELDS, block_order
from baft_bench.modes import ALL_MODES, BASELINE_MODES, ENGINE_MODES, PEER_MODES

RAW_FILE = "overhead-raw.json"
"""Name of the per-iteration raw results rank 0 writes under the run directory."""
ENGINE_OPTIONS = {"host_work": "host_work", "snapshot_copy": "snapshot_copy", "exchange": "paths"}
"""``--engine`` keys -> the :class:`baft.config.ExchangeConfig` fields they set."""
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
    (e.g. ``host_work=always,snapshot_copy=thread``: to measure them); empty = defaults."""

    def validate(self) -> None:
        for name in ("num_blocks", "block_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('num_', '').replace('_', '-')} must be >= 1")
        if self.num_switch_iters < 0 or self.num_warmup < 0:
            raise ValueError("--warmup and the switch iterations must be >= 0")
        unknown = [m for m in self.modes if m not in ALL_MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}: choose from {', '.join(ALL_MODES)}")
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
        if mode != "baft":  # the baselines of the engine protect the whole state
            ck.policy.full_every = 1
        ck.store.root = self.store_root
        ck.store.job_id = engine_job_id(self.out_dir, mode)
        ck.persist.dir = str(Path(self.out_dir) / "ckpt" / f"{mode}-dcp")
        if self.compute == "emulated":
            ck.exchange.snapshot_copy = "thread"  # the host is free while the device computes
        for key, value in self.engine_options().items():
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

    def total_iterations(self) -> int:
        per_mode = self.num_warmup + self.num_blocks * (self.num_switch_iters + self.block_iters)
        profile = sum(
            self.engine_checkpoint(m).profile_iters for m in self.modes if m in ENGINE_MODES
        )
        return self.num_warmup + len(self.modes) * per_mode + profile

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


def _make_mode(mode: str, bcfg: OverheadConfig, cfg: Any, mesh: Any, trainer: Any) -> Any:
    """The hooks object of ``mode`` (None for ``none``). Collective."""
    from baft_bench.baselines import make_baseline

    if mode == "none":
        return None
    if mode in BASELINE_MODES:
        return make_baseline(mode, trainer, Path(bcfg.out_dir) / "ckpt")
    if mode in PEER_MODES:
        from baft_bench.peers import make_peer

        return make_peer(
            mode,
            trainer,
            Path(bcfg.out_dir) / "ckpt",
            out_dir=bcfg.out_dir,
            ranks_per_node=bcfg.ranks_per_node,
        )
    from baft.engine.build import build_engine
    from baft.engine.scheduling import AllAtStart, BubbleAware

    run_dir = Path(bcfg.out_dir) / f"engine-{mode}"
    run_dir.mkdir(parents=True, exist_ok=True)
    scheduling = AllAtStart() if mode == "naive-async" else BubbleAware()
    ck = bcfg.engine_checkpoint(mode)
    return build_engine(ck, run_dir, mesh, trainer.runner, scheduling=scheduling)


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
        trainer.hooks = None  # the engine installs itself; the harness decides
    return {m: hooks[m] for m in bcfg.modes if m in hooks}, skipped


def _close(hooks: Any) -> None:
    for name in ("drain", "close", "shutdown"):
        fn = getattr(hooks, name, None)
        if callable(fn):
            fn()
            if name != "drain":
                return


def _switch(trainer: Any, hooks: Any, on: bool) -> None:
    """Turn a mode on (install its hooks) or off (disable, drain background work)."""
    if hooks is None:
        trainer.hooks = None
        return
    hooks.enabled = on
    if on:
        trainer.hooks = hooks
        return
    drain = getattr(hooks, "drain", None)
    if callable(drain):
        drain()
    trainer.hooks = None


def _run_block(trainer: Any, hooks: Any, first: int, num: int) -> list[list[float]]:
    """Run ``num`` iterations from ``first``; rows of this rank's FIELDS values."""
    rows = []
    for it in range(first, first + num):
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start, cpu0 = time.perf_counter(), time.process_time()
        res = trainer.run_step(it)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        m = getattr(hooks, "last_metrics", None) or {}
        nbytes = m.get("bytes", 0.0)
        pull = net = 0.0
        if isinstance(nbytes, dict):  # the engine reports {"snapshot", "send", "recv", "pull"}
            pull, net = float(nbytes.get("pull", 0)), float(nbytes.get("recv", 0))
            nbytes = nbytes.get("snapshot", 0)
        seconds = m.get("seconds") or {}
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
    it = 0
    _run_block(trainer, None, it, bcfg.num_warmup)
    it += bcfg.num_warmup
    hooks, skipped = _build_modes(bcfg, cfg, mesh, trainer)
    for mode, why in skipped.items():
        if rank == 0:
            _log(f"skipping {mode}: {why}")
    for h in hooks.values():  # first-call costs (allocation, profiling, planning) unmeasured
        num = bcfg.num_warmup
        if callable(getattr(h, "start", None)):  # the engine profiles, then plans
            h.start(it)
            num += getattr(getattr(h, "ck", None), "profile_iters", 0)
        _switch(trainer, h, True)
        _run_block(trainer, h, it, num)
        it += num
        _switch(trainer, h, False)
    facts = torch.zeros(2, world, dtype=torch.float64)
    facts[0, rank] = measure_sync_snapshot(trainer)
    facts[1, rank] = state_nbytes(trainer)
    dist.all_reduce(facts)
    samples = _measure(bcfg, trainer, hooks, it, rank, world)
    for h in hooks.values():
        _close(h)
    if rank != 0:
        return None
    return {
        "config": bcfg.to_dict(),
        "world_size": world,
        "snapshot_s": facts[0].tolist(),
        "state_bytes": [int(b) for b in facts[1].tolist()],
        "emulated_times": cfg.emulated_times,
        "skipped": skipped,
        "modes": samples,
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
