"""The store's read path: range reads of data and redundancy from its own mapping cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from baft.store.shm import SnapshotStore, StoreReadError


def _filled(root: Path) -> SnapshotStore:
    store = SnapshotStore(root, "job", 0, 3, 1 << 20)
    store.allocate(10_000, 3000)
    store.data_view(1)[:] = np.arange(10_000) % 251
    store.red_view(1)[:] = np.arange(3000) % 7
    store.close()
    return store


def test_read_returns_the_range_zero_copy_from_one_mapping(tmp_path: Path) -> None:
    store = _filled(tmp_path)
    a = store.read(1, "data", 100, 50)
    assert a.tolist() == [i % 251 for i in range(100, 150)]
    assert store.read(1, "red", 2990).tolist() == [i % 7 for i in range(2990, 3000)]
    b = store.read(1, "data", 0, 10_000)
    assert np.shares_memory(a, b)  # the second read reuses the first mapping
    assert a.flags.writeable  # torch.from_numpy takes it without a warning


def test_writes_to_a_read_view_never_reach_the_store(tmp_path: Path) -> None:
    store = _filled(tmp_path)
    view = store.read(1, "data", 0, 10)
    view[:] = 0  # private (copy-on-write) mapping
    store.drop_read_cache()
    assert store.read(1, "data", 0, 10).tolist() == list(range(10))


def test_short_or_absent_file_is_a_store_read_error(tmp_path: Path) -> None:
    store = _filled(tmp_path)
    with pytest.raises(
        StoreReadError, match=r"slot 1 data file has 10000 B, read needs \[9990, 10010\)"
    ):
        store.read(1, "data", 9990, 20)
    empty = SnapshotStore(tmp_path, "job", 0, 4, 0)
    with pytest.raises(StoreReadError, match="file absent"):
        empty.read(0, "red", 0, 1)
    with pytest.raises(ValueError, match="kind data or red"):
        store.read(0, "json")


def test_a_recreated_file_is_mapped_again(tmp_path: Path) -> None:
    store = _filled(tmp_path)
    assert store.read(1, "data", 0, 4).tolist() == [0, 1, 2, 3]
    store.allocate(20_000, 3000)  # re-plan: new size, old contents gone
    store.data_view(1)[:4] = 9
    assert store.read(1, "data").size == 20_000
    assert store.read(1, "data", 0, 4).tolist() == [9, 9, 9, 9]
    store.close()


def test_flip_byte_changes_the_file_and_is_seen_by_readers(tmp_path: Path) -> None:
    store = _filled(tmp_path)
    assert store.read(1, "red", 5, 1).tolist() == [5]
    assert store.flip_byte(1, "red", 5)
    assert store.read(1, "red", 5, 1).tolist() == [5 ^ 0xFF]
    assert not store.flip_byte(1, "red", 3000)  # past the end
    assert not SnapshotStore(tmp_path, "job", 0, 9, 0).flip_byte(0, "data", 0)
