"""Pure rotation of full-state slices for differential checkpoints (no torch, no I/O).

Differential checkpointing protects, per iteration, the **gradient record** of the last
optimizer step plus one **full-state slice** (DESIGN.md, vocabulary). This module decides
which tensor groups form each slice, which slice a version carries, which versions a
rebuild needs, and how many slices (``K`` = ``full_every``) the bubbles can afford.

Conventions (every function here follows them):

- A **tensor group** is one parameter and all its optimizer-state tensors; slices hold
  whole groups, so a group's weight and moments always come from the same version.
- **Version v** is the state before optimizer step ``v`` (after step ``v - 1``). The
  **record of step s** is what step ``s`` consumed; it turns version ``s`` into ``s + 1``.
- The **payload of version v** (what the engine protects during iteration ``v``) holds the
  full copy of slice ``v % k`` taken at version ``v`` (copied in iteration ``v``'s bubbles,
  before step ``v``) and the record of step ``v - 1`` (captured at step ``v - 1`` by
  reference, protected in iteration ``v``'s bubbles).
- ``first_version`` is where the rotation starts: the first version protected after a
  fresh start or a restore from DCP, or after ``k`` or the slice assignment changed. A
  restore from memory does not start a rotation: the restored version's window is in the
  store, the new payloads continue it, so ``first_version`` stays.

The newest full copy of slice ``j`` at version ``v`` is then the newest ``b <= v`` with
``b % k == j``, and rebuilding ``v`` needs the payloads ``v - k + 1 .. v``: their slices,
and the records of steps ``b .. v - 1`` for each group's base ``b`` (carried by payloads
``b + 1 .. v``). With ``k = 1`` every payload is a full snapshot and needs no record.

How a rotation starts (``anchor``, keyword of the functions below):

- ``anchor=False`` (default; the engine's ``plan/payload.py``): every payload has the
  same size, so store slots, the planner and the redundancy codes work unchanged; a
  version is rebuildable once a whole rotation is behind it (``v >= first_version + k
  - 1``). After a fresh start that only means the first ``k - 1`` versions are not
  protected yet (a crash then starts the job over from iteration 0, logged, as a crash
  before the first checkpoint does: ``recover/runtime.py``); after a restore from DCP, a failure within ``k - 1`` iterations falls
  back to DCP again (up to ``k`` more iterations lost), the price of fixed-size payloads.
- ``anchor=True``: the payload of ``first_version`` holds every slice (a full snapshot)
  and no record; every version from ``first_version`` on is rebuildable (at most one
  iteration lost right after a restart), at the cost of one payload ``k`` times larger
  per rotation start (spilled or stretched like ``full_every=1``), needed until every
  slice has been refreshed once (version ``first_version + k``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = [
    "TensorGroup",
    "assign_slices",
    "base_version",
    "choose_full_every",
    "has_record",
    "newest_rebuildable",
    "payload_nbytes",
    "rebuildable",
    "retained_nbytes",
    "slice_for_version",
    "slice_nbytes",
    "slices_in_payload",
    "window",
]


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """One parameter with all its optimizer-state tensors (the unit a slice holds)."""

    name: str
    """The parameter's name (e.g. its FQN); unique within a rank."""
    nbytes: int
    """Bytes of the parameter plus its optimizer-state tensors."""


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"full_every (k) must be >= 1, got {k}")


def _check_version(version: int, first_version: int) -> None:
    if first_version < 0:
        raise ValueError(f"first_version must be >= 0, got {first_version}")
    if version < first_version:
        raise ValueError(f"version {version} is older than first_version {first_version}")


def assign_slices(groups: Sequence[TensorGroup], k: int) -> tuple[int, ...]:
    """Slice index (``0 .. k-1``) of each group, balanced by bytes.

    Greedy longest-processing-time: groups in order of decreasing size (ties: input
    order) each go to the slice with the fewest bytes, then the fewest groups, then the
    lowest index. Deterministic for the same input. Every slice gets at least one group
    when ``k <= len(groups)`` (an empty slice always wins the tie-break over a used one,
    even for zero-byte groups); with more slices than groups the extra slices stay empty.
    Raises ``ValueError`` for ``k < 1``, duplicate names or negative sizes.
    """
    _check_k(k)
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor group names must be unique, repeated: {dup[:5]}")
    if any(g.nbytes < 0 for g in groups):
        raise ValueError("tensor group sizes must be >= 0")
    loads = [0] * k
    counts = [0] * k
    out = [0] * len(groups)
    # A heap would be O(n log k); k is at most a few dozen, a scan keeps the tie-break plain.
    for i in sorted(range(len(groups)), key=lambda i: (-groups[i].nbytes, i)):
        j = min(range(k), key=lambda j: (loads[j], counts[j], j))
        out[i] = j
        loads[j] += groups[i].nbytes
        counts[j] += 1
    return tuple(out)


