"""``baft bench reduction``: what elastic replicas' deterministic gradient reduction costs
next to the plain all-reduce, measured with the overhead bench's method.

A job with elastic replicas (``CheckpointConfig.elastic``, :mod:`baft.pipeline.elastic`)
reduces its replicas' gradients at the end of its replicas' loop. With
``deterministic=True`` every rank's flat gradients are all-gathered over the stage's DP
group and summed in replica order (the same additions whatever the DP degree), so the
rank holds ``R`` gradients at once; without elastic replicas one all-reduce does it. This
bench runs one torchrun job of ``dp`` ranks per stage (gloo), each holding a flat gradient
the size of one pipeline stage of the overhead bench's default model (``--grad-mib`` to
override), and times one reduction per arm:

- ``allreduce``: the old path, ``StepRunner._allreduce_grads`` itself (cat, all_reduce,
  divide by ``dp``, copy back), called on a stand-in runner;
- ``deterministic``: ``VirtualReplicas._reduce`` itself, one replica per rank
  (``R = dp``): the replica's flat gradient (a buffer kept across iterations), the fixed
  tree over the replicas (two ranks: their halves added by one all_reduce; more: the
  subtree sums all-gathered), divide by ``R``, copy back;
- ``sum-allreduce``: ``VirtualReplicas._reduce`` with ``deterministic=False``;
- ``deterministic-shrunk``: ``VirtualReplicas._reduce`` on a rank that computes all ``R``
  replicas itself (what a job shrunk to one rank per stage runs): no collective, the
  local tree sum.

**Method** (the overhead bench's, :mod:`baft_bench.stats`): the arms run interleaved in
rounds inside one launch, each round in another order (a Williams design); per round each
arm runs ``switch_reps`` unmeasured reductions, then a block of ``block_reps`` measured
ones. Every reduction starts from the same gradients (restored, untimed) after a barrier;
its seconds are the max over ranks (the slowest rank sets the pace), a block's value the
median of its reductions. Reported per arm: ms per reduction (median over every measured
reduction) and the paired ratio to ``allreduce`` (median over rounds of the block over the
same round's ``allreduce`` block), the added ms (median over rounds of the paired
difference) and that as a share of the overhead bench's iteration, each with its 95%
percentile bootstrap interval over rounds (resampled within each launch when
``--launches`` pools several fresh launches).

After the rounds each launch checks bit-identity: the ``deterministic`` result on ``dp``
ranks against the ``deterministic-shrunk`` one and against ``allreduce`` (for ``R = 2``
the sum of two is the same either way round), and, with ``--check-replicas R'`` (default
``2 dp``), ``R'`` replicas on ``dp`` ranks (``R'/dp`` per rank) reduced deterministically
against one rank computing all ``R'`` and against ``deterministic=False``. It also
records each arm's transient memory: the rise of the process's resident high-water mark
(``VmHWM``) over one reduction.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from baft_bench.stats import (
    LEVEL,
    RESAMPLES,
    SEED,
    bootstrap_ci,
    default_rounds,
    design_summary,
    format_ci,
    median_of_ratios,
    noise_words,
    point,
    round_order,
)

ARMS = ("allreduce", "deterministic", "sum-allreduce", "deterministic-shrunk")
"""Every arm, in the order of the page."""
REFERENCE = "allreduce"
"""The arm every ratio is taken against: the reduction without elastic replicas."""
RAW_FILE = "reduction-raw.json"
"""Name of the raw results rank 0 writes under the run directory."""
DEFAULT_ITERATION_FROM = ("benchmarks/results/attribution-2026-12-07/final-after-2launches.json",)
"""``baft bench overhead --json`` results whose ``none`` iteration (wall ms per iteration)
the added ms are set against: the newest run of the overhead bench's default shape."""
CHUNK_ELEMENTS = 1 << 20
"""Parameter size with ``--grad-mib`` (4 MiB of float32 each, the default model's largest)."""


