"""The restore phase from memory against a page-cached DCP load of the same version.

Two launches of the recovery bench's job (:mod:`baft_bench.recovery`: GPT pp=2 on 2
ranks, xor:2, full_every=3, DCP every ``--persist-every`` checkpoints):

1. ``train``: the job runs ``--iterations`` iterations and ends with its stores kept
   (``keep_on_close``), so memory and disk both hold its newest version (the iteration
   count is chosen so that this version is a persisted one).
2. ``measure``: a second launch of the same job (``resume``) whose ranks build the
   engine as a restarted process does (``baft.protect`` + ``build_engine``) and then,
   ``--repeats`` times, alternating, restore that version:
   - **memory**: the runtime's own phases (``recover.runtime``: inventory and agree,
     transfer/decode, load and replay), read mappings dropped after each as the runtime
     does, so every restore faults its pages in again like a new process;
   - **disk**: the DCP load of the runtime's disk path (list versions, ``load_from_disk``)
     from files just written and read again: a warm page cache, storage's best case.
   Before each restore the live tensors are overwritten with a pattern; after it every
   tensor must equal the first memory restore's (memory and disk alike): bit-identity.

A restore is as slow as its slowest rank: each repeat's time is the max over ranks; the
page reports medians. ``--profile`` also runs one memory restore under cProfile on rank 0.

Usage: ``PYTHONPATH=.:benchmarks python benchmarks/restore_speed.py [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

OPTIONS = "restore_speed.json"
RESULT = "restore_speed.result.json"


def _cfg(a: argparse.Namespace, out: Path) -> Any:
    """The recovery bench's job (``baft_bench.recovery._cfg``), stores kept at the end."""
    from baft_bench.recovery import _cfg as recovery_cfg

    cfg = recovery_cfg(a, out, [])
    cfg.checkpoint.store.keep_on_close = True
    return cfg


# ---------------------------------------------------------------- the ranks' side
def _scribble(tensors: list[Any], round_: int) -> None:
    """Overwrite every live tensor (a restore that wrote nothing would then fail the check)."""
    import torch

    with torch.no_grad():
        for t in tensors:
            t.detach().reshape(-1).view(torch.uint8).fill_(round_ % 251 + 1)


def _differing(names: list[str], tensors: list[Any], ref: list[Any]) -> list[str]:
    """Names of the live tensors whose bytes differ from ``ref``."""
    import torch

    return [
        n
        for n, t, r in zip(names, tensors, ref, strict=True)
        if not torch.equal(t.detach().reshape(-1).view(torch.uint8), r)
    ]


def _bytes_of(tensors: list[Any]) -> list[Any]:
    import torch

    return [t.detach().reshape(-1).view(torch.uint8).clone() for t in tensors]


def _memory_restore(engine: Any) -> dict[str, float]:
    """One restore from memory through the runtime's phases; seconds per phase."""
    from baft.recover import runtime
    from baft.recover.report import RecoveryReport

    t0 = time.perf_counter()
    agreed = runtime._inventory_and_agree(engine)
    if agreed.plan.source != "memory":
        raise RuntimeError(f"expected a restore from memory: {agreed.reason}")
    report = RecoveryReport(engine.run_dir, 0)
    runtime._rebuild_and_load(engine, agreed, report)
    total = time.perf_counter() - t0
    agreed.stores.drop_read_caches()  # the runtime's own end: the next restore maps afresh
    return {**agreed.seconds, "total": total, "version": float(agreed.plan.version or -1)}


def _disk_restore(engine: Any, version: int) -> dict[str, float]:
    """One DCP load of ``version`` through the runtime's disk path; seconds."""
    from baft.recover import runtime
    from baft.recover.coordinator import RecoveryPlan
    from baft.recover.load import load_from_disk

    t0 = time.perf_counter()
    persisted = runtime._persisted(engine.persist_dir)
    if version not in persisted:
        raise RuntimeError(f"v{version} is not persisted: {persisted}")
    load_from_disk(engine, RecoveryPlan(version=version, source="disk"), engine.persist_dir)
    return {"total": time.perf_counter() - t0}


