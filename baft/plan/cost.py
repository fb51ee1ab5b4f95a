"""Pure cost model: seconds per checkpoint task, and how many bytes fit in a bubble.

Every task costs a fixed ``task_overhead_s`` plus its bytes over the throughput of its
kind. ``slot_bytes`` inverts that for a slot: the most bytes that chunks of allowed sizes
can move within a given number of seconds; ``cut_sizes`` cuts a byte count into such
chunks. The planner and the lower bound share these, so they agree on what "fits" means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from baft.plan.types import TaskKind

__all__ = ["CostModel", "cut_sizes", "slot_bytes"]

_EPS = 1e-12
"""Relative slack when comparing seconds, so float rounding never rejects an exact fit."""


@dataclass(kw_only=True, slots=True)
class CostModel:
    """Throughputs of this machine's checkpoint primitives (measured elsewhere)."""

    copy_Bps: float = 3e9
    """SNAPSHOT: live tensor -> preallocated (shared-memory) snapshot buffer, bytes/s."""
    net_Bps: float = 1e9
    """SEND/RECV: peer transfer, bytes/s."""
    encode_Bps: float = 2e9
    """ENCODE: parity computation, bytes/s of input."""
    persist_Bps: float = 3e8
    """PERSIST: snapshot -> durable storage, bytes/s."""
    interference: float = 0.0
    """Fraction by which a copy in one rank's bubble slows compute of ranks that share its
    memory bandwidth: in-bubble SNAPSHOT seconds count this much as exposed."""
    task_overhead_s: float = 50e-6
    """Fixed cost per task (dispatch, synchronisation)."""

    def __post_init__(self) -> None:
        for name in ("copy_Bps", "net_Bps", "encode_Bps", "persist_Bps"):
            value = getattr(self, name)
            if not value > 0.0 or math.isinf(value):
                raise ValueError(f"{name}={value} must be a positive finite number of bytes/s")
        if not self.interference >= 0.0:
            raise ValueError(f"interference={self.interference} must be >= 0 (0 = none)")
        if not self.task_overhead_s >= 0.0:
            raise ValueError(f"task_overhead_s={self.task_overhead_s} must be >= 0")

    @classmethod
    def from_measurements(cls, values: Mapping[str, float]) -> CostModel:
        """Build from a dict of measurements; keys that are not fields are ignored."""
        names = ("copy_Bps", "net_Bps", "encode_Bps", "persist_Bps", "interference")
        return cls(**{k: float(values[k]) for k in names if k in values})

    def rate(self, kind: TaskKind) -> float:
        """Throughput in bytes/s of one task kind."""
        # module-level aliases: enum attribute lookups dominated planning at 4096 ranks
        if kind is _SNAPSHOT:
            return self.copy_Bps
        if kind is _SEND or kind is _RECV:
            return self.net_Bps
        if kind is _ENCODE:
            return self.encode_Bps
        return self.persist_Bps

    def seconds(self, kind: TaskKind, nbytes: int) -> float:
        """Estimated seconds of one task moving ``nbytes`` (0 bytes cost nothing)."""
        if nbytes <= 0:
            return 0.0
        return self.task_overhead_s + nbytes / self.rate(kind)

    def per_byte_s(self, kind: TaskKind, max_chunk_bytes: int) -> float:
        """Least seconds per byte of a long stream of tasks (overhead amortised over
        ``max_chunk_bytes``): the slope used by the fluid lower bound."""
        return 1.0 / self.rate(kind) + self.task_overhead_s / max_chunk_bytes


def slot_bytes(
    seconds: float, rate: float, overhead_s: float, max_bytes: int, min_bytes: int
) -> int:
    """Most bytes that chunks of ``min_bytes..max_bytes`` move within ``seconds``.

    ``n`` full chunks fit, then one more chunk with what is left; a remainder below
    ``min_bytes`` is still usable when at least one full chunk is there (the last two chunks
    are then cut evenly, see ``cut_sizes``). Assumes ``max_bytes >= 2 * min_bytes``.
    """
    if seconds <= 0.0:
        return 0
    budget = seconds * (1.0 + _EPS)
    full_s = overhead_s + max_bytes / rate
    num_full = int(budget // full_s)
    rest_s = budget - num_full * full_s
    extra = int((rest_s - overhead_s) * rate) if rest_s > overhead_s else 0
    extra = max(0, min(extra, max_bytes - 1))
    if num_full == 0 and extra < min_bytes:
        extra = 0
    return num_full * max_bytes + extra


def tail_bytes(seconds: float, rate: float, overhead_s: float) -> int:
    """Bytes of one single task that fits in ``seconds`` (for a range's short last chunk)."""
    if seconds <= overhead_s:
        return 0
    return max(0, int((seconds * (1.0 + _EPS) - overhead_s) * rate))


def cut_sizes(nbytes: int, max_bytes: int, min_bytes: int) -> list[int]:
    """Cut ``nbytes`` into chunks of at most ``max_bytes`` and, when more than one chunk is
    needed, at least ``min_bytes`` (the last two are evened out). Fewest chunks possible."""
    if nbytes <= 0:
        return []
    num_full, rest = divmod(nbytes, max_bytes)
    sizes = [max_bytes] * num_full
    if rest:
        if rest < min_bytes and num_full >= 1:
            pair = max_bytes + rest
            sizes[-1] = (pair + 1) // 2
            sizes.append(pair // 2)
        else:
            sizes.append(rest)
    return sizes


def fits(used_s: float, capacity_s: float) -> bool:
    """``used_s <= capacity_s`` up to float rounding."""
    return used_s <= capacity_s * (1.0 + 1e-9) + 1e-15


_SNAPSHOT, _SEND, _RECV, _ENCODE = TaskKind.SNAPSHOT, TaskKind.SEND, TaskKind.RECV, TaskKind.ENCODE