@dataclass(kw_only=True, slots=True)
class ReductionConfig:
    """What ``baft bench reduction`` runs."""

    num_pp: int = 1
    """Pipeline stages: each has its own DP group of ``num_dp`` ranks (reducing at once)."""
    num_dp: int = 2
    """Ranks per stage; ``R = num_dp`` replicas, one per rank."""
    grad_mib: float | None = None
    """Gradient MiB per rank; None: one pipeline stage of the overhead bench's default model
    (its parameter shapes, stage ``s`` of ``max(2, num_pp)``)."""
    num_rounds: int = 8
    """Rounds per launch, one block per arm each."""
    block_reps: int = 5
    """Measured reductions per block."""
    switch_reps: int = 1
    """Unmeasured reductions an arm runs before its block."""
    warmup: int = 2
    """Unmeasured reductions per arm before the first round."""
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    """Arms in order; must include ``allreduce``."""
    check_replicas: int = 4
    """Replicas of the order check after the rounds (a multiple of ``num_dp``; 0: none)."""
    seed: int = 0
    """Seed of the gradients' values."""
    out_dir: str = "runs/bench-reduction"
    """Run directory: config and raw results."""

    @property
    def world_size(self) -> int:
        return self.num_pp * self.num_dp

    @property
    def num_replicas(self) -> int:
        return self.num_dp

    def validate(self) -> None:
        if self.num_pp < 1 or self.num_dp < 2:
            raise ValueError(f"--pp {self.num_pp} --dp {self.num_dp}: need pp >= 1 and dp >= 2")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or REFERENCE not in self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(
                f"--arms {','.join(self.arms)}: each of {', '.join(ARMS)} at most once, "
                f"{REFERENCE} among them"
            )
        if self.grad_mib is not None and self.grad_mib <= 0:
            raise ValueError(f"--grad-mib {self.grad_mib} must be > 0")
        if min(self.num_rounds, self.block_reps) < 1 or min(self.switch_reps, self.warmup) < 0:
            raise ValueError("--rounds and --block-reps must be >= 1, the others >= 0")
        if self.check_replicas < 0 or self.check_replicas % self.num_dp:
            raise ValueError(
                f"--check-replicas {self.check_replicas} must be 0 or a multiple of --dp "
                f"{self.num_dp}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReductionConfig:
        return cls(**d)


def stage_shapes(cfg: ReductionConfig, stage: int) -> list[tuple[int, ...]]:
    """The gradient shapes of pipeline stage ``stage``: the parameters of stage ``stage``
    of the overhead bench's default model split in ``max(2, num_pp)`` stages (built on the
    meta device), or ``grad_mib`` MiB of float32 in parameters of :data:`CHUNK_ELEMENTS`."""
    if cfg.grad_mib is not None:
        n = int(cfg.grad_mib * 2**20) // 4
        chunks: list[tuple[int, ...]] = []
        while n > 0:
            chunks.append((min(n, CHUNK_ELEMENTS),))
            n -= CHUNK_ELEMENTS
        return chunks
    import torch

    from baft.model.gpt import build_stage_module
    from baft_bench.overhead import OverheadConfig

    model = OverheadConfig().train_config().model
    with torch.device("meta"):
        module = build_stage_module(model, stage, max(2, cfg.num_pp), 0)
    return [tuple(p.shape) for p in module.parameters()]


# ------------------------------------------------------------------ the worker
def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def replica_grads(shapes: list[tuple[int, ...]], seed: int, stage: int, r: int) -> list[Any]:
    """Replica ``r``'s gradients of stage ``stage``: the same values on every rank (any
    rank can compute any replica, as after a shrink), normal with magnitudes spread over
    a few binades so that sums round."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + stage * 1009 + r)
    return [torch.randn(s, generator=gen) * 2.0 ** (i % 7 - 3) for i, s in enumerate(shapes)]


class _Slot:
    """The runner's protected slot, reduced to running the collective's wait."""

    def slot(self, tl: Any, name: str, kind: str, fn: Any) -> None:
        fn()


class Arm:
    """One arm on this rank: the real reduction code over working copies of the replicas'
    gradients (``work``, shared by the arms), restored from ``pristine`` before every
    reduction."""

    def __init__(
        self,
        name: str,
        params: list[Any],
        state: Any,
        pristine: dict[int, list[Any]],
        work: dict[int, list[Any]],
        *,
        hosted: range,
        num_replicas: int,
        deterministic: bool,
        dp_group: Any,
    ) -> None:
        from baft.pipeline.elastic import VirtualReplicas
        from baft.pipeline.step import StepRunner

        self.name, self.params, self.hosted = name, params, hosted
        self.pristine = {r: pristine[r] for r in hosted}
        self.work = {r: work[r] for r in hosted}  # shared by the arms: restored each time
        if name == REFERENCE:  # StepRunner._allreduce_grads itself, on a stand-in runner
            num_dp = num_replicas
            runner = SimpleNamespace(
                params=params, mesh=SimpleNamespace(dp_group=dp_group), protected=_Slot(),
                num_dp=num_dp,
            )  # fmt: skip
            self.reduce = lambda: StepRunner._allreduce_grads(runner, None)  # type: ignore[arg-type]
            return
        self.vr = VirtualReplicas(
            state, params, hosted=hosted, num_replicas=num_replicas,
            deterministic=deterministic, dp_group=dp_group,
        )  # fmt: skip
        self.reduce = self.vr._reduce

    def prepare(self) -> None:
        """The gradients as the replicas' loop leaves them: every hosted replica's kept
        apart (``VirtualReplicas._grads``), the last one's in ``p.grad``."""
        for r, work in self.work.items():
            for dst, src in zip(work, self.pristine[r], strict=True):
                dst.copy_(src)
        last = self.work[self.hosted[-1]]
        for p, g in zip(self.params, last, strict=True):
            p.grad = g
        if self.name != REFERENCE:
            self.vr._grads = dict(self.work)

    def result(self) -> Any:
        """The reduced gradient, flat."""
        import torch

        return torch.cat([p.grad.reshape(-1) for p in self.params])


def _setup(cfg: ReductionConfig, mesh: Any, replicas: int) -> tuple[list[Any], Any, dict]:
    """This rank's parameters (untouched storage: only their shapes are read), a
    TrainingState over them (plain SGD: no optimizer state) and every replica's gradients."""
    import torch

    from baft.pipeline.state import TrainingState

    stage = mesh.coords.pp
    shapes = stage_shapes(cfg, stage)
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(s)) for s in shapes])
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    state = TrainingState([module], opt, install_step_hook=False)
    pristine = {r: replica_grads(shapes, cfg.seed, stage, r) for r in range(replicas)}
    return params, state, pristine


