"""The stores' host-memory budget and the admission check (baft.engine.admission): pure
parts, with exact numbers."""

from __future__ import annotations

import pytest

from baft.engine.admission import (
    HostMemory,
    admit,
    derive_budget,
    read_mem_available,
    smallest_store_bytes,
)
from baft.store.coding import Redundancy
from baft.store.shm import MemoryBudgetError, SnapshotStore
from baft.topology import Topology

MiB = 1 << 20
GiB = 1 << 30


def test_mem_available_is_read_in_bytes() -> None:
    text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n"
    assert read_mem_available(text) == 20_000_000 * 1024
    assert read_mem_available("MemTotal: 1 kB\n") is None


def test_budget_is_the_lesser_limit_split_over_the_ranks_sharing_the_root() -> None:
    seen = [
        HostMemory("a", "/dev/shm", 20 * GiB, 24 * GiB),  # half of RAM (10 GiB) binds
        HostMemory("a", "/dev/shm", 20 * GiB, 24 * GiB),
        HostMemory("b", "/dev/shm", 20 * GiB, 64 * MiB),  # Docker's /dev/shm binds
        HostMemory("b", "/other", None, 6 * GiB),  # another root: not shared; no meminfo
    ]
    b0, why0 = derive_budget(seen, 0)
    assert b0 == 10 * GiB // 2
    assert why0 == "0.5 x MemAvailable 20,480.0 MiB / 2 rank(s) sharing it = 5,120.0 MiB per rank"
    assert derive_budget(seen, 2) == (
        64 * MiB,
        "64.0 MiB free under /dev/shm / 1 rank(s) sharing it = 64.0 MiB per rank",
    )
    assert derive_budget(seen, 3)[0] == 6 * GiB


def test_smallest_layout_splits_over_replicas_and_adds_redundancy() -> None:
    topo = Topology(num_pp=2, ranks_per_node=1)
    need = smallest_store_bytes([100 * MiB, 60 * MiB], [1, 1], topo, Redundancy.parse("xor:2"))
    # xor over two nodes: each holds a parity block as long as the longer shard
    assert need[0] == SnapshotStore.required_bytes(100 * MiB, 100 * MiB, 2)
    assert need[1] == SnapshotStore.required_bytes(60 * MiB, 100 * MiB, 2)
    dp2 = Topology(num_dp=2, ranks_per_node=1)
    halves = smallest_store_bytes([100 * MiB] * 2, [2, 2], dp2, Redundancy.parse("none"))
    assert halves == [SnapshotStore.required_bytes(50 * MiB, 0, 2)] * 2


def test_admit_refuses_with_the_numbers_and_the_knobs() -> None:
    admit([100, 200], 200, "why", Redundancy.parse("xor:2"))  # fits: nothing raised
    with pytest.raises(MemoryBudgetError) as err:
        admit([300 * MiB, 200 * MiB], 64 * MiB, "64.0 MiB free under /s", Redundancy.parse("xor:2"))
    msg = str(err.value)
    assert msg.startswith(
        "the snapshot stores cannot fit this host's memory: rank 0 needs at least "
        "314,572,800 B (300.0 MiB: 2 slots of its shard and its xor:2 redundancy, the "
        "smallest layout) but the store budget is 67,108,864 B (64.0 MiB free under /s)."
    )
    assert "--shm-size" in msg and "StoreConfig(budget_bytes=...)" in msg


def test_a_restarting_job_counts_its_own_stores_as_available(tmp_path) -> None:
    """A job that filled its budget must be able to restart: the stores it holds are
    reused, so they count as available (else the tmpfs looks full to its own restart)."""
    from baft.engine.admission import observe

    job = tmp_path / "root" / "job"
    (job / "node0" / "rank0").mkdir(parents=True)
    (job / "node0" / "rank0" / "data0").write_bytes(b"x" * 1_048_576)
    seen = observe("h", tmp_path / "root", job)
    assert seen.job_bytes >= 1_048_576
    budget, why = derive_budget([seen], 0)
    assert budget == min(seen.root_free + seen.job_bytes,
                         int((seen.mem_available or 0) * 0.5) + seen.job_bytes)  # fmt: skip
    assert "this job's stores hold" in why
    fresh = HostMemory("h", "/r", 8 * MiB, 4 * MiB)
    again = HostMemory("h", "/r", 8 * MiB, 4 * MiB, job_bytes=3 * MiB)
    assert derive_budget([fresh], 0)[0] == 4 * MiB
    assert derive_budget([again], 0)[0] == 7 * MiB