def slice_nbytes(
    groups: Sequence[TensorGroup], assignment: Sequence[int], k: int
) -> tuple[int, ...]:
    """Bytes of each of the ``k`` slices under ``assignment`` (from ``assign_slices``)."""
    _check_k(k)
    if len(assignment) != len(groups):
        raise ValueError(f"{len(assignment)} slice indices for {len(groups)} groups")
    out = [0] * k
    for g, j in zip(groups, assignment, strict=True):
        if not 0 <= j < k:
            raise ValueError(f"slice index {j} of {g.name!r} outside 0..{k - 1}")
        out[j] += g.nbytes
    return tuple(out)


def slice_for_version(version: int, k: int) -> int:
    """The slice whose full copy the payload of ``version`` carries (``version % k``).

    The anchor payload (``first_version``) carries every slice: see ``slices_in_payload``.
    """
    _check_k(k)
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return version % k


def slices_in_payload(
    version: int, k: int, first_version: int = 0, *, anchor: bool = False
) -> tuple[int, ...]:
    """Slices whose full copies the payload of ``version`` holds (all at an anchor)."""
    _check_k(k)
    _check_version(version, first_version)
    if anchor and version == first_version:
        return tuple(range(k))
    return (version % k,)


def has_record(version: int, k: int, first_version: int = 0) -> bool:
    """Whether the payload of ``version`` carries a gradient record (of step ``version-1``).

    Not at ``first_version`` (the step before it ran in another process, or before ``k``
    changed, and no rebuild from this rotation needs it) and never with ``k = 1`` (every
    version is a full snapshot). The same with and without an anchor.
    """
    _check_k(k)
    _check_version(version, first_version)
    return k > 1 and version > first_version


def base_version(
    slice_index: int, version: int, k: int, first_version: int = 0, *, anchor: bool = False
) -> int | None:
    """Version of the newest full copy of slice ``slice_index`` available at ``version``.

    The newest ``b <= version`` with ``b % k == slice_index`` and ``b >= first_version``;
    with ``anchor``, the anchor when the slice has not been refreshed since; without,
    ``None`` (no copy yet). Rebuilding ``version`` for a group of that slice replays the
    records of steps ``b .. version - 1``.
    """
    _check_k(k)
    _check_version(version, first_version)
    if not 0 <= slice_index < k:
        raise ValueError(f"slice index {slice_index} outside 0..{k - 1}")
    b = version - (version - slice_index) % k
    if b >= first_version:
        return b
    return first_version if anchor else None


def window(version: int, k: int, first_version: int = 0, *, anchor: bool = False) -> range:
    """Versions whose payloads rebuilding ``version`` needs (all of them, no gaps).

    ``version - k + 1 .. version`` (with ``anchor``, from ``first_version`` at the
    latest): the oldest is the base of slice ``(version + 1) % k``; every payload after it
    carries a record the replay needs, and every slice's newest copy lies inside. Raises
    ``ValueError`` when ``version`` is not rebuildable (see ``rebuildable``).
    """
    _check_k(k)
    _check_version(version, first_version)
    if anchor:
        return range(max(first_version, version - k + 1), version + 1)
    if version - k + 1 < first_version:
        raise ValueError(
            f"version {version} is not rebuildable: without an anchor the rotation that "
            f"started at {first_version} completes at version {first_version + k - 1}"
        )
    return range(version - k + 1, version + 1)


def rebuildable(
    version: int,
    k: int,
    first_version: int = 0,
    available: Collection[int] | None = None,
    *,
    anchor: bool = False,
) -> bool:
    """Whether ``version`` can be rebuilt from slices and records.

    By construction: from ``first_version + k - 1`` on (a whole rotation behind it), or
    from ``first_version`` on with ``anchor``; older versions belong to another rotation.
    With ``available`` (the versions whose payloads are committed and verified) also
    every payload of ``window(version, ...)`` must be there: one missing payload makes
    the version unrecoverable, never wrong.
    """
    _check_k(k)
    if version < (first_version if anchor else first_version + k - 1):
        return False
    if available is None:
        return True
    return all(u in available for u in window(version, k, first_version, anchor=anchor))


def newest_rebuildable(
    available: Collection[int], k: int, first_version: int = 0, *, anchor: bool = False
) -> int | None:
    """The newest version whose whole window is in ``available``, or ``None``."""
    for v in sorted(available, reverse=True):
        if rebuildable(v, k, first_version, available, anchor=anchor):
            return v
    return None


def payload_nbytes(record_nbytes: int, slice_sizes: Sequence[int]) -> int:
    """Bytes protected in a steady-state iteration at the worst slice.

    ``record_nbytes + max(slice_sizes)`` with ``k = len(slice_sizes) > 1``; with ``k = 1``
    the full state alone (no record is needed). The anchor payload is ``sum(slice_sizes)``.
    """
    if not slice_sizes:
        raise ValueError("slice_sizes must not be empty (k >= 1)")
    if len(slice_sizes) == 1:
        return int(slice_sizes[0])
    return int(record_nbytes) + max(slice_sizes)


