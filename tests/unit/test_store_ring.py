"""A store with a ring of slots (differential checkpoints keep a rotation's window):
``begin`` never overwrites a kept version, a re-opened store finds every slot, and a
shorter ring removes the slots it no longer has."""

from __future__ import annotations

from pathlib import Path

from baft.store.shm import SnapshotStore
from tests.unit.test_store import _manifest


def _write(store: SnapshotStore, version: int, keep: tuple[int, ...]) -> int:
    slot = store.begin(version, keep=keep)
    store.data_view(slot)[:] = version
    store.complete(slot, _manifest(store, slot, version))
    store.commit(version)
    return slot


def test_ring_keeps_the_window_and_reopens(tmp_path: Path) -> None:
    k = 3  # window of 3 versions + the one in flight
    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 22)
    store.allocate(4096, 0, num_slots=k + 1)
    slots = {}
    for v in range(10):
        window = tuple(range(max(0, v - k), v))  # what rebuilding v - 1 needs
        slots[v] = _write(store, v, window)
        assert slots[v] not in {slots[u] for u in window}
    inv = store.inventory(verify=True)
    assert [x.version for x in inv.versions] == [9, 8, 7, 6]
    assert all(x.usable for x in inv.versions)
    store.close()
    again = SnapshotStore(tmp_path, "job", 0, 0, 1 << 22)
    assert again.num_slots == k + 1  # found on disk, before any allocate
    assert sorted(x.version for x in again.inventory(verify=True).versions) == [6, 7, 8, 9]
    assert int(again.read(slots[7], "data")[0]) == 7
    again.allocate(4096, 0)  # back to two slots: the others are gone
    assert again.num_slots == 2
    assert sorted(p.name for p in again.path.glob("slot*.data")) == ["slot0.data", "slot1.data"]
    assert SnapshotStore.required_bytes(4096, 0, 4) > SnapshotStore.required_bytes(4096, 0, 2)
