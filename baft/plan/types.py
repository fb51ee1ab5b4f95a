"""Pure data types shared by the planner, the executor, the profiler and the simulator.

A ``BubbleMap`` says where a rank idles in one iteration, a ``StateLayout`` what it must
snapshot, a ``CheckpointPolicy`` how often and how safely; the planner turns them into a
``CheckpointPlan``: per rank and slot, the ordered ``Task`` list to run there. No I/O here.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "BubbleMap",
    "CheckpointPlan",
    "CheckpointPolicy",
    "Chunk",
    "RankPlan",
    "Slot",
    "StateLayout",
    "Task",
    "TaskKind",
    "TensorSpec",
]


class TaskKind(enum.Enum):
    """One unit of checkpoint work."""

    SNAPSHOT = "snapshot"
    """Live tensor bytes -> snapshot buffer (must finish before the step of the same iteration)."""
    SEND = "send"
    """Snapshot bytes -> a peer's store (redundancy traffic)."""
    RECV = "recv"
    """Receive redundancy bytes from a peer."""
    ENCODE = "encode"
    """Parity computation over received bytes."""
    PERSIST = "persist"
    """Snapshot -> durable storage."""


@dataclass(frozen=True, slots=True)
class Slot:
    """A point in a rank's iteration where it blocks, with the idle time measured there."""

    slot_id: str
    """Opaque id, stable across iterations: "w0", "w1", ... (k-th blocking wait) or "pre_step"."""
    idle_s: float
    """Expected (median) idle seconds at this slot."""
    spread_s: float = 0.0
    """Spread of the measured idle, e.g. (p90 - p10) / 2."""
    kind: str = "p2p"
    """"p2p" (pipeline receive), "collective" (e.g. DP all-reduce) or "pre_step"."""


@dataclass(frozen=True, slots=True)
class BubbleMap:
    """Where one rank idles during one iteration."""

    rank: int
    """Global rank."""
    slots: tuple[Slot, ...]
    """Slots in iteration order; the last one is normally the "pre_step" slot."""
    iteration_s: float
    """Median iteration seconds."""

    def capacity_s(self) -> float:
        """Total expected idle seconds (sum of ``idle_s``)."""
        return sum(s.idle_s for s in self.slots)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a rank's checkpointed state."""

    name: str
    """Canonical FQN, e.g. "model.layers.3.attn.wq.weight" or "optim.<fqn>.exp_avg"."""
    nbytes: int
    """Size in bytes."""


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What one rank must checkpoint, and who holds the same bytes."""

    rank: int
    """Global rank."""
    tensors: tuple[TensorSpec, ...]
    """Canonical order; the flat state is their concatenation (no padding)."""
    replicas: tuple[int, ...]
    """Ranks holding identical state (DP replicas), including ``rank``, ordered by dp."""

    @property
    def nbytes(self) -> int:
        """Size of the flat state in bytes."""
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A contiguous byte range of a replica group's flat state."""

    chunk_id: int
    """Stable across iterations for the same plan; unique within the replica group."""
    start: int
    """Byte offset in the flat state of the replica group."""
    stop: int
    """Exclusive end offset."""

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Task:
    """One planned unit of checkpoint work."""

    kind: TaskKind
    """What to do."""
    chunk_id: int
    """SNAPSHOT: the owned chunk's id. SEND: the piece number within this rank's sends."""
    nbytes: int
    """Bytes moved."""
    est_s: float
    """Cost-model estimate in seconds."""
    lag: int = 0
    """0: runs in iteration v for version v; 1: in iteration v+1 (never for SNAPSHOT)."""
    stream: int = 0
    """SEND: index of the transfer in ``transfers[rank]`` this piece belongs to; its
    destination is ``RankPlan.peers[stream]`` (tasks name no rank, so identical ranks share
    them)."""
    offset: int = 0
    """SNAPSHOT: chunk start in the group's flat state. SEND: byte offset in the transfer."""


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Everything one rank does for one checkpoint."""

    rank: int
    """Global rank."""
    owned: tuple[Chunk, ...]
    """Chunks this rank snapshots (its DP shard), in byte order."""
    owned_start: int
    """First owned byte of the group's flat state."""
    owned_stop: int
    """One past the last owned byte."""
    tasks: dict[str, tuple[Task, ...]]
    """slot_id -> ordered tasks to run there (slots without tasks are omitted)."""
    spilled: tuple[Task, ...]
    """Tasks that fit no bubble: run synchronously right before optimizer.step."""
    exposed_s: float
    """Predicted exposed seconds per iteration (per-checkpoint cost / interval)."""
    peers: tuple[int, ...] = ()
    """Destination rank of each SEND stream (``Task.stream`` indexes it)."""


@dataclass(frozen=True, slots=True)
class CheckpointPlan:
    """The planner's answer for all ranks."""

    ranks: dict[int, RankPlan]
    """Global rank -> its plan."""
    interval_iters: int
    """A checkpoint every N iterations (1 = every iteration)."""
    exposed_s: float
    """Max over ranks of the predicted exposed seconds per iteration."""
    lower_bound_s: float
    """Lower bound on ``exposed_s`` for this interval (see ``baft.plan.bounds``)."""
    reason: str
    """One human-readable paragraph."""


