"""The stores' host-memory budget, and the admission check before the first step.

A store lives in a tmpfs (``/dev/shm``) that takes its pages from the host's RAM, next to
the training processes, their data loaders and pinned buffers. Docker's default
``/dev/shm`` is 64 MB, and the neighbours' users report exactly this failure: a store
that does not fit shows up as SIGBUS or an out-of-memory kill iterations later (DLRover
#941, #1046). So a budget is derived from the host before anything is allocated, and a
job whose smallest layout cannot fit it is refused before step 1, with the numbers.

The default budget of a rank (``StoreConfig.budget_bytes=None``) is the lesser of half of
the host's ``MemAvailable`` and the free space of the filesystem under the store root,
divided among the ranks whose stores share that filesystem on this host; every rank then
uses the smallest budget of the job, so the planner chooses the same ``full_every``
everywhere (:func:`baft.engine.planning.auto_k` steps it down under the budget).

The smallest layout is ``full_every=1``: two slots of the rank's shard and its
redundancy. The rank's state layout is fixed before the first step (the optimizer's
state is created up front, or held for it, see :mod:`baft.pipeline.optim_state`), so the
shard is exact; the plan's allocation checks its own layout again
(:meth:`baft.store.shm.SnapshotStore.allocate`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from baft.store.coding import Redundancy, group_layouts
from baft.store.shm import MemoryBudgetError, SnapshotStore
from baft.topology import Topology

MEM_FRACTION = 0.5
"""Share of the host's MemAvailable the stores of all its ranks may take by default (the
rest stays for the training processes, data loaders and the page cache)."""


@dataclass(frozen=True, slots=True)
class HostMemory:
    """What one rank sees of its host (gathered from every rank)."""

    host: str
    root: str
    mem_available: int | None
    root_free: int
    job_bytes: int = 0
    """What this job's stores already hold under ``root`` (a restart reuses them: they
    count as available, or a job that filled its budget could never restart)."""


def read_mem_available(meminfo: str | None = None) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where the kernel has none)."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def observe(host: str, root: Path, job_dir: Path | None = None) -> HostMemory:
    """This rank's view of its host: MemAvailable, the free bytes under ``root`` (created
    if missing, as the store will be) and what the job's stores there hold already."""
    root.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(root)
    held = 0
    if job_dir is not None:
        for dirpath, _, files in os.walk(job_dir):  # errors (a directory removed meanwhile
            for name in files:  # by a peer's reclaim) skip it, as os.walk does
                try:
                    held += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    continue
    return HostMemory(
        host, os.path.realpath(root), read_mem_available(), st.f_bavail * st.f_frsize, held
    )


def derive_budget(seen: Sequence[HostMemory], rank: int) -> tuple[int, str]:
    """The default budget of ``rank``'s store (pure): its share of the lesser of
    :data:`MEM_FRACTION` of MemAvailable and the free space under its store root, split
    over the ranks whose stores share that root on that host. Returns (bytes, reason)."""
    me = seen[rank]
    sharing = sum(1 for s in seen if (s.host, s.root) == (me.host, me.root))
    held = me.job_bytes  # the job's own stores: reused, so available to it
    also = f" + {_mib(held)} this job's stores hold" if held else ""
    limits = [(me.root_free + held, f"{_mib(me.root_free)} free under {me.root}{also}")]
    if me.mem_available is not None:
        half = int(me.mem_available * MEM_FRACTION) + held
        limits.append((half, f"{MEM_FRACTION:g} x MemAvailable {_mib(me.mem_available)}{also}"))
    total, why = min(limits)
    budget = total // sharing
    return budget, f"{why} / {sharing} rank(s) sharing it = {_mib(budget)} per rank"


def smallest_store_bytes(
    state_nbytes: Sequence[int], replicas: Sequence[int], topology: Topology, red: Redundancy
) -> list[int]:
    """Per rank, the store of the smallest layout (``full_every=1``, two slots): its shard
    (its state split evenly over the ``replicas`` that hold the same bytes) and its
    redundancy under ``red`` (pure)."""
    shards = {r: -(-n // max(1, replicas[r])) for r, n in enumerate(state_nbytes)}
    layouts = group_layouts(topology, red, shards)
    return [
        SnapshotStore.required_bytes(shards[r], layouts[r].redundancy_nbytes(r), 2)
        for r in range(len(state_nbytes))
    ]


def admit(needed: Sequence[int], budget: int, reason: str, red: Redundancy) -> None:
    """Refuse the job (every rank raises the same error) when some rank's smallest store
    exceeds the agreed ``budget``: the numbers and the knobs that lower them."""
    worst = max(range(len(needed)), key=lambda r: needed[r])
    if needed[worst] <= budget:
        return
    raise MemoryBudgetError(
        f"the snapshot stores cannot fit this host's memory: rank {worst} needs at least "
        f"{needed[worst]:,} B ({_mib(needed[worst])}: 2 slots of its shard and its {red} "
        f"redundancy, the smallest layout) but the store budget is {budget:,} B "
        f"({reason}). To fit: give the store root more space (Docker: --shm-size; "
        "StoreConfig(root=...) on a larger tmpfs), add DP replicas so shards shrink, pick a "
        "lighter redundancy (xor:G over more nodes, or none), or set "
        "StoreConfig(budget_bytes=...) if more memory may be used"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
