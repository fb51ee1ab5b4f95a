"""The library's typed configuration: ``CheckpointConfig``, grouped by who reads it.

Plain data (torchtitan style), validation raises ValueError with the fix. The policy
(how often, how safely) and start-up choices sit at the top; then one group per owner:
:class:`StoreConfig` (the snapshot stores), :class:`PersistConfig` (the DCP tier),
:class:`ExchangeConfig` (how bytes move), :class:`TimeoutConfig` (every bounded wait).
A field of the flat config of before raises an error that names where it moved
(:data:`MOVED`). The reference app's configs (model, parallel layout, training run)
live with the app: :mod:`baft.train.config`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baft.plan.types import CheckpointPolicy

__all__ = [
    "CheckpointConfig",
    "CheckpointPolicy",
    "ElasticConfig",
    "ExchangeConfig",
    "InprocessTimeouts",
    "PersistConfig",
    "StoreConfig",
    "TimeoutConfig",
]

T_IMPORT = time.time()
"""When this process imported baft (``import baft`` loads this module): about its start,
where a recovery's restart phase ends."""


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """The shared-memory snapshot stores (read by the store, recovery's inventory and the
    end-of-job cleanup)."""

    root: str = "/dev/shm/baft"
    """Root of the shared-memory snapshot stores."""
    job_id: str = ""
    """Store directory name; empty = derived from the run directory."""
    budget_bytes: int | None = None
    """Hard host-memory budget per rank's store. None (default): derived from the host
    before the first step, the lesser of half of MemAvailable and the free space under
    ``root``, split over the ranks sharing it, the smallest of the job's ranks (see
    :mod:`baft.engine.admission`). ``full_every=auto`` plans under it, and a job whose
    smallest layout does not fit is refused before its first step."""
    keep_on_close: bool = False
    """At a clean end (``ft.close()`` between iterations on every rank) the snapshot
    stores are freed unless this is True (to continue the job from memory with a larger
    ``num_iterations``, or to inspect them); the log says whether the newest version was
    persisted to DCP. Stores of a job that did not end (a crash, SIGTERM, a kill) always
    stay for its restart."""


@dataclass(kw_only=True, slots=True)
class PersistConfig:
    """The DCP tier on storage (read by the persister, the SIGTERM flush and recovery's
    disk fallback). How often is the policy's ``persist_every``."""

    dir: str = ""
    """DCP checkpoint directory; empty = RUN_DIR/checkpoints."""
    flush_on_sigterm: bool = True
    """On SIGTERM (preemption, the job being stopped) persist the newest state to ``dir``
    as a DCP checkpoint at the next agreed commit, then exit; the next launch resumes
    from it."""
    writer: str = "thread"
    """Who runs ``dcp.save`` for the periodic saves: "thread" (a background thread of the
    training process) or "process" (one writer process per rank, started at idle CPU
    priority when the engine is built, reading the committed snapshot straight from
    shared memory, so DCP's planning, pickling and writing run off the training process's
    GIL). A SIGTERM flush always writes from the training process."""

    def __post_init__(self) -> None:
        if self.writer not in WRITERS:
            raise ValueError(
                f"persist writer must be one of {', '.join(WRITERS)}, got {self.writer!r}"
            )


WRITERS = ("thread", "process")
"""The values of :attr:`PersistConfig.writer`."""


@dataclass(kw_only=True, slots=True)
class ExchangeConfig:
    """How snapshot bytes move (read by the copiers, the protect worker and the
    redundancy exchange)."""

    paths: str = "auto"
    """How redundancy moves between ranks: "auto" (ranks whose stores share one host's
    memory read each other's committed bytes directly; the network transport only between
    hosts) or "network" (always the transport, e.g. to measure it)."""
    host_work: str = "auto"
    """Where checksums and redundancy sends run: "bubbles" (only while the rank waits),
    "always" (a background thread), "auto" (bubbles when the CPU also computes)."""
    snapshot_copy: str = "auto"
    """How snapshot copies run: "auto" (an asynchronous side stream on CUDA; on the CPU
    synchronous copies in the bubbles, where the host also computes) or "thread" (a copy
    thread that plays an accelerator's copy engine: for compute emulated on the CPU)."""