def retained_nbytes(
    record_nbytes: int, slice_sizes: Sequence[int], *, anchor: bool = False, padded: bool = False
) -> int:
    """Store bytes that keep the newest committed version rebuildable while the next
    payload is in flight (payloads are stored whole: a slice and its record together).

    The window's ``k`` payloads plus the one in flight: ``k + 1`` payloads, i.e.
    ``sum + slice + (k + 1) * record`` with the worst slice, or ``(k + 1) *
    payload_nbytes`` when every payload is ``padded`` to the largest slice (the engine's
    fixed-size slots). With ``anchor``, right after it: the anchor (every slice) plus
    ``k - 1`` payloads plus the one in flight, whose slices are again every slice,
    ``2 * sum + k * record`` (the larger of the two counts). With ``k = 1``: two full
    copies.
    """
    if not slice_sizes:
        raise ValueError("slice_sizes must not be empty (k >= 1)")
    k = len(slice_sizes)
    total = sum(slice_sizes)
    if k == 1:
        return 2 * total
    if padded:
        steady = (k + 1) * payload_nbytes(record_nbytes, slice_sizes)
    else:
        steady = total + max(slice_sizes) + (k + 1) * record_nbytes
    return max(steady, 2 * total + k * record_nbytes) if anchor else steady


def choose_full_every(
    record_nbytes: int,
    group_nbytes: Sequence[int],
    capacity_nbytes_per_iter: float,
    max_k: int = 64,
    *,
    memory_budget_nbytes: float | None = None,
    anchor: bool = False,
    padded: bool = False,
) -> tuple[int, str]:
    """The smallest ``k`` whose per-iteration bytes fit the bubbles' capacity.

    For ``k = 1 .. min(max_k, len(group_nbytes))`` the groups are sliced with
    ``assign_slices`` and ``payload_nbytes`` is compared with ``capacity_nbytes_per_iter``
    (bytes the bubbles of one iteration can copy and protect). Smaller ``k`` wins: fewer
    steps to replay at recovery and fewer records to keep. A ``k`` whose
    ``retained_nbytes`` (with ``anchor`` and ``padded``) exceeds ``memory_budget_nbytes``
    (when given) is refused. When no
    ``k`` fits, returns the ``k`` with the fewest bytes per iteration (ties: smallest
    ``k``) and a reason saying what spills. Returns ``(k, reason)``.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    if capacity_nbytes_per_iter < 0 or record_nbytes < 0:
        raise ValueError("capacity and record bytes must be >= 0")
    groups = [TensorGroup(name=str(i), nbytes=int(n)) for i, n in enumerate(group_nbytes)]
    if not groups:
        return 1, "no tensors to protect: full_every=1"
    best: tuple[int, int] | None = None  # (bytes, k) of the cheapest k within memory
    refused: list[int] = []
    previous = ""  # why k - 1 did not do
    for k in range(1, min(max_k, len(groups)) + 1):
        sizes = slice_nbytes(groups, assign_slices(groups, k), k)
        need = payload_nbytes(record_nbytes, sizes)
        store = retained_nbytes(record_nbytes, sizes, anchor=anchor, padded=padded)
        if memory_budget_nbytes is not None and store > memory_budget_nbytes:
            refused.append(k)
            previous = f"k={k} keeps {_fmt(store)} in the store, over the memory budget"
            continue
        if need <= capacity_nbytes_per_iter:
            what = (
                "the whole state"
                if k == 1
                else f"record {_fmt(record_nbytes)} + largest slice {_fmt(max(sizes))}"
            )
            return k, (
                f"full_every={k}: {what} = {_fmt(need)} per iteration fits the "
                f"{_fmt(capacity_nbytes_per_iter)} the bubbles offer"
                + (f" ({previous})" if previous else "")
            )
        previous = f"k={k} needs {_fmt(need)}"
        if best is None or need < best[0]:
            best = (need, k)
    if best is None:
        return 1, (
            f"no full_every up to {min(max_k, len(groups))} keeps the store inside "
            f"{_fmt(memory_budget_nbytes or 0)}: full_every=1 (refused k={refused})"
        )
    need, k = best
    return k, (
        f"full_every={k}: nothing up to k={min(max_k, len(groups))} fits; {_fmt(need)} per "
        f"iteration (the least) against {_fmt(capacity_nbytes_per_iter)} of bubble capacity: "
        f"{_fmt(need - capacity_nbytes_per_iter)} spills past the bubbles"
        + (f"; k={refused} refused by the memory budget" if refused else "")
    )


def _fmt(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