def _arms(cfg: ReductionConfig, mesh: Any, names: list[str], replicas: int) -> dict[str, Arm]:
    params, state, pristine = _setup(cfg, mesh, replicas)
    k = replicas // cfg.num_dp
    mine = range(mesh.coords.dp * k, (mesh.coords.dp + 1) * k)
    spec = {
        "allreduce": (mine, False, mesh.dp_group),
        "deterministic": (mine, True, mesh.dp_group),
        "sum-allreduce": (mine, False, mesh.dp_group),
        "deterministic-shrunk": (range(replicas), True, None),
    }
    work = {r: [t.clone() for t in g] for r, g in pristine.items()}
    return {
        n: Arm(n, params, state, pristine, work, hosted=spec[n][0], num_replicas=replicas,
               deterministic=spec[n][1], dp_group=spec[n][2])
        for n in names
    }  # fmt: skip


def _timed(arm: Arm) -> float:
    """Seconds of one reduction, from the same gradients, after a barrier."""
    import torch.distributed as dist

    arm.prepare()
    dist.barrier()
    start = time.perf_counter()
    arm.reduce()
    return time.perf_counter() - start


def _gather(values: list[float], world: int) -> list[list[float]]:
    """Per reduction, every rank's seconds (one collective per block)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return torch.stack(every).t().tolist()


def _digest(t: Any) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def _compare(a: Any, b: Any) -> dict[str, Any]:
    """Bit-identity of two flat results: equal, and how many elements differ."""
    import torch

    differ = int((a.view(torch.int32) != b.view(torch.int32)).sum())
    return {"identical": differ == 0, "differing": differ, "of": a.numel()}


def _results(arms: dict[str, Arm]) -> dict[str, Any]:
    """Each arm's reduced gradient (flat), from the same gradients."""
    out = {}
    for name, arm in arms.items():
        arm.prepare()
        arm.reduce()
        out[name] = arm.result()
    return out


PAIRS = (
    ("deterministic", "deterministic-shrunk"),
    ("deterministic", "allreduce"),
    ("deterministic", "sum-allreduce"),
)
"""The results compared bit for bit after the rounds."""


def _check(mesh: Any, arms: dict[str, Arm]) -> dict[str, Any]:
    """This rank's bit-identity verdicts of the timed arms and their results' digests."""
    results = _results(arms)
    return {
        "stage": mesh.coords.pp,
        "dp": mesh.coords.dp,
        "digests": {n: _digest(t) for n, t in results.items()},
        "pairs": {
            f"{a} == {b}": _compare(results[a], results[b])
            for a, b in PAIRS
            if a in results and b in results
        },
    }


def _order_check(cfg: ReductionConfig, mesh: Any) -> dict[str, Any]:
    """``check_replicas`` replicas, ``check_replicas / dp`` per rank: the deterministic
    reduction against one rank computing them all and against ``deterministic=False``."""
    r = cfg.check_replicas
    names = ["deterministic", "deterministic-shrunk", "sum-allreduce"]
    res = _results(_arms(cfg, mesh, names, r))
    return {
        "replicas": r,
        f"{r} replicas: deterministic ({r // cfg.num_dp} per rank) == deterministic-shrunk "
        f"(all {r} on one rank)": _compare(res["deterministic"], res["deterministic-shrunk"]),
        f"{r} replicas: deterministic == sum-allreduce ({r // cfg.num_dp} per rank)":
            _compare(res["deterministic"], res["sum-allreduce"]),
    }  # fmt: skip


def _memory(arms: dict[str, Arm]) -> dict[str, int | None]:
    """Per arm, the rise of this process's resident high-water mark over one reduction
    (bytes; None where the kernel refuses to reset it)."""
    import gc

    import torch.distributed as dist

    from baft_bench.memory import reset_rss_peak, rss_bytes, rss_peak_bytes

    out: dict[str, int | None] = {}
    for name, arm in arms.items():
        arm.prepare()
        gc.collect()
        dist.barrier()
        ok = reset_rss_peak()
        before = rss_bytes()
        arm.reduce()
        out[name] = max(rss_peak_bytes() - before, 0) if ok else None
    return out


GATHER_ALONE = "all_gather_into_tensor alone"
"""The memory row of the bare collective: one gradient gathered into a preallocated,
touched output (what the backend itself allocates)."""