_REDUNDANCY = re.compile(r"^(none|replicate:\d+|xor:\d+|rs:\d+\+\d+)$")
_OVERFLOW = ("spill", "stretch")


def _full_every(text: str) -> int:
    """``auto`` -> 0, else an int."""
    return 0 if text == "auto" else int(text)


@dataclass(kw_only=True, slots=True)
class CheckpointPolicy:
    """How often and how safely to checkpoint. Raises ``ValueError`` with the fix."""

    every: int = 1
    """Target interval in iterations (1 = a checkpoint every iteration)."""
    redundancy: str = "xor:2"
    """"none" | "replicate:k" | "xor:g" | "rs:k+m" (carried for the coding module)."""
    persist_every: int = 50
    """Persist every N-th committed checkpoint to durable storage (0 = never). A due
    checkpoint whose rank is still writing the previous save is passed over and the next
    one persisted instead: training never waits for the disk, so at a cadence the disk
    cannot keep (1, with a save slower than an iteration) the job persists as often as
    its disk allows. A job that ends cleanly with a due version passed over persists its
    final state at ``close()``."""
    keep_latest: int = 2
    """DCP checkpoints kept on disk (the newest ones; older ones are deleted)."""
    on_overflow: str = "spill"
    """"spill": keep the interval, run leftover work before the step (exposed);
    "stretch": lengthen the interval until the exposed share is at most ``target_overhead``."""
    max_chunk_bytes: int = 8 << 20
    """Largest chunk (and SEND piece)."""
    min_chunk_bytes: int = 64 << 10
    """Smallest chunk, except the last chunk of a range shorter than this."""
    target_overhead: float = 0.01
    """With "stretch": accepted exposed seconds per iteration, as a fraction of the iteration."""
    spread_margin: float = 0.0
    """Plan on ``idle_s - spread_margin * spread_s`` per slot (0 = on the median)."""
    full_every: int = 0
    """Differential checkpoints: every tensor's full copy is refreshed at least every
    ``full_every`` iterations and each iteration protects the gradient record of the last
    step plus one slice of the full state (see :mod:`baft.plan.payload`); 1 = the whole
    state every iteration; 0 = "auto": the smallest value whose bytes per iteration fit
    the measured bubbles."""
    align_to_tensors: bool = True
    """Put the boundaries between DP owners on tensor boundaries (see planner.snap_to_tensors)."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every={self.every} must be >= 1 (iterations between checkpoints)")
        if not _REDUNDANCY.match(self.redundancy):
            raise ValueError(
                f"redundancy={self.redundancy!r} not understood: use none, replicate:k, "
                "xor:g or rs:k+m (e.g. xor:2)"
            )
        if self.persist_every < 0:
            raise ValueError(f"persist_every={self.persist_every} must be >= 0 (0 = never)")
        if self.keep_latest < 1:
            raise ValueError(f"keep_latest={self.keep_latest} must be >= 1")
        if self.on_overflow not in _OVERFLOW:
            raise ValueError(f"on_overflow={self.on_overflow!r}: use 'spill' or 'stretch'")
        if self.full_every < 0:
            raise ValueError(f"full_every={self.full_every} must be >= 1, or 0 for auto")
        if self.min_chunk_bytes < 1:
            raise ValueError(f"min_chunk_bytes={self.min_chunk_bytes} must be >= 1")
        if self.max_chunk_bytes < 2 * self.min_chunk_bytes:
            raise ValueError(
                f"max_chunk_bytes={self.max_chunk_bytes} must be >= 2 * min_chunk_bytes "
                f"({2 * self.min_chunk_bytes}); raise max_chunk_bytes or lower min_chunk_bytes"
            )
        if not 0.0 < self.target_overhead < 1.0:
            raise ValueError(
                f"target_overhead={self.target_overhead} must be in (0, 1), e.g. 0.01 for 1%"
            )
        if not self.spread_margin >= 0.0:
            raise ValueError(f"spread_margin={self.spread_margin} must be >= 0")

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy:
        """Parse "every=1,redundancy=xor:2,persist=50,keep=2,overflow=spill,full_every=auto"
        (any subset)."""
        keys: dict[str, tuple[str, Callable[[str], object]]] = {
            "every": ("every", int),
            "redundancy": ("redundancy", str),
            "persist": ("persist_every", int),
            "keep": ("keep_latest", int),
            "overflow": ("on_overflow", str),
            "max_chunk": ("max_chunk_bytes", int),
            "min_chunk": ("min_chunk_bytes", int),
            "target": ("target_overhead", float),
            "full_every": ("full_every", _full_every),
        }
        kwargs: dict[str, object] = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in keys:
                raise ValueError(
                    f"policy item {item!r} not understood: use key=value with keys "
                    f"{', '.join(keys)} (e.g. every=1,redundancy=xor:2,persist=50)"
                )
            name, conv = keys[key]
            try:
                kwargs[name] = conv(value.strip())
            except ValueError:
                raise ValueError(
                    f"policy item {item!r}: {value.strip()!r} is not a valid "
                    f"{'int or auto' if conv is _full_every else getattr(conv, '__name__', 'value')}"
                ) from None
        return cls(**kwargs)  # type: ignore[arg-type]
