"""Typed configuration of the reference app (``baft train``, the demo, the harness): the
parallel layout and schedule, and everything one training run needs. The library's own
configuration is :mod:`baft.config` (``CheckpointConfig``); validation raises ValueError
with the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from baft.config import CheckpointConfig
from baft.model.config import ModelConfig
from baft.pipeline.adapter import MULTI_STAGE_SCHEDULES, SCHEDULES

__all__ = ["MULTI_STAGE_SCHEDULES", "SCHEDULES", "ModelConfig", "ParallelConfig", "TrainConfig"]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel layout: sizes of the (pp, dp, dp_shard, tp) mesh and the pipeline schedule."""

    num_dp: int = 2
    """Data-parallel replicas (every replica holds the whole state of its stage)."""
    num_pp: int = 2
    """Pipeline ranks."""
    num_tp: int = 1
    """Tensor-parallel degree."""
    num_dp_shard: int = 1
    """FSDP2 degree: ranks of a replica that shard parameters, gradients and optimizer
    state (``fully_shard`` over torchtitan's ``dp_shard`` mesh dim; each reads its own
    slice of the batch, as a replica does)."""
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
        return self.num_dp * self.num_dp_shard * self.num_pp * self.num_tp

    @property
    def num_data_ranks(self) -> int:
        """Ranks that read different slices of a batch: replicas x FSDP2 shards."""
        return self.num_dp * self.num_dp_shard

    @property
    def num_shard(self) -> int:
        """Ranks of a (pp, dp) pair that hold different pieces (FSDP2 x TP): baft's
        shard axis (``baft.pipeline.mesh.mesh_from_user`` folds ``dp_shard`` and ``tp``)."""
        return self.num_dp_shard * self.num_tp

    @property
    def stages_per_rank(self) -> int:
        return self.num_virtual if self.schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def num_stages(self) -> int:
        return self.num_pp * self.stages_per_rank

    def validate(self, model: ModelConfig, global_batch: int) -> None:
        for name, flag in (
            ("num_dp", "--dp"),
            ("num_pp", "--pp"),
            ("num_tp", "--tp"),
            ("num_dp_shard", "--dp-shard"),
        ):
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
            self.schedule in ("interleaved-1f1b", "interleaved-zb")  # looped: rounds of pp
            and self.num_microbatches % self.num_pp
        ):
            raise ValueError(
                f"{self.schedule} needs --microbatches divisible by --pp ({self.num_pp}); "
                f"try --microbatches {self.num_pp * max(1, self.num_microbatches // self.num_pp)}"
            )
        per_rank, rem = divmod(global_batch, self.num_data_ranks)
        if rem or per_rank % self.num_microbatches:
            ranks = f"dp={self.num_dp} replicas" + (
                f" x dp_shard={self.num_dp_shard} shards" if self.num_dp_shard > 1 else ""
            )
            raise ValueError(
                f"--batch {global_batch} must split evenly into {ranks} x "
                f"{self.num_microbatches} microbatches: use a multiple of "
                f"{self.num_data_ranks * self.num_microbatches}"
            )
        model.validate(self.num_tp)


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
    max_restarts: int = 3
    """torchrun worker-group restarts before giving up (``torchrun --max-restarts``)."""
    inprocess: bool = True
    """In-process recovery (:mod:`baft.inprocess`): survivors keep their processes and only
    the failed rank is replaced; False: every failure restarts the whole group."""
    elastic_min_hosts: int = 0
    """``baft train --elastic MIN``: every simulated node runs as a host of its own (a
    torchrun agent, its own store root and host id) in a job of ``MIN`` to all of them
    (``--nnodes MIN:N``), whose ``num_dp`` replicas are elastic
    (:class:`baft.config.ElasticConfig`); 0: one agent, a fixed world."""
    lose_hosts: list[str] = field(default_factory=list)
    """With ``elastic_min_hosts``: ``HOST:ITER[:BACK]``, host ``HOST`` lost for good (its
    agent and every process under it killed) once iteration ``ITER`` is done, started
    again once ``BACK`` is (``baft train --lose-host``)."""
    inject: list[str] = field(default_factory=list)
    """Failure injections (see :mod:`baft.faults`), e.g. ``["kill:rank=1,iter=7"]``:
    handed to ``ft.inject`` before the restore."""

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
        if self.compute == "emulated" and self.parallel.num_dp_shard > 1:
            raise ValueError(
                "compute=emulated does not run FSDP2 stages (its timed waits replace the "
                "forward and backward that FSDP2's hooks gather and reduce in): use "
                "compute=real with --dp-shard, or --dp-shard 1"
            )
        self.parallel.validate(self.model, self.global_batch)
        replicas = self.checkpoint.elastic.num_replicas if self.checkpoint is not None else 0
        split = replicas * self.parallel.num_dp_shard * self.parallel.num_microbatches
        if replicas and self.global_batch % split:
            raise ValueError(
                f"--batch {self.global_batch} must split evenly into {replicas} elastic "
                f"replicas x {self.parallel.num_dp_shard} shards x "
                f"{self.parallel.num_microbatches} microbatches"
            )
        if self.elastic_min_hosts:
            self._validate_elastic()
        if self.checkpoint is not None:
            from baft.topology import Topology

            self.checkpoint.validate(
                Topology(
                    num_pp=self.parallel.num_pp,
                    num_dp=self.parallel.num_dp,
                    num_tp=self.parallel.num_shard,  # dp_shard x tp: baft's shard axis
                    ranks_per_node=self.parallel.ranks_per_node,
                )
            )

    @property
    def num_hosts(self) -> int:
        """Simulated hosts of an elastic run: one per declared node."""
        par = self.parallel
        return par.world_size // (par.ranks_per_node or min(2, par.world_size))

    def _validate_elastic(self) -> None:
        par, ck = self.parallel, self.checkpoint
        if ck is None or not ck.elastic.num_replicas:
            raise ValueError(
                "--elastic needs checkpoints with elastic replicas (drop --no-checkpoint)"
            )
        if par.num_dp_shard > 1:
            raise ValueError(
                "--elastic takes plain DP replicas, not FSDP2's shards: use --dp-shard 1"
            )
        if not 1 <= self.elastic_min_hosts <= self.num_hosts:
            raise ValueError(
                f"--elastic {self.elastic_min_hosts}: between 1 and the run's {self.num_hosts} "
                "hosts (one per --ranks-per-node ranks)"
            )
        for spec in self.lose_hosts:
            parts = spec.split(":")
            if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
                raise ValueError(f"--lose-host {spec!r}: HOST:ITER[:BACK], e.g. 1:10:20")
            n = [int(p) for p in parts]
            if n[0] >= self.num_hosts or (len(n) == 3 and n[2] <= n[1]):
                raise ValueError(
                    f"--lose-host {spec!r}: a host below {self.num_hosts}, BACK after ITER"
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