def _gather_memory(arms: dict[str, Arm], dp_group: Any, num_dp: int) -> int | None:
    """The rise of the resident high-water mark over ``all_gather_into_tensor`` of this
    rank's flat gradient into a preallocated output (bytes; None where not measurable)."""
    import torch
    import torch.distributed as dist

    from baft_bench.memory import reset_rss_peak, rss_bytes, rss_peak_bytes

    mine = next(iter(arms.values())).result()
    every = torch.zeros(mine.numel() * num_dp)
    dist.all_gather_into_tensor(every, mine, group=dp_group)  # warm: the backend's first call
    dist.barrier()
    ok = reset_rss_peak()
    before = rss_bytes()
    dist.all_gather_into_tensor(every, mine, group=dp_group)
    return max(rss_peak_bytes() - before, 0) if ok else None


def run_worker(cfg: ReductionConfig) -> dict[str, Any] | None:
    """Run the rounds on this rank; rank 0 returns the raw results, the others None."""
    import torch
    import torch.distributed as dist

    from baft.pipeline.mesh import init_mesh
    from baft.train.config import ParallelConfig

    torch.set_num_threads(1)
    mesh = init_mesh(ParallelConfig(num_dp=cfg.num_dp, num_pp=cfg.num_pp, ranks_per_node=1))
    rank, world = mesh.rank, dist.get_world_size()
    arms = _arms(cfg, mesh, cfg.arms, cfg.num_replicas)
    grad_bytes = torch.zeros(world, dtype=torch.float64)
    grad_bytes[rank] = sum(p.numel() * p.element_size() for p in next(iter(arms.values())).params)
    dist.all_reduce(grad_bytes)
    for arm in arms.values():
        for _ in range(cfg.warmup):
            _timed(arm)
    rep_s: dict[str, list[list[float]]] = {n: [] for n in cfg.arms}
    orders = []
    for i in range(cfg.num_rounds):
        order = round_order(cfg.arms, i)
        orders.append(order)
        for name in order:
            for _ in range(cfg.switch_reps):
                _timed(arms[name])
            times = [_timed(arms[name]) for _ in range(cfg.block_reps)]
            rep_s[name] += _gather(times, world)
        if rank == 0:
            _log(f"round {i + 1}/{cfg.num_rounds}: {', '.join(order)}")
    memory: dict[str, int | None] = _memory(arms)
    memory[GATHER_ALONE] = _gather_memory(arms, mesh.dp_group, cfg.num_dp)
    mem_rows: list[Any] = [None] * world
    dist.all_gather_object(mem_rows, memory)
    mine = _check(mesh, arms)
    del arms  # the order check builds its own replicas
    if cfg.check_replicas:
        mine["order"] = _order_check(cfg, mesh)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, mine)
    if rank != 0:
        return None
    return {
        "config": cfg.to_dict(),
        "world_size": world,
        "grad_bytes": [int(b) for b in grad_bytes.tolist()],
        "rounds": cfg.num_rounds,
        "orders": orders,
        "arms": {n: {"rep_s": rep_s[n]} for n in cfg.arms},
        "memory": {n: [row[n] for row in mem_rows] for n in [*cfg.arms, GATHER_ALONE]},
        "identity": {"ranks": rows},
    }


def main(argv: list[str] | None = None) -> int:
    """Worker entry (one process per rank, under torchrun)."""
    from baft.train.worker import process_main

    argv = sys.argv[1:] if argv is None else argv
    cfg = ReductionConfig.from_dict(json.loads(Path(argv[0]).read_text()))

    def body() -> None:
        start = time.time()
        raw = run_worker(cfg)
        if raw is not None:
            raw["wall_s"] = time.time() - start
            (Path(cfg.out_dir) / RAW_FILE).write_text(json.dumps(raw) + "\n")

    return process_main(body)


# ------------------------------------------------------------------ launching
def _launch(cfg: ReductionConfig, timeout_s: float) -> dict[str, Any]:
    """One torchrun job of the workers (output to stderr); returns its raw JSON."""
    from baft_bench.command import bench_env

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RAW_FILE).unlink(missing_ok=True)
    cfg_path = out / "reduction-config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={cfg.world_size}", "--monitor-interval=0.1",
        "-m", "baft_bench.reduction", str(cfg_path),
    ]  # fmt: skip
    env = bench_env()
    env.setdefault("BAFT_HANG_DUMP_S", str(int(timeout_s)))
    try:
        rc = subprocess.run(cmd, env=env, stdout=2, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"benchmark did not finish in {timeout_s:.0f} s") from None
    if rc != 0 or not (out / RAW_FILE).is_file():
        raise RuntimeError(f"benchmark workers failed (exit code {rc}); see the log above")
    raw: dict[str, Any] = json.loads((out / RAW_FILE).read_text())
    return raw