@dataclass(kw_only=True, slots=True)
class TimeoutConfig:
    """Every bounded wait of the library. In-process recovery's bounds are
    :class:`InprocessTimeouts`: its supervisors start before the training script, so they
    come from the environment, not from the config the script passes."""

    collective_s: float = 60.0
    """Timeout of every collective and transfer: how long a hung peer can stall the job
    (the watchdog ends a process whose peer froze about this long)."""
    flush_s: float = 20.0
    """Longest a SIGTERM flush may take (torchrun kills workers 30 s after its SIGTERM)."""


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """Data parallelism that survives losing a host: the job's DP replicas are *virtual*,
    a fixed number of them whatever the number of ranks that computes them now
    (:mod:`baft.pipeline.elastic`). With ``num_replicas = 0`` (the default) the replicas
    are the ranks, as without this."""

    num_replicas: int = 0
    """The job's DP degree as its data and its gradient reduction see it, fixed for the
    job's life: every iteration processes the micro-batches of all of them. The ranks'
    DP degree must divide it; each rank computes ``num_replicas / dp`` consecutive
    replicas in its loop (``for r in ft.replicas(): ...``). 0: off."""
    deterministic: bool = True
    """Reduce the replicas' gradients in a fixed order (all-gather, then a sum in replica
    order) that does not depend on how many ranks compute them: the trajectory after a
    shrink or a grow is bit-identical to the run that never changed. False: each rank sums
    its replicas, then one all-reduce (the same samples; the last bits differ after a
    change of the DP degree)."""

    def validate(self, num_dp: int) -> None:
        if not isinstance(self.num_replicas, int) or self.num_replicas < 0:
            raise ValueError(f"elastic.num_replicas={self.num_replicas!r} must be an int >= 0")
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"elastic.deterministic must be true or false, got {self.deterministic!r}"
            )
        if self.num_replicas and self.num_replicas % num_dp:
            raise ValueError(
                f"elastic.num_replicas={self.num_replicas} is not a multiple of the job's "
                f"{num_dp} DP ranks per stage: run with a DP degree that divides it"
            )

    def hosted(self, num_dp: int, dp: int) -> range:
        """The virtual replicas DP rank ``dp`` of ``num_dp`` computes, in order."""
        if not self.num_replicas:
            return range(dp, dp + 1)
        k = self.num_replicas // num_dp
        return range(dp * k, (dp + 1) * k)


def dp_degree(num_replicas: int, world_size: int, model_ranks: int) -> int | None:
    """The DP degree a world of ``world_size`` ranks runs ``num_replicas`` elastic
    replicas with, when every copy of the model takes ``model_ranks`` ranks (``pp * tp``);
    None when it cannot hold a whole copy with a degree dividing the replicas (a stage's
    only copy was on a lost host)."""
    if model_ranks < 1 or world_size % model_ranks:
        return None
    dp = world_size // model_ranks
    return dp if dp >= 1 and num_replicas % dp == 0 else None


