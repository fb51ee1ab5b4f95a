"""Loss deviation after an elastic shrink, per gradient reduction, beside torchft's
dropped-samples semantics on the same job (README "A host gone for good").

One small job, pp=2 on gloo (CPU), a fixed number R of elastic replicas
(``ElasticConfig(num_replicas=R)``), run in these arms through baft's own API
(``baft.protect``, ``ft.restore()``, ``ft.replicas()``):

- ``unfailed``: dp=2 (4 ranks) for every iteration, deterministic reduction: the
  reference. ``unfailed-sum``: the same with ``deterministic=False`` (the reference of
  ``sum-allreduce``: the job that never failed, with the reduction it was configured with).
- ``deterministic``: 4 ranks to iteration ``--shrink-at``, closed with its stores kept
  (``StoreConfig(keep_on_close=True)``); then 2 ranks (dp=1: the lost host was the second
  DP rank of each stage) restore from memory ("shards of dp=2 ... rebuilt for dp=1") and
  run to the end, each rank computing all R replicas. Every loss and every parameter
  snapshot must equal ``unfailed``'s bit for bit: the script asserts it.
- ``sum-allreduce``: the same shrink with ``deterministic=False`` (each rank sums its
  replicas, then one all-reduce): the same samples, another association of the sums.
- ``dropped``: the same shrink (deterministic reduction), but after it the survivors
  compute only the replicas their DP rank computed before (0 .. R/2-1), and the gradient
  is averaged over those participants only: the reduction (sum over all R replicas, the
  missing ones contributing zeros, divided by R) is scaled by R / participants (a power
  of two: exact). This is torchft's semantics when a replica group is gone and no spare
  joins (``Manager.allreduce``: SUM over the participating groups, then
  ``tensor /= num_participants``), emulated inside the same baft job; torchft does not run.

The data: a fixed synthetic regression set (a random teacher MLP plus noise). Replica r's
micro-batches of iteration i are a pure function of (r, i) (indices drawn from a
generator seeded with both), so every arm sees the same samples per (replica, iteration).
The student: per stage Linear-GELU-Dropout-Linear(-GELU), AdamW, StepLR (the job's),
gradient clipping at 1.0; dropout draws from each replica's RNG stream (``ft.replicas()``
swaps them).

Recorded: the last stage's micro-batch losses per (iteration, replica) (the iteration's
loss is their mean in replica order, the same arithmetic in every arm), and every
``--eval-every`` iterations each stage's parameters, from which the driver computes a
held-out loss (dropout off) and the parameter distance to the reference.

Usage::

    .venv/bin/python benchmarks/elastic_deviation.py --out DIR [--replicas 2,4]

writes ``DIR/<R>/<arm>.json`` (raw per-iteration losses), ``DIR/summary.json`` and prints
the deviation table. Each phase is one ``torchrun --standalone`` launch of this file with
``--worker``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN, HIDDEN, OUT_DIM = 32, 128, 8
N_TRAIN, N_EVAL = 4096, 1024
MICRO, N_MICRO = 16, 2  # per replica and iteration: 2 micro-batches of 16 samples
LR, WEIGHT_DECAY, STEP_SIZE, GAMMA, CLIP = 3e-3, 0.01, 50, 0.5, 1.0
ARMS = ("unfailed", "unfailed-sum", "deterministic", "sum-allreduce", "dropped")
REFERENCE = {"deterministic": "unfailed", "sum-allreduce": "unfailed-sum", "dropped": "unfailed"}


# ---------------------------------------------------------------------------- the job
def dataset() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_eval, y_eval): a random teacher MLP's outputs plus noise."""
    g = torch.Generator().manual_seed(20261207)
    w1 = torch.randn(IN, 64, generator=g) / math.sqrt(IN)
    w2 = torch.randn(64, OUT_DIM, generator=g) / math.sqrt(64)
    x = torch.randn(N_TRAIN + N_EVAL, IN, generator=g)
    y = torch.tanh(x @ w1) @ w2 * 2.0 + 0.1 * torch.randn(N_TRAIN + N_EVAL, OUT_DIM, generator=g)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def batch(
    x: torch.Tensor, y: torch.Tensor, replica: int, iteration: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s micro-batches of ``iteration``: a pure function of both."""
    g = torch.Generator().manual_seed(1_000_003 * (replica + 1) + iteration)
    idx = torch.randint(N_TRAIN, (MICRO * N_MICRO,), generator=g)
    return x[idx], y[idx]


def build_stage(pp: int) -> nn.Sequential:
    """Stage ``pp``'s module; the caller seeds torch first (the same weights on every
    replica of a stage, and every replica's first RNG state)."""
    if pp == 0:
        return nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.GELU(), nn.Dropout(0.1), nn.Linear(HIDDEN, HIDDEN), nn.GELU()
        )
    return nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1), nn.Linear(HIDDEN, OUT_DIM)
    )


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