def measure(cfg: ReductionConfig, *, timeout_s: float, launches: int) -> dict[str, Any]:
    """``launches`` fresh torchrun jobs of ``cfg``, one after the other; the raw results
    pooled as ``{"config", "launches": [raw, ...], "machine"}``."""
    from baft_bench.command import ALLOCATOR_ENV, bench_env, machine_info

    load_before = os.getloadavg()[0]
    raws = []
    for i in range(launches):
        _log(
            f"reduction: launch {i + 1}/{launches}, arms {', '.join(cfg.arms)}, "
            f"{cfg.num_rounds} rounds on {cfg.world_size} ranks -> {cfg.out_dir}"
        )
        raws.append(_launch(cfg, timeout_s))
    machine = machine_info()
    machine["load_before"] = round(load_before, 2)
    machine["load_after"] = round(os.getloadavg()[0], 2)
    env = bench_env()
    machine["malloc"] = {k: env[k] for k in ALLOCATOR_ENV}
    return {"config": cfg.to_dict(), "launches": raws, "machine": machine}


# ------------------------------------------------------------------ the numbers (pure)
def median_of_values(x: np.ndarray) -> np.ndarray:
    """Median over all values of the (resampled) rounds: shape (samples, rounds, values)."""
    return np.asarray(np.median(x.reshape(x.shape[0], -1), axis=1))