def _measure(engine: Any, repeats: int, profile: bool) -> dict[str, Any]:
    """Alternate memory and disk restores; every one must give the same bytes."""
    tensors, names = list(engine.flat.tensors), list(engine.flat.names)
    _scribble(tensors, 0)
    first = _memory_restore(engine)  # warm-up, and the reference bytes
    version = int(first["version"])
    ref = _bytes_of(tensors)
    out: dict[str, Any] = {"version": version, "memory": [], "disk": [], "identical": True}
    out["first_memory"] = first  # the process's first restore, as after a restart
    for i in range(repeats):
        order = ("memory", "disk") if i % 2 == 0 else ("disk", "memory")
        for kind in order:
            _scribble(tensors, 2 * i + (kind == "disk") + 1)
            if kind == "memory":
                got = _memory_restore(engine)
            else:
                got = _disk_restore(engine, version)
            out[kind].append(got)
            bad = _differing(names, tensors, ref)
            if bad:
                out["identical"] = False
                out.setdefault("differing", {}).setdefault(kind, bad[:10])
    _scribble(tensors, 7)  # one more restore (collective), profiled where asked
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    _memory_restore(engine)
    if prof is not None:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
        out["profile"] = s.getvalue()
    out["identical"] = out["identical"] and not _differing(names, tensors, ref)
    return out


def _rank_main(cfg_path: Path) -> None:
    import torch
    import torch.distributed as dist

    import baft
    from baft.engine.build import build_engine
    from baft.pipeline.mesh import init_mesh
    from baft.train.config import TrainConfig
    from baft.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(json.loads(cfg_path.read_text()))
    opts = json.loads((cfg_path.parent / OPTIONS).read_text())
    mesh = init_mesh(cfg.parallel, timeout_s=120.0)
    ft = Trainer(cfg, mesh).ft
    assert ft is not None
    engine = build_engine(ft.checkpoint, ft.run_dir, ft.mesh, ft.runner, faults=[])
    profile = bool(opts["profile"]) and mesh.rank == int(opts.get("profile_rank", 0))
    mine = _measure(engine, int(opts["repeats"]), profile)
    mine["state_bytes"] = int(engine.flat.nbytes)
    mine["baft"] = str(Path(baft.__file__).parent)  # which code measured (a before/after)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if mesh.rank == 0:
        (cfg_path.parent / RESULT).write_text(json.dumps(gathered))
    ft.close()


def worker_main(argv: list[str]) -> int:
    from baft.train.worker import process_main

    return process_main(lambda: _rank_main(Path(argv[0])))


