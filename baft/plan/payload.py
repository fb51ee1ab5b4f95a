"""What one version protects under differential checkpoints: its payload layout (pure).

With ``full_every = k > 1`` the payload of version ``v`` is, in this byte order:

1. **always**: every tensor that is not a parameter or optimizer state (RNG, buffers,
   encoded small state): small, and not replayable from gradients, so in every payload;
2. **record meta**: a fixed-capacity blob saying which step the record is of, which
   params had gradients and every param group's hyperparameters at that step;
3. **record**: one gradient per parameter (same bytes as the parameter), what optimizer
   step ``v - 1`` consumed;
4. **slice** ``v % k``: whole tensor groups (a parameter with its optimizer state, see
   :mod:`baft.plan.rotation`), padded to the largest slice so that every payload of a
   rank has the same size and the planner, the store slots and the redundancy codes
   work on it unchanged.

There is no anchor payload here (unlike ``rotation.slices_in_payload``): every slot has
the steady-state size, so right after a fresh start (or a restore from DCP) a version is
rebuildable only once a whole rotation is behind it (``first_version + k - 1``). After a
restore from memory the rotation continues from the restored payloads, so no gap opens.

Only names and sizes are used here (``TensorSpec``): the engine maps them to tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baft.plan import names
from baft.plan.rotation import TensorGroup, assign_slices, slice_nbytes
from baft.plan.types import TensorSpec

RECORD_META = "record.meta"
"""Name of the record's metadata blob in a payload."""
SLICE = "slice"
"""Name of the planner's stand-in for the (padded) slice region of a payload."""
GRAD_PREFIX = names.GRAD
"""Record tensors are named ``grad.<fqn>`` after the parameter ``model.<fqn>``."""


@dataclass(frozen=True)
class PayloadLayout:
    """The payload of every version of one rank (identical on its DP replicas)."""

    k: int
    always: tuple[TensorSpec, ...]
    meta_nbytes: int
    grads: tuple[TensorSpec, ...]
    """``grad.<fqn>`` per parameter, in parameter order."""
    groups: tuple[str, ...]
    """Tensor groups (parameter FQNs) in parameter order."""
    members: dict[str, tuple[TensorSpec, ...]]
    """Group -> its tensors (the parameter first, then its optimizer state), flat order."""
    slice_of: dict[str, int]
    slice_sizes: tuple[int, ...]

    @classmethod
    def of(cls, specs: Sequence[TensorSpec], k: int, meta_nbytes: int = 64 << 10) -> PayloadLayout:
        """From a rank's full flat-state specs (canonical order) and ``k >= 2``."""
        if k < 2:
            raise ValueError(f"a differential payload needs full_every >= 2, got {k}")
        always: list[TensorSpec] = []
        members: dict[str, list[TensorSpec]] = {}
        params: dict[str, TensorSpec] = {}
        for s in specs:
            g = names.group_of(s.name)
            if g is None:
                always.append(s)
                continue
            members.setdefault(g, []).append(s)
            if s.name == names.model(g):
                params[g] = s
        orphans = sorted(set(members) - set(params))
        if orphans:
            raise ValueError(f"optimizer state without its parameter: {orphans[:5]}")
        groups = tuple(members)
        sized = [TensorGroup(g, sum(s.nbytes for s in members[g])) for g in groups]
        assignment = assign_slices(sized, k)
        return cls(
            k=k,
            always=tuple(always),
            meta_nbytes=meta_nbytes,
            grads=tuple(TensorSpec(names.grad(g), params[g].nbytes) for g in groups),
            groups=groups,
            members={g: tuple(members[g]) for g in groups},
            slice_of=dict(zip(groups, assignment, strict=True)),
            slice_sizes=slice_nbytes(sized, assignment, k),
        )

    @property
    def record_nbytes(self) -> int:
        return self.meta_nbytes + sum(s.nbytes for s in self.grads)

    @property
    def head_nbytes(self) -> int:
        """Bytes before the slice region: always + record meta + record."""
        return sum(s.nbytes for s in self.always) + self.record_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of every payload: the head plus the largest slice."""
        return self.head_nbytes + max(self.slice_sizes)

    def slice_members(self, j: int) -> tuple[TensorSpec, ...]:
        """Tensors of slice ``j`` in payload order (groups in parameter order)."""
        return tuple(s for g in self.groups if self.slice_of[g] == j for s in self.members[g])

    def specs(self) -> tuple[TensorSpec, ...]:
        """What the planner sees: the head's tensors and one stand-in for the slice."""
        return (
            *self.always,
            TensorSpec(RECORD_META, self.meta_nbytes),
            *self.grads,
            TensorSpec(SLICE, max(self.slice_sizes)),
        )

    def order(self, j: int) -> tuple[TensorSpec, ...]:
        """Every tensor of the payload of a version of slice ``j``, in byte order (the
        padding after the slice is not listed)."""
        return (
            *self.always,
            TensorSpec(RECORD_META, self.meta_nbytes),
            *self.grads,
            *self.slice_members(j),
        )


AUTO_FILL = 0.25
"""Share of the profiled bubble capacity ``full_every=auto`` lets a payload fill. Bubbles
are profiled without checkpoint traffic, and a copy inside one is not free: it slows the
neighbour rank's compute through memory bandwidth and caches (on 2 cores a snapshot copied
at 3.4 GB/s in the run against 5-7 alone), and with emulated compute copies placed late in
an iteration overlap the optimizer steps. Measured (pp=2, 146 MiB of state per rank,
redundancy=none, 2026-12-05, paired wall ratios): with real compute, full snapshots (which
nominally filled 82% of the capacity) cost 1.11-1.17x, full_every=3 (the choice at a share
of 0.5) 1.09x, full_every=8 1.01-1.08x (mean 1.033 over five launches, naive-async 1.083);
with emulated compute full_every=2-3 cost 0.9% more than naive-async, full_every=8 is level
with it. 0.25 picks 8 for both."""


def auto_full_every(
    specs: Sequence[TensorSpec],
    capacity_s: float,
    copy_Bps: float,
    net_Bps: float,
    fanout: float,
    max_k: int = 8,
) -> tuple[int, str]:
    """``full_every`` for one rank from its bubbles: the smallest ``k`` whose payload
    (record + largest slice) fits :data:`AUTO_FILL` of what the bubbles of one iteration
    can copy and protect.

    A payload byte costs a copy plus ``fanout`` network bytes of redundancy (replicas
    send their shard ``k`` times, parity codes about once). ``max_k`` bounds the steps a
    recovery replays and the records the store keeps.
    """
    from baft.plan.rotation import choose_full_every

    per_byte_s = 1.0 / copy_Bps + fanout / net_Bps
    capacity = AUTO_FILL * max(capacity_s, 0.0) / per_byte_s
    record = sum(s.nbytes for s in specs if names.is_model(s.name))
    groups: dict[str, int] = {}
    for s in specs:
        g = names.group_of(s.name)
        if g is not None:
            groups[g] = groups.get(g, 0) + s.nbytes
    k, why = choose_full_every(record, list(groups.values()), capacity, max_k)
    return k, f"{why} (auto counts {AUTO_FILL:.0%} of the bubbles' capacity: AUTO_FILL)"