def median_of_differences(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Median over rounds of ``num - den`` per round (the paired difference)."""
    return np.asarray(np.median(num - den, axis=1))


def per_round_ms(rep_s: list[list[float]], rounds: int) -> list[list[float]]:
    """One arm's reductions as ms per round (each the max over ranks), block by block."""
    per = [max(row) * 1e3 for row in rep_s]
    size = len(per) // rounds
    if size * rounds != len(per) or size < 1:
        raise ValueError(f"{len(per)} reductions do not split into {rounds} equal blocks")
    return [per[i * size : (i + 1) * size] for i in range(rounds)]


def iteration_refs(paths: list[str]) -> list[dict[str, Any]]:
    """The ``none`` iteration (wall ms per iteration, else the median) of each ``baft bench
    overhead --json`` result; a missing or unreadable file is skipped with a note."""
    out = []
    for path in paths:
        try:
            none = json.loads(Path(path).read_text())["modes"]["none"]
        except (OSError, KeyError, ValueError) as exc:
            _log(f"note: no iteration time from {path} ({type(exc).__name__}: {exc})")
            continue
        s = none.get("wall_per_iter_s") or none["median_iter_s"]
        out.append({"source": path, "iteration_ms": s * 1e3})
    return out


def _ci(stat: Any, *per_round: Any, strata: list[int]) -> dict[str, float]:
    value = point(stat, *per_round)
    low, high = bootstrap_ci(stat, *per_round, strata=strata)
    return {"value": value, "low": low, "high": high}


def summarize(raw: dict[str, Any], refs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The reported numbers from the raw results of one or several launches: per arm ms
    per reduction, paired ratio and added ms against ``allreduce`` (and per launch),
    their share of each reference iteration, memory, and the bit-identity verdicts."""
    launches = raw.get("launches") or [raw]
    cfg = raw.get("config", launches[0]["config"])
    strata = [int(r["rounds"]) for r in launches]
    names = [n for n in cfg["arms"] if all(n in r["arms"] for r in launches)]
    rounds = {
        n: [blk for r in launches for blk in per_round_ms(r["arms"][n]["rep_s"], r["rounds"])]
        for n in names
    }
    blocks = {n: [statistics.median(b) for b in rounds[n]] for n in names}
    ref = blocks[REFERENCE]
    arms: dict[str, Any] = {}
    for n in names:
        m: dict[str, Any] = {
            "ms": _ci(median_of_values, rounds[n], strata=strata),
            "reductions": sum(len(b) for b in rounds[n]),
        }
        if n != REFERENCE:
            m["ratio"] = _ci(median_of_ratios, blocks[n], ref, strata=strata)
            m["added_ms"] = _ci(median_of_differences, blocks[n], ref, strata=strata)
            m["of_iteration"] = [
                {**it, **{k: m["added_ms"][k] / it["iteration_ms"] for k in ("value", "low", "high")}}
                for it in refs or []
            ]  # fmt: skip
            m["per_launch"] = []
            start = 0
            for size in strata:
                part = slice(start, start + size)
                m["per_launch"].append(
                    _ci(median_of_ratios, blocks[n][part], ref[part], strata=[size])
                )
                start += size
        mem = [r.get("memory", {}).get(n) for r in launches]
        if all(isinstance(x, list) for x in mem):
            m["memory_bytes"] = [max(col, default=None) for col in zip(*mem, strict=True)]
        arms[n] = m
    alone = [r.get("memory", {}).get(GATHER_ALONE) for r in launches]
    return {
        "config": cfg,
        "machine": raw.get("machine", {}),
        "gather_memory_bytes": (
            [max(col, default=None) for col in zip(*alone, strict=True)]
            if all(isinstance(x, list) for x in alone)
            else None
        ),
        "grad_bytes": launches[0]["grad_bytes"],
        "launches": len(launches),
        "launch_rounds": strata,
        "design": design_summary(len(names), strata[0]),
        "bootstrap": {
            "resamples": RESAMPLES,
            "seed": SEED,
            "level": LEVEL,
            "unit": "round",
            "strata": "launch",
        },  # fmt: skip
        "arms": arms,
        "identity": identity_summary([r.get("identity") or {} for r in launches]),
        "iteration_refs": refs or [],
        "wall_s": sum(r.get("wall_s") or 0.0 for r in launches),
    }


def identity_summary(per_launch: list[dict[str, Any]]) -> dict[str, Any]:
    """Per check, whether it held on every rank of every launch (and the most elements
    that differed), plus whether the DP ranks of a stage agree on every arm's result."""
    checks: dict[str, dict[str, Any]] = {}
    agree = True
    for launch in per_launch:
        ranks = launch.get("ranks") or []
        for row in ranks:
            found = {**row.get("pairs", {}), **{
                k: v for k, v in (row.get("order") or {}).items() if isinstance(v, dict)
            }}  # fmt: skip
            for name, v in found.items():
                c = checks.setdefault(name, {"identical": True, "max_differing": 0, "of": v["of"]})
                c["identical"] = c["identical"] and v["identical"]
                c["max_differing"] = max(c["max_differing"], v["differing"])
        by_stage: dict[int, list[dict[str, str]]] = {}
        for row in ranks:
            by_stage.setdefault(row["stage"], []).append(row["digests"])
        for rows in by_stage.values():
            for name in rows[0]:
                if name != "deterministic-shrunk" and len({d[name] for d in rows}) > 1:
                    agree = False
    return {"checks": checks, "dp_ranks_agree": agree, "launches": len(per_launch)}


# ------------------------------------------------------------------ the page
def _ms(c: dict[str, float] | None, spec: str = ".1f") -> str:
    if not c:
        return "-"
    return f"{c['value']:{spec}} [{c['low']:{spec}}, {c['high']:{spec}}]"


def _pct(c: dict[str, Any]) -> str:
    return f"{c['value']:.1%} [{c['low']:.1%}, {c['high']:.1%}]"


def render_markdown(result: dict[str, Any], *, command: str, date: str) -> str:
    """The results page: machine, command, the table per arm, identity and memory."""
    cfg, mach = result["config"], result["machine"]
    r, dp = cfg["num_dp"], cfg["num_dp"]
    grad = [b / 2**20 for b in result["grad_bytes"]]
    strata = result["launch_rounds"]
    lines = [
        "# What the deterministic gradient reduction of elastic replicas costs",
        "",
        f"- date: {date}",
        f"- machine: {mach.get('nproc')} CPUs ({mach.get('cpu_model')}), {mach.get('ram_gib')} "
        f"GiB RAM, torch {mach.get('torch')}, python {mach.get('python')}, gloo; 1-min load "
        f"average {mach.get('load_before', '?')} before, {mach.get('load_after', '?')} after",
        f"- command: `{command}`",
        f"- layout: pp={cfg['num_pp']} x dp={dp} ({cfg['num_pp'] * dp} ranks), R={r} replicas "
        f"(one per rank); gradient per rank "
        + ", ".join(f"{g:.1f} MiB" for g in sorted(set(grad)))
        + (
            " (one pipeline stage of the overhead bench's default model)"
            if cfg.get("grad_mib") is None
            else " (--grad-mib)"
        ),  # fmt: skip
        f"- rounds: {sum(strata)} ("
        + (
            "one launch"
            if len(strata) == 1
            else f"{len(strata)} fresh launches of " + "/".join(map(str, strata)) + ", pooled"
        )  # fmt: skip
        + f"), each round one block of {cfg['block_reps']} measured reductions per arm after "
        f"{cfg['switch_reps']} unmeasured, arms interleaved (Williams design: "
        f"{result['design']['note']}); {cfg['warmup']} warm-up reductions per arm",
        "",
        "| arm | what runs | ms per reduction [95% CI] | ratio to allreduce [95% CI] "
        "| added ms [95% CI] | reductions |",
        "|---|---|---|---|---|---|",
    ]
    what = {
        "allreduce": "StepRunner._allreduce_grads: cat, all_reduce, / dp, copy back",
        "deterministic": "VirtualReplicas._reduce: flat buffer, tree sum (2 ranks: one all_reduce; more: all_gather of subtree sums), / R, copy back",  # fmt: skip
        "sum-allreduce": "VirtualReplicas._reduce, deterministic=False: flat buffer, local tree sum, all_reduce, / R, copy back",  # fmt: skip
        "deterministic-shrunk": f"VirtualReplicas._reduce, all {r} replicas on one rank: {r} flat buffers, local tree sum, / R, no collective",  # fmt: skip
    }
    for name, m in result["arms"].items():
        ratio = m.get("ratio")
        lines.append(
            f"| {name} | {what.get(name, '')} | {_ms(m['ms'])} "
            f"| {format_ci(ratio['value'], ratio['low'], ratio['high']) if ratio else '1 (reference)'} "
            f"| {_ms(m.get('added_ms'))} | {m['reductions']} |"
        )
    lines += ["", "Against `allreduce` (paired ratio, 95% CI over rounds):", ""]
    for name, m in result["arms"].items():
        if "ratio" not in m:
            continue
        ratio = m["ratio"]
        parts = [
            f"{format_ci(ratio['value'], ratio['low'], ratio['high'])}: "
            + noise_words(ratio["low"], ratio["high"])
        ]
        if len(m.get("per_launch") or []) > 1:
            parts.append(
                "per launch "
                + ", ".join(format_ci(x["value"], x["low"], x["high"]) for x in m["per_launch"])
            )
        for it in m.get("of_iteration") or []:
            parts.append(
                f"added {_pct(it)} of the overhead bench's {it['iteration_ms']:.1f} ms "
                f"iteration (`none`, {it['source']})"
            )
        lines.append(f"- `{name}`: " + "; ".join(parts))
    lines += ["", *_identity_lines(result), *_memory_lines(result)]
    lines += [
        "- Method: each reduction starts from the same gradients (restored before it, "
        "untimed) after a barrier; its time is the max over ranks; a block's value is the "
        "median of its reductions. ms per reduction: median over every measured reduction; "
        "ratio: median over rounds of the arm's block over the same round's `allreduce` "
        "block; added ms: median over rounds of their difference. Intervals: 95% percentile "
        f"bootstrap over rounds ({RESAMPLES} resamples, seeded, within each launch), "
        "`baft_bench.stats`.",
        "- Timings on a shared 2-core machine are noisy: compare arms within this run only.",
        "",
    ]
    return "\n".join(lines)


def _identity_lines(result: dict[str, Any]) -> list[str]:
    ident = result["identity"]
    launches = ident.get("launches", 0)
    lines = [f"Bit-identity (every rank, each of the {launches} launch(es)):", ""]
    for name, c in ident["checks"].items():
        verdict = (
            "identical"
            if c["identical"]
            else f"NOT identical (up to {c['max_differing']} of {c['of']} elements differ)"
        )
        lines.append(f"- `{name}`: {verdict}")
    lines.append(
        "- the DP ranks of each stage hold the same result of every collective arm: "
        + ("yes" if ident["dp_ranks_agree"] else "NO")
    )
    return [*lines, ""]


def _mib_list(values: list[int | None] | None) -> str:
    return " / ".join("-" if b is None else f"{b / 2**20:.0f}" for b in values or []) or "-"


def _memory_lines(result: dict[str, Any]) -> list[str]:
    cfg = result["config"]
    r = cfg["num_dp"]
    g = max(result["grad_bytes"]) / 2**20
    formula = {  # allocated per reduction (the elastic arms' flat buffers are kept)
        "allreduce": (1, "the flat gradient, fresh every reduction"),
        "deterministic": (0, "1 G flat buffer kept across iterations; 2 ranks: no gather"),
        "sum-allreduce": (0, "1 G flat buffer kept across iterations"),
        "deterministic-shrunk": (
            1,
            f"{r} G of flat buffers kept; the gradients, stashed per replica, come back new",
        ),
    }
    rows = []
    for name, m in result["arms"].items():
        n, words = formula.get(name, (None, ""))
        cell = "-" if n is None else f"{n} G = {n * g:.0f} ({words})"
        rows.append(f"| {name} | {cell} | {_mib_list(m.get('memory_bytes'))} |")
    lines = [
        "Transient memory of one reduction per rank (G = the flat gradient, "
        f"{g:.1f} MiB): the buffers the reduction's code allocates per reduction, and the measured rise of "
        "the process's resident high-water mark (VmHWM) over one reduction, which includes "
        "what the collective allocates inside gloo (MiB, rank 0 / rank 1 / ...):",
        "",
        "| arm | the code allocates (MiB) | measured peak rise (MiB) |",
        "|---|---|---|",
        *rows,
    ]
    alone = result.get("gather_memory_bytes")
    if alone:
        lines.append(
            f"| (`all_gather_into_tensor` alone, into a preallocated output) | 0 "
            f"| {_mib_list(alone)} |"
        )
    return [*lines, ""]


# ------------------------------------------------------------------ the command line
def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``reduction`` on ``baft bench``'s subparsers."""
    d = ReductionConfig()
    p: argparse.ArgumentParser = sub.add_parser(
        "reduction",
        help="elastic replicas: the deterministic gradient reduction vs the plain all-reduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--pp", type=int, default=d.num_pp, help="pipeline stages, each its own DP group (default %(default)s)")  # fmt: skip
    add("--dp", type=int, default=d.num_dp, help="ranks per stage = replicas R (default %(default)s)")  # fmt: skip
    add("--grad-mib", type=float, default=None, help="gradient MiB per rank (default: one stage of the overhead bench's default model)")  # fmt: skip
    add("--rounds", type=int, default=None, help="rounds per launch (default: whole Williams designs, at least 8)")  # fmt: skip
    add("--launches", type=int, default=1, help="fresh torchrun launches, pooled (default %(default)s)")  # fmt: skip
    add("--block-reps", type=int, default=d.block_reps, help="measured reductions per block (default %(default)s)")  # fmt: skip
    add("--switch-reps", type=int, default=d.switch_reps, help="unmeasured reductions before each block (default %(default)s)")  # fmt: skip
    add("--warmup", type=int, default=d.warmup, help="unmeasured reductions per arm at the start (default %(default)s)")  # fmt: skip
    add("--arms", default=",".join(ARMS), help="comma-separated arms (default %(default)s)")
    add("--check-replicas", type=int, default=None, help="replicas of the order check after the rounds, a multiple of --dp; 0 skips it (default 2 x dp)")  # fmt: skip
    add("--iteration-from", action="append", default=None, metavar="JSON", help="a `baft bench overhead --json` result whose `none` iteration the added ms are set against; repeatable (default: " + ", ".join(DEFAULT_ITERATION_FROM) + ")")  # fmt: skip
    add("--seed", type=int, default=d.seed, help="(default %(default)s)")
    add("--out", default=d.out_dir, help="run directory (default %(default)s)")
    add("--results-dir", default="benchmarks/results", help="where reduction-<date>.md and reduction-<date>/ go (default %(default)s)")  # fmt: skip
    add("--no-results", action="store_true", help="do not write the page")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--timeout", type=float, default=900.0, help="per launch, seconds (default %(default)s)")
    p.set_defaults(func=run_reduction)
    return p


def config_from_args(a: argparse.Namespace) -> ReductionConfig:
    """The validated config of parsed ``bench reduction`` flags (``a.rounds`` and
    ``a.check_replicas`` filled in with their defaults)."""
    if a.launches < 1:
        raise ValueError("--launches must be >= 1")
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    a.rounds, note = default_rounds(len(arms), a.rounds)
    if note:
        _log(f"note: {note}")
    if a.check_replicas is None:
        a.check_replicas = 2 * a.dp
    cfg = ReductionConfig(
        num_pp=a.pp, num_dp=a.dp, grad_mib=a.grad_mib, num_rounds=a.rounds,
        block_reps=a.block_reps, switch_reps=a.switch_reps, warmup=a.warmup, arms=arms,
        check_replicas=a.check_replicas, seed=a.seed, out_dir=a.out,
    )  # fmt: skip
    cfg.validate()
    return cfg


def command_line(a: argparse.Namespace) -> str:
    """The ``baft bench reduction`` command with every flag spelled out."""
    flags = [
        ("--pp", a.pp), ("--dp", a.dp), ("--grad-mib", a.grad_mib), ("--rounds", a.rounds),
        ("--launches", a.launches), ("--block-reps", a.block_reps),
        ("--switch-reps", a.switch_reps), ("--warmup", a.warmup), ("--arms", a.arms),
        ("--check-replicas", a.check_replicas), ("--seed", a.seed), ("--out", a.out),
    ]  # fmt: skip
    words = ["baft", "bench", "reduction"] + [w for f, v in flags if v is not None for w in (f, str(v))]  # fmt: skip
    for path in a.iteration_from or []:
        words += ["--iteration-from", path]
    return shlex.join(words + (["--json"] if a.json else []))


def _print_table(result: dict[str, Any]) -> None:
    print(f"{'arm':<21} {'ms [95% CI]':>24} {'ratio to allreduce [95% CI]':>28} {'added ms [95% CI]':>24}")  # fmt: skip
    for name, m in result["arms"].items():
        ratio = m.get("ratio")
        cell = format_ci(ratio["value"], ratio["low"], ratio["high"]) if ratio else "1 (reference)"
        print(f"{name:<21} {_ms(m['ms']):>24} {cell:>28} {_ms(m.get('added_ms')):>24}")
    for name, c in result["identity"]["checks"].items():
        print(f"bit-identical: {name}: {'yes' if c['identical'] else 'NO'}")


def write_results(
    result: dict[str, Any], raw: dict[str, Any], results_dir: Path, command: str
) -> Path:
    """``reduction-<date>.md`` and ``reduction-<date>/{raw,result}.json``."""
    date = _dt.date.today().isoformat()
    folder = results_dir / f"reduction-{date}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "raw.json").write_text(json.dumps(raw) + "\n")
    (folder / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    path = results_dir / f"reduction-{date}.md"
    page = render_markdown(result, command=command, date=date)
    path.write_text(page + f"\nRaw samples and the summary: [`reduction-{date}/`](reduction-{date}/).\n")  # fmt: skip
    return path


def run_reduction(a: argparse.Namespace) -> int:
    """Run ``baft bench reduction``: measure, write the page, print."""
    try:
        cfg = config_from_args(a)
    except ValueError as exc:
        print(f"baft bench reduction: error: {exc}", file=sys.stderr)
        return 2
    paths = list(a.iteration_from or DEFAULT_ITERATION_FROM)
    try:
        raw = measure(cfg, timeout_s=a.timeout, launches=a.launches)
    except RuntimeError as exc:
        print(f"baft bench reduction: error: {exc}", file=sys.stderr)
        return 1
    result = summarize(raw, iteration_refs(paths))
    if not a.no_results:
        path = write_results(result, raw, Path(a.results_dir), command_line(a))
        _log(f"wrote {path}")
    if a.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