@dataclass(frozen=True, kw_only=True, slots=True)
class InprocessTimeouts:
    """Every bound of in-process recovery (:mod:`baft.inprocess`); set each with its
    environment variable, ``BAFT_INPROCESS_`` + the field's name in capitals (e.g.
    ``BAFT_INPROCESS_STUCK_S=2``), for the supervisors and training processes alike."""

    stuck_s: float = 1.0
    """Seconds a training thread has to take an announced generation (a survivor's abort
    and re-entry take well under one here) before its process counts as hung."""
    unresponsive_s: float = 2.0
    """Beyond ``stuck_s``: how long a process told of a generation may stay silent (it
    cannot even say it is stuck: stopped) before its supervisor replaces it."""
    peer_silence_s: float = 5.0
    """A peer supervisor silent this long (its host is gone): group restart."""
    abort_wait_s: float = 2.0
    """After the training function raised: how long to wait for a recovery announced by
    the supervisors (a peer's failure broke this rank's collective) before reporting the
    error as this rank's own failure."""
    store_s: float = 60.0
    """Timeout of the supervisors' control store and of a generation's store (opening it,
    publishing its port)."""
    hold_sigterm_s: float = 10.0
    """Seconds a SIGTERM that came between two generations waits for the next one's
    engine to flush it before the process leaves."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> InprocessTimeouts:
        """The defaults, each overridden by ``BAFT_INPROCESS_<FIELD>`` when set."""
        env = os.environ if environ is None else environ
        out: dict[str, float] = {}
        for name in cls.__dataclass_fields__:
            raw = env.get(f"BAFT_INPROCESS_{name.upper()}")
            if raw is not None:
                try:
                    out[name] = float(raw)
                except ValueError:
                    raise ValueError(
                        f"BAFT_INPROCESS_{name.upper()}={raw!r}: expected seconds (a number)"
                    ) from None
                if out[name] <= 0:
                    raise ValueError(f"BAFT_INPROCESS_{name.upper()}={raw}: must be > 0")
        return cls(**out)


MOVED: dict[str, str] = {
    "store_root": "store=StoreConfig(root=...)",
    "job_id": "store=StoreConfig(job_id=...)",
    "budget_bytes": "store=StoreConfig(budget_bytes=...)",
    "keep_stores_on_close": "store=StoreConfig(keep_on_close=...)",
    "persist_dir": "persist=PersistConfig(dir=...)",
    "flush_on_sigterm": "persist=PersistConfig(flush_on_sigterm=...)",
    "host_work": "exchange=ExchangeConfig(host_work=...)",
    "snapshot_copy": "exchange=ExchangeConfig(snapshot_copy=...)",
    "timeout_s": "timeouts=TimeoutConfig(collective_s=...)",
    "flush_timeout_s": "timeouts=TimeoutConfig(flush_s=...)",
    "max_restarts": (
        "the launcher: torchrun --max-restarts (baft train --max-restarts, "
        "TrainConfig.max_restarts)"
    ),
    "inject": (
        "the fault hooks: ft.inject([...]) before ft.restore() (baft train --inject, "
        "TrainConfig.inject)"
    ),
}
"""Fields ``CheckpointConfig`` had before it was grouped by owner -> where they are now."""


class MovedFieldError(AttributeError, TypeError):
    """A field of the flat ``CheckpointConfig`` of before: the message says where it is."""


def _moved_error(name: str) -> MovedFieldError:
    return MovedFieldError(
        f"CheckpointConfig.{name} moved: use CheckpointConfig({MOVED[name]}) "
        "(fields are grouped by who reads them: store, persist, exchange, timeouts)"
        if "=" in MOVED[name] and not MOVED[name].startswith("the ")
        else f"CheckpointConfig.{name} moved to {MOVED[name]}"
    )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Fault tolerance of a run: the checkpoint policy, then one group per owner."""

    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    """How often and how safely: interval, redundancy, persistence, differential slices
    (see :class:`baft.plan.types.CheckpointPolicy`; ``CheckpointConfig.parse`` reads the
    ``every=1,redundancy=xor:2,...`` syntax)."""
    profile_iters: int = 3
    """Unprotected iterations whose timelines make the BubbleMap (skipped after a restart)."""
    allow_fresh_start: bool = False
    """Whether a run that shows progress (its run directory's progress record, or
    snapshots of the job in a store) may start over from iteration 0 when nothing can be
    restored from memory or DCP. False: that is an error, never a silent restart."""
    cost: dict[str, float] | None = None
    """Cost-model override (copy_Bps, net_Bps, encode_Bps, persist_Bps, interference);
    None measures it at the end of profiling (about a second, rank 0)."""
    store: StoreConfig = field(default_factory=StoreConfig)
    persist: PersistConfig = field(default_factory=PersistConfig)
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    if not TYPE_CHECKING:  # hidden from mypy, which would take any attribute as Any

        def __getattr__(self, name: str) -> Any:
            if name in MOVED:  # only reached for names that are no field
                raise _moved_error(name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        def __setattr__(self, name: str, value: Any) -> None:
            if name in MOVED:
                raise _moved_error(name)
            object.__setattr__(self, name, value)

    def validate(self, topology: Any = None) -> None:
        """Raise ValueError naming the field and the fix; with a ``topology`` also check
        that the redundancy fits its failure domains."""
        if not isinstance(self.policy, CheckpointPolicy):
            raise ValueError(f"policy must be a CheckpointPolicy, got {type(self.policy).__name__}")
        for name, kind in (
            ("store", StoreConfig), ("persist", PersistConfig),
            ("exchange", ExchangeConfig), ("timeouts", TimeoutConfig),
            ("elastic", ElasticConfig),
        ):  # fmt: skip
            if not isinstance(getattr(self, name), kind):
                raise ValueError(
                    f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}"
                    + (f" (for exchange={getattr(self, name)!r} use exchange=ExchangeConfig(paths=...))"
                       if name == "exchange" else "")
                )  # fmt: skip
        if self.profile_iters < 1:
            raise ValueError(f"profile_iters={self.profile_iters} must be >= 1")
        ex, t = self.exchange, self.timeouts
        if ex.host_work not in ("auto", "bubbles", "always"):
            raise ValueError(f"host_work must be auto, bubbles or always, got {ex.host_work!r}")
        if ex.snapshot_copy not in ("auto", "thread"):
            raise ValueError(f"snapshot_copy must be auto or thread, got {ex.snapshot_copy!r}")
        if ex.paths not in ("auto", "network"):
            raise ValueError(f"exchange paths must be auto or network, got {ex.paths!r}")
        if t.collective_s <= 0:
            raise ValueError(f"timeouts.collective_s={t.collective_s} must be > 0 seconds")
        if t.flush_s <= 0:
            raise ValueError(f"timeouts.flush_s={t.flush_s} must be > 0 seconds")
        if self.store.budget_bytes is not None and self.store.budget_bytes <= 0:
            raise ValueError(f"store.budget_bytes={self.store.budget_bytes} must be > 0")
        for name, value in (
            ("allow_fresh_start", self.allow_fresh_start),
            ("store.keep_on_close", self.store.keep_on_close),
            ("persist.flush_on_sigterm", self.persist.flush_on_sigterm),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if topology is not None:
            from baft.store.coding import Redundancy, coding_groups

            coding_groups(topology, Redundancy.parse(self.policy.redundancy))
            self.elastic.validate(topology.num_dp)

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
        groups = {
            "store": StoreConfig, "persist": PersistConfig,
            "exchange": ExchangeConfig, "timeouts": TimeoutConfig, "elastic": ElasticConfig,
        }  # fmt: skip
        parts = {k: kind(**d.pop(k)) for k, kind in groups.items() if k in d}
        return cls(policy=CheckpointPolicy(**d.pop("policy", {})), **parts, **d)


_generated_init = CheckpointConfig.__init__


def _init(self: CheckpointConfig, *args: Any, **kwargs: Any) -> None:
    """The dataclass's ``__init__``, with an error that says where an old field moved."""
    for name in kwargs:
        if name in MOVED:
            raise _moved_error(name)
    _generated_init(self, *args, **kwargs)


CheckpointConfig.__init__ = _init  # type: ignore[method-assign]


def default_job_id(out_dir: str) -> str:
    """A store name unique to the run directory, stable across restarts."""
    digest = hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:10]
    return f"job-{digest}"
