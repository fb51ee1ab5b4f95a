"""``baft train``: the reference GPT on dp*dp_shard*pp*tp local processes via torchrun.

Flags map one to one onto ``TrainConfig`` (``config_from_args``); the fault-tolerance
flags onto its ``CheckpointConfig``. Defaults come from the config types.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from baft.config import CheckpointConfig
from baft.model.config import ModelConfig
from baft.train.config import SCHEDULES, ParallelConfig, TrainConfig


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "train",
        help="train the reference GPT with torchrun on CPU/gloo (or CUDA/NCCL)",
        description="Train the reference GPT on dp*dp_shard*pp*tp local processes via "
        "torchrun (--dp-shard: FSDP2 stages, as torchtitan builds them).",
    )
    _add_train_flags(p)
    p.set_defaults(func=run_train)
    return p


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    d_model, d_par, d_train = ModelConfig(), ParallelConfig(), TrainConfig()
    g = p.add_argument_group("parallelism")
    g.add_argument(
        "--dp", type=int, default=d_par.num_dp, help="data-parallel replicas (default %(default)s)"
    )
    g.add_argument(
        "--pp", type=int, default=d_par.num_pp, help="pipeline ranks (default %(default)s)"
    )
    g.add_argument(
        "--tp", type=int, default=d_par.num_tp, help="tensor-parallel degree (default %(default)s)"
    )
    g.add_argument(
        "--dp-shard",
        type=int,
        default=d_par.num_dp_shard,
        help="FSDP2 degree inside each replica: fully_shard every GPT block and stage over "
        "torchtitan's dp_shard mesh dim (each shard rank reads its own slice of the batch; "
        "FSDP2 reduce-scatters the gradients, baft averages only over --dp replicas); "
        "world size = dp*dp_shard*pp*tp (default %(default)s)",
    )
    g.add_argument(
        "--schedule",
        default=d_par.schedule,
        choices=SCHEDULES,
        help="pipeline schedule (default %(default)s)",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=d_par.num_microbatches,
        help="microbatches per iteration per replica (default %(default)s)",
    )
    g.add_argument(
        "--virtual-stages",
        type=int,
        default=d_par.num_virtual,
        help="stages per rank for interleaved/zero-bubble schedules (default %(default)s)",
    )
    g.add_argument(
        "--ranks-per-node",
        type=int,
        default=d_par.ranks_per_node,
        help="ranks per simulated node / failure domain (default: min(2, world))",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--layers",
        type=int,
        default=d_model.num_layers,
        help="transformer blocks (default %(default)s)",
    )
    g.add_argument(
        "--d-model", type=int, default=d_model.d_model, help="hidden size (default %(default)s)"
    )
    g.add_argument(
        "--heads", type=int, default=d_model.num_heads, help="attention heads (default %(default)s)"
    )
    g.add_argument(
        "--seq-len",
        type=int,
        default=d_model.seq_len,
        help="tokens per sequence (default %(default)s)",
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--iterations",
        type=int,
        default=d_train.num_iterations,
        help="optimizer steps (default %(default)s)",
    )
    g.add_argument(
        "--batch",
        type=int,
        default=d_train.global_batch,
        help="global batch in sequences (default %(default)s)",
    )
    g.add_argument(
        "--lr", type=float, default=d_train.lr, help="AdamW learning rate (default %(default)s)"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=d_train.seed,
        help="seed for init and data order (default %(default)s)",
    )
    g.add_argument(
        "--out",
        default=d_train.out_dir,
        help="run directory for metrics, timelines, summary (default %(default)s)",
    )
    d_ck = CheckpointConfig()
    g = p.add_argument_group("fault tolerance")
    g.add_argument(
        "--checkpoint",
        default="every=1,redundancy=xor:2,persist=50",
        metavar="SPEC",
        help="checkpoint policy: every=N (interval), redundancy=none|replicate:k|xor:g|rs:k+m "
        "(across simulated nodes), persist=N (every N-th checkpoint to DCP on disk, 0=never), "
        "keep=K, overflow=spill|stretch, full_every=auto|K (differential: a gradient record and "
        "a slice of the state per iteration, every tensor fully at least every K) "
        "(default %(default)s)",
    )
    g.add_argument("--no-checkpoint", action="store_true", help="train without checkpoints")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the job of --out (after a preemption or a stopped job: from its "
        "memory stores or DCP checkpoints) instead of starting a new one",
    )
    g.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="FAULT",
        help="inject a failure (repeatable): kill:rank=R,iter=I[,at=POINT] | node:N,iter=I | "
        "corrupt:rank=R,iter=I | delete:rank=R,iter=I | power:iter=I | hang:rank=R,iter=I | "
        "slow:rank=R,iter=I,s=SECONDS; POINT in iteration|snapshot|transfer|persist|step|recovery",
    )
    g.add_argument(
        "--elastic",
        type=int,
        default=0,
        metavar="MIN_HOSTS",
        help="run every --ranks-per-node ranks as a host of its own (torchrun agent, memory) "
        "in a job of MIN_HOSTS to all of them: a lost host shrinks the --dp replicas onto the "
        "others from memory, bit-identically, and a returning one grows them back",
    )
    g.add_argument(
        "--lose-host",
        action="append",
        default=[],
        metavar="H:ITER[:BACK]",
        help="with --elastic: kill host H (its agent and every process) after iteration ITER, "
        "start it again after iteration BACK (repeatable)",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=TrainConfig().max_restarts,
        help="torchrun restarts after failures (default %(default)s)",
    )
    g.add_argument(
        "--no-inprocess",
        action="store_true",
        help="recover every failure by restarting every process (torchrun's group restart) "
        "instead of replacing the failed one while the others stay",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=d_ck.timeouts.collective_s,
        help="seconds before a hung peer fails the job (default %(default)s)",
    )
    g.add_argument(
        "--profile-iters",
        type=int,
        default=d_ck.profile_iters,
        help="unprotected iterations profiled for bubbles (default %(default)s)",
    )
    g.add_argument(
        "--store-root",
        default=d_ck.store.root,
        help="shared-memory root of the snapshot stores (default %(default)s)",
    )
    g.add_argument(
        "--persist-dir", default="", help="DCP checkpoint directory (default RUN_DIR/checkpoints)"
    )


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The validated ``TrainConfig`` of parsed ``train`` flags (``ValueError`` with the fix)."""
    cfg = TrainConfig(
        model=ModelConfig(
            num_layers=a.layers, d_model=a.d_model, num_heads=a.heads, seq_len=a.seq_len
        ),
        parallel=ParallelConfig(
            num_dp=a.dp,
            num_pp=a.pp,
            num_tp=a.tp,
            num_dp_shard=a.dp_shard,
            schedule=a.schedule,
            num_microbatches=a.microbatches,
            num_virtual=a.virtual_stages,
            ranks_per_node=a.ranks_per_node,
        ),
        num_iterations=a.iterations,
        global_batch=a.batch,
        lr=a.lr,
        seed=a.seed,
        out_dir=a.out,
    )
    if not a.no_checkpoint:
        ck = CheckpointConfig.parse(a.checkpoint)
        ck.timeouts.collective_s = a.timeout
        ck.profile_iters = a.profile_iters
        ck.store.root = a.store_root
        ck.persist.dir = a.persist_dir
        cfg.checkpoint = ck
        cfg.max_restarts = a.max_restarts
        cfg.inprocess = not a.no_inprocess
        cfg.inject = list(a.inject)
        if a.elastic:
            ck.elastic.num_replicas = a.dp
            cfg.elastic_min_hosts = a.elastic
            cfg.lose_hosts = list(a.lose_host)
        if cfg.inject:
            from baft.faults.spec import FaultSpec

            for spec in cfg.inject:
                FaultSpec.parse(spec)
    elif a.inject or a.elastic:
        raise ValueError("--inject and --elastic need checkpointing on: drop --no-checkpoint")
    if a.lose_host and not a.elastic:
        raise ValueError("--lose-host needs --elastic MIN_HOSTS")
    cfg.validate()
    return cfg


def run_train(a: argparse.Namespace) -> int:
    """Run ``baft train``; returns torchrun's exit code."""
    from baft.train.launch import launch

    cfg = config_from_args(a)
    par = cfg.parallel
    shard = f" dp_shard={par.num_dp_shard}" if par.num_dp_shard > 1 else ""
    print(
        f"[baft] training dp={par.num_dp}{shard} pp={par.num_pp} tp={par.num_tp} "
        f"schedule={par.schedule} on {par.world_size} ranks -> {cfg.out_dir}",
        flush=True,
    )
    if cfg.elastic_min_hosts:
        from baft.train.hosts import launch_elastic

        rc = launch_elastic(cfg, resume=a.resume)
    else:
        rc = launch(cfg, resume=a.resume)
    if rc == 0 and (Path(cfg.out_dir) / "summary.json").exists():
        print(f"[baft] done: {cfg.out_dir}/summary.json", flush=True)
    elif rc == 0 and cfg.checkpoint is not None:  # stopped by SIGTERM, flushed
        print(
            f"[baft] stopped: the newest state is in {cfg.checkpoint.persist.dir}; "
            "--resume continues the job",
            flush=True,
        )
    return rc