# ---------------------------------------------------------------- the launcher's side
def _newest_persisted_iterations(a: argparse.Namespace) -> int:
    """Iterations after which the newest committed version is a persisted one: versions
    are iterations, every ``persist_every``-th is persisted (from version 0), and the
    newest committed at the end is the last iteration's."""
    n = a.persist_every * max(2, -(-a.min_iterations // a.persist_every))
    return n + 1


def run(a: argparse.Namespace) -> dict[str, Any]:
    from baft.train.launch import launch

    out = Path(a.out)
    a.iterations = _newest_persisted_iterations(a)
    if not a.skip_train and launch(_cfg(a, out), quiet=not a.verbose) != 0:
        raise RuntimeError("the training job failed; rerun with --verbose")
    opts = {"repeats": a.repeats, "profile": a.profile, "profile_rank": a.profile_rank}
    (out / OPTIONS).write_text(json.dumps(opts))
    (out / RESULT).unlink(missing_ok=True)
    rc = launch(
        _cfg(a, out), quiet=not a.verbose, resume=True, max_restarts=0, worker="restore_speed"
    )
    if rc != 0 or not (out / RESULT).exists():
        raise RuntimeError("the measuring job failed; rerun with --verbose")
    return summarize(json.loads((out / RESULT).read_text()))


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per repeat the slowest rank, then medians; memory phases of the slowest rank."""
    n = len(per_rank[0]["memory"])
    res: dict[str, Any] = {"version": per_rank[0]["version"], "repeats": n}
    res["identical"] = all(r["identical"] for r in per_rank)
    res["differing"] = [r.get("differing", {}) for r in per_rank]
    res["state_bytes"] = [r["state_bytes"] for r in per_rank]
    res["baft"] = per_rank[0]["baft"]
    for kind in ("memory", "disk"):
        worst = [max(r[kind][i]["total"] for r in per_rank) for i in range(n)]
        res[f"{kind}_s"] = worst
        res[f"{kind}_median_s"] = statistics.median(worst)
    phases: dict[str, list[float]] = {}
    for i in range(n):
        slow = max(per_rank, key=lambda r: r["memory"][i]["total"])["memory"][i]
        for k in ("inventory", "transfer_decode", "load"):
            phases.setdefault(k, []).append(slow.get(k, 0.0))
    res["memory_phases_median_s"] = {k: statistics.median(v) for k, v in phases.items()}
    res["first_memory_s"] = max(r["first_memory"]["total"] for r in per_rank)
    res["disk_over_memory"] = res["disk_median_s"] / res["memory_median_s"]
    res["profile"] = next((r["profile"] for r in per_rank if "profile" in r), None)
    return res


def markdown(res: dict[str, Any], a: argparse.Namespace) -> str:
    import torch

    mib = [f"{b / 2**20:.1f} MiB" for b in res["state_bytes"]]
    lines = [
        f"# Restore speed: memory vs page-cached DCP, same version — {dt.date.today()}",
        "",
        f"- machine: {os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}, gloo",
        f"- command: `PYTHONPATH=.:benchmarks python benchmarks/restore_speed.py "
        f"--repeats {a.repeats} --layers {a.layers} --d-model {a.d_model} "
        f"--persist-every {a.persist_every} --full-every {a.full_every}`",
        f"- job: the recovery bench's (GPT pp=2 on 2 ranks, xor:2, full_every={a.full_every}), "
        f"{a.iterations} iterations; state per rank {mib}; restored v{res['version']}",
        f"- code measured: `{res['baft']}`",
        "- per repeat the slowest rank; memory = inventory + transfer/decode + load (replay "
        "included), disk = list versions + DCP load, alternating; bit-identical: "
        f"{res['identical']}",
        "",
        "| restore | median (s) | all repeats (s) |",
        "|---|---|---|",
    ]
    for kind in ("memory", "disk"):
        runs = ", ".join(f"{x:.3f}" for x in res[f"{kind}_s"])
        lines.append(f"| {kind} | {res[f'{kind}_median_s']:.3f} | {runs} |")
    ph = ", ".join(f"{k} {v:.3f}" for k, v in res["memory_phases_median_s"].items())
    lines += ["", f"- memory phases (median, s): {ph}"]
    lines += [
        f"- the process's first memory restore (warm-up, not in the medians): "
        f"{res['first_memory_s']:.3f} s",
        f"- disk / memory: {res['disk_over_memory']:.2f}x",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "LOCAL_RANK" in os.environ:  # started by torchrun: one rank of the measuring job
        return worker_main(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--persist-every", type=int, default=4)
    p.add_argument("--full-every", default="3")
    p.add_argument("--min-iterations", type=int, default=6)
    p.add_argument("--out", default="runs/restore-speed")
    p.add_argument("--profile", action="store_true", help="one memory restore under cProfile")
    p.add_argument("--profile-rank", type=int, default=0)
    p.add_argument("--skip-train", action="store_true", help="measure the last train's stores")
    p.add_argument("--json", action="store_true", help="print the raw result")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    res = run(a)
    print(json.dumps(res, indent=1) if a.json else markdown(res, a))
    if res["profile"] and not a.json:
        print(res["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