# ---------------------------------------------------------------------------- a worker
def worker(args: argparse.Namespace) -> None:
    """One rank of one phase (under torchrun): restore, train to ``--stop-at``, record."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import baft

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (2, world // 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    torch.manual_seed(7 + pp)
    module = build_stage(pp)
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=N_MICRO, loss_fn=mse)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=GAMMA)
    x, y, _, _ = dataset()

    ck = baft.CheckpointConfig(
        policy=baft.CheckpointPolicy(redundancy="xor:2", persist_every=0, full_every=1),
        profile_iters=1,
        cost={"copy_Bps": 1e9},
        store=baft.StoreConfig(root=args.store_root, job_id="deviation", keep_on_close=args.keep),
        elastic=baft.ElasticConfig(num_replicas=args.replicas, deterministic=args.deterministic),
    )
    ft = baft.protect(
        schedule=schedule,
        stages=[stage],
        optimizer=opt,
        run_dir=args.run_dir,
        device_mesh=mesh,
        checkpoint=ck,
        ranks_per_node=1,
        state={"lr": sched},
    )
    start = ft.restore()
    record = ft.recovery.record if ft.recovery is not None else {}
    survivors = range(args.replicas // 2) if args.dropped else range(args.replicas)
    losses: dict[int, dict[int, list[float]]] = {}
    hosted: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for it in range(start, args.stop_at):
        opt.zero_grad()
        done: list[int] = []
        for r in ft.replicas():
            if r not in survivors:  # dropped: the lost group's replicas are not computed
                continue
            xb, yb = batch(x, y, r, it)
            if pp == 0:
                schedule.step(xb)
            else:
                mb: list[torch.Tensor] = []
                schedule.step(target=yb, losses=mb)
                losses.setdefault(it, {})[r] = [float(v.detach()) for v in mb]
            done.append(r)
        if args.dropped:
            # torchft: sum over the participating replicas / their number. baft summed
            # over all R (zeros for the ones not computed) and divided by R.
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(args.replicas / len(survivors))
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
        sched.step()
        hosted[it] = done
        if dp == 0 and ((it + 1) % args.eval_every == 0 or it + 1 == args.iterations):
            torch.save(
                {k: v.detach().clone() for k, v in module.state_dict().items()},
                Path(args.params_dir) / f"it{it:04d}.pp{pp}.pt",
            )
    wall = time.perf_counter() - t0
    ft.close()
    Path(args.result).write_text(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "pp": pp,
                "dp": dp,
                "start": start,
                "source": record.get("source", "fresh"),
                "reason": record.get("reason"),
                "losses": {str(k): {str(r): v for r, v in d.items()} for k, d in losses.items()},
                "replicas": {str(k): v for k, v in hosted.items()},
                "wall_s": wall,
            }
        )
    )
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver
def launch(
    nproc: int,
    work: Path,
    phase: str,
    *,
    replicas: int,
    deterministic: bool,
    dropped: bool,
    stop_at: int,
    keep: bool,
    store_root: Path,
    iterations: int,
    eval_every: int,
) -> list[dict[str, Any]]:
    """One phase: ``nproc`` ranks under ``torchrun --standalone``; each rank's record."""
    results = work / f"{phase}.results"
    results.mkdir(parents=True, exist_ok=True)
    (work / "params").mkdir(exist_ok=True)
    torchrun = Path(sys.executable).with_name("torchrun")
    opts = {
        "--replicas": replicas, "--stop-at": stop_at, "--iterations": iterations,
        "--eval-every": eval_every, "--store-root": store_root, "--run-dir": work / "run",
        "--params-dir": work / "params", "--result": results / "rank{rank}.json",
    }  # fmt: skip
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), __file__, "--worker"]
    cmd += [str(v) for kv in opts.items() for v in kv]
    cmd += ["--deterministic"] if deterministic else []
    cmd += ["--dropped"] if dropped else []
    cmd += ["--keep"] if keep else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    )
    with (work / f"{phase}.log").open("wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=3600)
    if rc.returncode:
        tail = (work / f"{phase}.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{phase}: torchrun exited {rc.returncode}\n{tail}")
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_arm(arm: str, replicas: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Run one arm; its per-iteration losses (by replica), phases and parameter files."""
    work = scratch / f"R{replicas}" / arm
    store_root = Path(args.store_root) / f"R{replicas}-{arm}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(store_root, ignore_errors=True)
    common = dict(
        replicas=replicas,
        deterministic=arm != "sum-allreduce" and arm != "unfailed-sum",
        store_root=store_root,
        iterations=args.iterations,
        eval_every=args.eval_every,
    )
    phases: list[tuple[str, list[dict[str, Any]]]] = []
    t0 = time.perf_counter()
    try:
        if arm.startswith("unfailed"):
            ranks = launch(
                4, work, "dp2", dropped=False, stop_at=args.iterations, keep=False, **common
            )
            phases.append(("dp2", ranks))
        else:  # 4 ranks to the shrink, stores kept; then 2 ranks restore from memory
            ranks = launch(
                4, work, "dp2", dropped=False, stop_at=args.shrink_at, keep=True, **common
            )
            phases.append(("dp2", ranks))
            dropped = arm == "dropped"
            ranks = launch(
                2, work, "dp1", dropped=dropped, stop_at=args.iterations, keep=False, **common
            )
            phases.append(("dp1", ranks))
    finally:
        shutil.rmtree(store_root, ignore_errors=True)
    # Later phases overwrite what an earlier one recorded for the same iteration (a
    # restore may go back to an older version and run those iterations again).
    per_it: dict[int, dict[int, list[float]]] = {}
    computed: dict[int, dict[str, list[int]]] = {}
    for _, ranks in phases:
        start = ranks[0]["start"]
        for it in [i for i in per_it if i >= start]:
            del per_it[it]
        for rec in ranks:
            for k, d in rec["losses"].items():
                per_it.setdefault(int(k), {}).update({int(r): v for r, v in d.items()})
            for k, v in rec["replicas"].items():
                computed.setdefault(int(k), {})[f"rank{rec['rank']}"] = v
    its = sorted(per_it)
    assert its == list(range(args.iterations)), (arm, its[:3], its[-3:], len(its))
    return {
        "arm": arm,
        "replicas": replicas,
        "wall_s": time.perf_counter() - t0,
        "phases": [
            {
                "name": name,
                "ranks": len(ranks),
                "start": ranks[0]["start"],
                "source": ranks[0]["source"],
                "reason": ranks[0]["reason"],
                "loop_wall_s": max(r["wall_s"] for r in ranks),
            }
            for name, ranks in phases
        ],
        "shrink_from": phases[-1][1][0]["start"] if len(phases) > 1 else None,
        "losses_by_replica": {it: per_it[it] for it in its},
        "replicas_computed": {it: computed[it] for it in sorted(computed)},
        "params_dir": str(work / "params"),
    }


def iteration_loss(by_replica: dict[int, list[float]], only: range | None = None) -> float:
    """The mean micro-batch loss over the replicas (in replica order), or over ``only``."""
    vals = [v for r in sorted(by_replica) if only is None or r in only for v in by_replica[r]]
    return math.fsum(vals) / len(vals)


def load_params(params_dir: str, it: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(Path(params_dir) / f"it{it:04d}.pp{pp}.pt") for pp in range(2)]


def eval_loss(params: list[dict[str, torch.Tensor]]) -> float:
    _, _, xe, ye = dataset()
    stages = []
    for pp in range(2):
        m = build_stage(pp)
        m.load_state_dict(params[pp])
        stages.append(m.eval())
    with torch.no_grad():
        return float(mse(stages[1](stages[0](xe)), ye))


def param_distance(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> dict:
    fa = torch.cat([t.double().reshape(-1) for s in a for t in s.values()])
    fb = torch.cat([t.double().reshape(-1) for s in b for t in s.values()])
    d = fa - fb
    return {
        "l2": float(d.norm()),
        "l2_rel": float(d.norm() / fb.norm()),
        "max_abs": float(d.abs().max()),
        "bit_identical": bool(torch.equal(fa, fb)),
    }


def deviation(arm: dict[str, Any], ref: dict[str, Any], args: argparse.Namespace) -> dict:
    """The arm's loss against the reference's, from the shrink (the phase restored at
    ``shrink_from``) to the end."""
    k = arm["shrink_from"]
    its = list(range(k, args.iterations))
    a = [iteration_loss(arm["losses_by_replica"][i]) for i in its]
    b = [iteration_loss(ref["losses_by_replica"][i]) for i in its]
    diff = [abs(p - q) for p, q in zip(a, b, strict=True)]
    rel = [d / abs(q) for d, q in zip(diff, b, strict=True)]
    out: dict[str, Any] = {
        "from_iteration": k,
        "iterations": len(its),
        "bit_identical_losses": all(p == q for p, q in zip(a, b, strict=True)),
        "max_abs": max(diff),
        "mean_abs": sum(diff) / len(diff),
        "max_rel": max(rel),
        "mean_rel": sum(rel) / len(rel),
        "first_differing_iteration": next((i for i, d in zip(its, diff, strict=True) if d), None),
        "at": {
            str(i): {"arm": a[i - k], "ref": b[i - k], "abs": diff[i - k], "rel": rel[i - k]}
            for i in sorted({k, k + 1, k + 10, 100, 150, args.iterations - 1})
            if k <= i < args.iterations
        },
    }
    if arm["arm"] == "dropped":
        # Like for like: the reference's loss on the same samples (the surviving replicas'),
        # so what is left is the trajectory's deviation, not the smaller sample.
        keep = range(arm["replicas"] // 2)
        b0 = [iteration_loss(ref["losses_by_replica"][i], keep) for i in its]
        d0 = [abs(p - q) for p, q in zip(a, b0, strict=True)]
        r0 = [d / abs(q) for d, q in zip(d0, b0, strict=True)]
        out["same_samples"] = {
            "max_abs": max(d0),
            "mean_abs": sum(d0) / len(d0),
            "max_rel": max(r0),
            "mean_rel": sum(r0) / len(r0),
            "at_end": {"arm": a[-1], "ref": b0[-1], "abs": d0[-1], "rel": r0[-1]},
        }
    # Held-out loss and parameter distance at the snapshots after the shrink.
    evals = []
    for i in sorted(p for p in snapshot_iterations(args) if p >= k):
        pa, pb = load_params(arm["params_dir"], i), load_params(ref["params_dir"], i)
        ea, eb = eval_loss(pa), eval_loss(pb)
        evals.append(
            {
                "iteration": i,
                "eval_arm": ea,
                "eval_ref": eb,
                "eval_abs": abs(ea - eb),
                "eval_rel": abs(ea - eb) / abs(eb),
                **param_distance(pa, pb),
            }
        )
    out["snapshots"] = evals
    out["end"] = evals[-1]
    return out


def lost(arm: str, replicas: int, shrink_from: int, args: argparse.Namespace) -> dict:
    """What the arm drops while shrunk: the lost DP rank's replicas' samples."""
    per_replica = MICRO * N_MICRO
    frac = (replicas - replicas // 2) / replicas if arm == "dropped" else 0.0
    shrunk = args.iterations - shrink_from
    return {
        "global_batch": replicas * per_replica,
        "samples_lost_per_iteration": round(frac * replicas) * per_replica,
        "fraction_lost_per_iteration": frac,
        "shrunk_iterations": shrunk,
        "samples_lost_total": round(frac * replicas) * per_replica * shrunk,
    }


def snapshot_iterations(args: argparse.Namespace) -> list[int]:
    return [i for i in range(args.iterations) if (i + 1) % args.eval_every == 0] + (
        [args.iterations - 1] if args.iterations % args.eval_every else []
    )


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def driver(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="elastic-deviation-"))
    summary: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "job": {
            "pp": 2,
            "dp_before": 2,
            "dp_after": 1,
            "ranks_before": 4,
            "ranks_after": 2,
            "iterations": args.iterations,
            "shrink_at": args.shrink_at,
            "micro_batches_per_replica": N_MICRO,
            "micro_batch": MICRO,
            "model": f"stage0 Linear({IN},{HIDDEN})-GELU-Dropout(0.1)-Linear({HIDDEN},{HIDDEN})-GELU; "
            f"stage1 Linear({HIDDEN},{HIDDEN})-GELU-Dropout(0.1)-Linear({HIDDEN},{OUT_DIM})",
            "data": f"teacher MLP regression, {N_TRAIN} train / {N_EVAL} held-out samples",
            "optimizer": f"AdamW lr={LR} wd={WEIGHT_DECAY}, StepLR({STEP_SIZE}, {GAMMA}), clip {CLIP}",
        },
        "by_replicas": {},
    }
    for replicas in [int(v) for v in args.replicas.split(",")]:
        arms: dict[str, dict[str, Any]] = {}
        for arm in args.arms.split(","):
            print(f"R={replicas} {arm} ...", flush=True)
            arms[arm] = run_arm(arm, replicas, args, scratch)
            print(f"  {arms[arm]['wall_s']:.0f} s; phases {arms[arm]['phases']}", flush=True)
            raw = out / f"R{replicas}"
            raw.mkdir(exist_ok=True)
            a = arms[arm]
            (raw / f"{arm}.json").write_text(
                json.dumps(
                    {
                        "arm": arm,
                        "replicas": replicas,
                        "phases": a["phases"],
                        "shrink_from": a["shrink_from"],
                        "loss": [
                            iteration_loss(a["losses_by_replica"][i])
                            for i in range(args.iterations)
                        ],
                        "losses_by_replica": a["losses_by_replica"],
                        "replicas_computed": a["replicas_computed"],
                    },
                    indent=None,
                )
                + "\n"
            )
        res: dict[str, Any] = {"arms": {}}
        if "unfailed" in arms and "unfailed-sum" in arms:
            u, s = arms["unfailed"], arms["unfailed-sum"]
            res["unfailed_sum_vs_unfailed_bit_identical"] = all(
                u["losses_by_replica"][i] == s["losses_by_replica"][i]
                for i in range(args.iterations)
            )
            last = snapshot_iterations(args)[-1]
            res["unfailed_sum_vs_unfailed_params_end"] = param_distance(
                load_params(s["params_dir"], last), load_params(u["params_dir"], last)
            )
        for arm, ref in REFERENCE.items():
            if arm in arms and ref in arms:
                res["arms"][arm] = {
                    "reference": ref,
                    "phases": arms[arm]["phases"],
                    **lost(arm, replicas, arms[arm]["shrink_from"], args),
                    **deviation(arms[arm], arms[ref], args),
                }
        summary["by_replicas"][str(replicas)] = res
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        for arm, d in res["arms"].items():
            print(
                f"R={replicas} {arm:14s} from it {d['from_iteration']}: loss max|d| {d['max_abs']:.3e} "
                f"mean|d| {d['mean_abs']:.3e} max rel {d['max_rel']:.3e}; end: eval rel "
                f"{d['end']['eval_rel']:.3e}, params rel L2 {d['end']['l2_rel']:.3e}"
                f"{' (bit-identical)' if d['bit_identical_losses'] else ''}",
                flush=True,
            )
        det = res["arms"].get("deterministic")
        if det is not None:
            assert det["bit_identical_losses"], "deterministic: a loss differs from unfailed"
            assert all(s["bit_identical"] for s in det["snapshots"]), "deterministic: params differ"
    if not args.scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    try:
        Path(args.store_root).rmdir()  # the arms' stores are gone; the root is empty
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="directory for the raw JSON and summary.json")
    ap.add_argument("--replicas", default="2,4", help="R values (comma-separated)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--shrink-at", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument(
        "--scratch", default="", help="keep the runs' files here (default: a temp dir, removed)"
    )
    ap.add_argument("--store-root", default="/dev/shm/baft-elastic-deviation")
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dropped", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--params-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.replicas = int(args.replicas)
        args.result = args.result.format(rank=int(os.environ["RANK"]))
        worker(args)
    else:
        if not args.out:
            ap.error("--out is required")
        driver(args)


if __name__ == "__main__":
    main()
