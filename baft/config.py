"""Typed configuration for a baft training run; validation raises ValueError with the fix.

Configs are plain data (torchtitan style): the CLI builds them from flags, the trainer
and tests build them directly.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baft.plan.types import CheckpointPolicy

__all__ = ["CheckpointConfig", "CheckpointPolicy", "ModelConfig", "ParallelConfig", "TrainConfig"]

T_IMPORT = time.time()
"""When this process imported baft (``import baft`` loads this module): about its start,
where a recovery's restart phase ends."""

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "interleaved-zb")
"""Pipeline schedules baft can run, by CLI name."""

MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zbv", "interleaved-zb")
"""Schedules that place several (virtual) stages on each pipeline rank."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the reference GPT decoder."""

    num_layers: int = 8
    """Transformer blocks; must be >= the number of pipeline stages."""
    d_model: int = 128
    """Hidden size; divisible by num_heads."""
    num_heads: int = 4
    """Attention heads; divisible by the TP degree."""
    vocab_size: int = 256
    """Byte-level vocabulary (256 covers the bundled corpus)."""
    seq_len: int = 64
    """Tokens per training sequence."""
    mlp_ratio: int = 4
    """MLP hidden size = mlp_ratio * d_model."""

    def validate(self, num_tp: int = 1) -> None:
        for name in ("num_layers", "d_model", "num_heads", "vocab_size", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: "
                "pick --d-model as a multiple of --heads"
            )
        if self.num_heads % num_tp:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by tp={num_tp}: "
                "pick --heads as a multiple of --tp"
            )
        if (self.mlp_ratio * self.d_model) % num_tp:
            raise ValueError(
                f"MLP width {self.mlp_ratio * self.d_model} not divisible by tp={num_tp}"
            )


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel layout: sizes of the (pp, dp, tp) mesh and the pipeline schedule."""

    num_dp: int = 2
    """Data-parallel replicas."""
    num_pp: int = 2
    """Pipeline ranks."""
    num_tp: int = 1
    """Tensor-parallel degree."""
    schedule: str = "1f1b"
    """One of SCHEDULES."""
    num_microbatches: int = 4
    """Microbatches per iteration per DP replica."""
    num_virtual: int = 2
    """Stages per pipeline rank for interleaved/zero-bubble schedules (zbv needs 2)."""
    ranks_per_node: int = 0
    """Ranks per simulated node (failure domain); 0 = min(2, world size)."""

    @property
    def world_size(self) -> int:
        return self.num_dp * self.num_pp * self.num_tp

    @property
    def stages_per_rank(self) -> int:
        return self.num_virtual if self.schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def num_stages(self) -> int:
        return self.num_pp * self.stages_per_rank

    def validate(self, model: ModelConfig, global_batch: int) -> None:
        for name, flag in (("num_dp", "--dp"), ("num_pp", "--pp"), ("num_tp", "--tp")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}"
            )
        if self.schedule == "zbv" and self.num_virtual != 2:
            raise ValueError("zbv places exactly 2 stages on each rank: use --virtual-stages 2")
        if self.num_virtual < 1:
            raise ValueError("--virtual-stages must be >= 1")
        if self.num_stages > model.num_layers:
            raise ValueError(
                f"{self.num_stages} pipeline stages (pp={self.num_pp} x {self.stages_per_rank} per rank) "
                f"but only {model.num_layers} layers: use --layers >= {self.num_stages} or a smaller --pp"
            )
        if self.num_microbatches < 1:
            raise ValueError("--microbatches must be >= 1")
        if (
            self.schedule in ("interleaved-1f1b", "interleaved-zb")
            and self.num_microbatches % self.num_pp
        ):
            raise ValueError(
                f"{self.schedule} needs --microbatches divisible by --pp ({self.num_pp}); "
                f"try --microbatches {self.num_pp * max(1, self.num_microbatches // self.num_pp)}"
            )
        per_replica, rem = divmod(global_batch, self.num_dp)
        if rem or per_replica % self.num_microbatches:
            raise ValueError(
                f"--batch {global_batch} must split evenly into dp={self.num_dp} replicas x "
                f"{self.num_microbatches} microbatches: use a multiple of {self.num_dp * self.num_microbatches}"
            )
        model.validate(self.num_tp)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Fault tolerance of a run: checkpoint policy, store, persistence, failure handling."""

    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    """How often and how safely: interval, redundancy, persistence, differential slices
    (see :class:`baft.plan.types.CheckpointPolicy`; ``CheckpointConfig.parse`` reads the
    ``every=1,redundancy=xor:2,...`` syntax)."""
    profile_iters: int = 3
    """Unprotected iterations whose timelines make the BubbleMap (skipped after a restart)."""
    store_root: str = "/dev/shm/baft"
    """Root of the shared-memory snapshot stores."""
    job_id: str = ""
    """Store directory name; empty = derived from the run directory."""
    budget_bytes: int = 8 << 30
    """Hard host-memory budget per rank's store."""
    persist_dir: str = ""
    """DCP checkpoint directory; empty = RUN_DIR/checkpoints."""
    timeout_s: float = 60.0
    """Timeout of every collective and transfer: how long a hung peer can stall the job."""
    max_restarts: int = 3
    """torchrun worker-group restarts before giving up."""
    allow_fresh_start: bool = False
    """Whether a run that shows progress (its run directory's progress record, or
    snapshots of the job in a store) may start over from iteration 0 when nothing can be
    restored from memory or DCP. False: that is an error, never a silent restart."""
    keep_stores_on_close: bool = False
    """At a clean end (``ft.close()`` between iterations on every rank) the snapshot
    stores are freed unless this is True (to continue the job from memory with a larger
    ``num_iterations``, or to inspect them); the log says whether the newest version was
    persisted to DCP. Stores of a job that did not end (a crash, SIGTERM, a kill) always
    stay for its restart."""
    inject: list[str] = field(default_factory=list)
    """Failure injections (see baft.faults), e.g. ["kill:rank=1,iter=7"]."""
    host_work: str = "auto"
    """Where checksums and redundancy sends run: "bubbles" (only while the rank waits),
    "always" (a background thread), "auto" (bubbles when the CPU also computes)."""
    exchange: str = "auto"
    """How redundancy moves between ranks: "auto" (ranks whose stores share one host's
    memory read each other's committed bytes directly; the network transport only between
    hosts) or "network" (always the transport, e.g. to measure it)."""
    flush_on_sigterm: bool = True
    """On SIGTERM (preemption, the job being stopped) persist the newest state to
    ``persist_dir`` as a DCP checkpoint at the next agreed commit, then exit; the next
    launch resumes from it. Needs ``persist_dir``."""
    flush_timeout_s: float = 20.0
    """Longest a SIGTERM flush may take (torchrun kills workers 30 s after its SIGTERM)."""
    snapshot_copy: str = "auto"
    """How snapshot copies run: "auto" (an asynchronous side stream on CUDA; on the CPU
    synchronous copies in the bubbles, where the host also computes) or "thread" (a copy
    thread that plays an accelerator's copy engine: for compute emulated on the CPU)."""
    cost: dict[str, float] | None = None
    """Cost-model override (copy_Bps, net_Bps, encode_Bps, persist_Bps, interference);
    None measures it at the end of profiling (about a second, rank 0)."""

    def validate(self, topology: Any = None) -> None:
        """Raise ValueError naming the field and the fix; with a ``topology`` also check
        that the redundancy fits its failure domains."""
        if not isinstance(self.policy, CheckpointPolicy):
            raise ValueError(f"policy must be a CheckpointPolicy, got {type(self.policy).__name__}")
        if self.profile_iters < 1:
            raise ValueError(f"profile_iters={self.profile_iters} must be >= 1")
        if self.host_work not in ("auto", "bubbles", "always"):
            raise ValueError(f"host_work must be auto, bubbles or always, got {self.host_work!r}")
        if self.snapshot_copy not in ("auto", "thread"):
            raise ValueError(f"snapshot_copy must be auto or thread, got {self.snapshot_copy!r}")
        if self.exchange not in ("auto", "network"):
            raise ValueError(f"exchange must be auto or network, got {self.exchange!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds")
        if self.flush_timeout_s <= 0:
            raise ValueError(f"flush_timeout_s={self.flush_timeout_s} must be > 0 seconds")
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be > 0")
        if not isinstance(self.allow_fresh_start, bool):
            raise ValueError(
                f"allow_fresh_start must be true or false, got {self.allow_fresh_start!r}"
            )
        if not isinstance(self.keep_stores_on_close, bool):
            raise ValueError(
                f"keep_stores_on_close must be true or false, got {self.keep_stores_on_close!r}"
            )
        if topology is not None:
            from baft.store.coding import Redundancy, coding_groups

            coding_groups(topology, Redundancy.parse(self.policy.redundancy))

    @classmethod
    def parse(cls, text: str, **fields: Any) -> CheckpointConfig:
        """From ``every=1,redundancy=xor:2,persist=50,keep=2,overflow=spill,full_every=auto``
        (any subset), plus any other field by keyword."""
        return cls(policy=CheckpointPolicy.parse(text), **fields)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointConfig:
        d = dict(d)
        return cls(policy=CheckpointPolicy(**d.pop("policy", {})), **d)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Reference model shape."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and schedule."""
    num_iterations: int = 40
    """Optimizer steps to run in total (a resumed run continues up to this count)."""
    global_batch: int = 16
    """Sequences per iteration over all DP replicas."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    seed: int = 0
    """Seed for initialisation and data order."""
    out_dir: str = "runs/latest"
    """Where metrics.jsonl, timeline/ and summary.json go."""
    instrument: bool = True
    """Record slots and timelines; False runs the bare torch schedule (a baseline)."""
    compute: str = "real"
    """``real`` or ``emulated`` (stage forward/backward become calibrated timed waits)."""
    emulated_times: dict[str, list[float]] | None = None
    """For ``emulated``: ``{"fwd": [s per stage], "bwd": [s per stage]}``."""
    checkpoint: CheckpointConfig | None = None
    """Fault tolerance; None trains without checkpoints."""

    def validate(self) -> None:
        if self.num_iterations < 1:
            raise ValueError("--iterations must be >= 1")
        if self.global_batch < 1:
            raise ValueError("--batch must be >= 1")
        if self.lr <= 0:
            raise ValueError("--lr must be > 0")
        if self.compute not in ("real", "emulated"):
            raise ValueError(f"--compute must be real or emulated, got {self.compute!r}")
        if self.compute == "emulated" and not self.emulated_times:
            raise ValueError("compute=emulated needs emulated_times (per-stage fwd/bwd seconds)")
        self.parallel.validate(self.model, self.global_batch)
        if self.checkpoint is not None:
            from baft.topology import Topology

            self.checkpoint.validate(
                Topology(
                    num_pp=self.parallel.num_pp,
                    num_dp=self.parallel.num_dp,
                    num_tp=self.parallel.num_tp,
                    ranks_per_node=self.parallel.ranks_per_node,
                )
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        model = ModelConfig(**d.pop("model", {}))
        parallel = ParallelConfig(**d.pop("parallel", {}))
        ck = d.pop("checkpoint", None)
        checkpoint = CheckpointConfig.from_dict(ck) if ck is not None else None
        return cls(model=model, parallel=parallel, checkpoint=checkpoint, **d)


def default_job_id(out_dir: str) -> str:
    """A store name unique to the run directory, stable across restarts."""
    digest = hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:10]
    return f"job-{digest}"
