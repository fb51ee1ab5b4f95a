"""The store's two memory checks, with their exact messages: the configured budget, and
the free space of the filesystem under the store root (a full tmpfs)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from baft.store import shm
from baft.store.shm import MemoryBudgetError, SnapshotStore

MiB = 1 << 20


def test_budget_too_small_names_the_need_and_the_fixes(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "job", 0, 3, budget_bytes=MiB)
    needed = SnapshotStore.required_bytes(MiB, MiB // 2)
    with pytest.raises(MemoryBudgetError) as err:
        store.allocate(MiB, MiB // 2)
    assert str(err.value) == (
        f"rank 3 store needs {needed:,} B (2 slots x (shard 1,048,576 B + redundancy "
        "524,288 B) + manifests) but budget_bytes is 1,048,576 B; raise the host-memory "
        "budget, pick a lighter redundancy policy, or add DP replicas so shards shrink"
    )
    assert not store.path.exists()  # nothing was created


def test_full_filesystem_under_the_store_root_fails_before_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tmpfs with 4 KiB left (statvfs reports it; mounting a real one needs privileges)."""
    real = os.statvfs

    def nearly_full(path: os.PathLike[str] | str) -> object:
        st = real(path)
        return SimpleNamespace(f_bavail=1, f_frsize=4096, f_bsize=st.f_bsize)

    monkeypatch.setattr(shm.os, "statvfs", nearly_full)
    store = SnapshotStore(tmp_path, "job", 0, 1, budget_bytes=64 * MiB)
    needed = SnapshotStore.required_bytes(MiB, 0)  # nothing reusable in a fresh store
    with pytest.raises(MemoryBudgetError) as err:
        store.allocate(MiB, 0)
    assert str(err.value) == (
        f"rank 1 store needs {needed:,} B more but only 4,096 B are free under {tmp_path}; "
        f"free memory there (`baft inspect --root {tmp_path}` lists the job stores, "
        f"`baft inspect --free [--idle-s S] --root {tmp_path}` frees those no live job holds) "
        "or lower the snapshot size"
    )
    assert not any(store.path.glob("slot*.data"))  # no file was sized or mapped
