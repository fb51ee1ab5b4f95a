"""The progress page (pure layout and protocol) and its round trip from a store to a
same-host reader through the file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from baft.store import progress
from baft.store.paths import PROGRESS_FILE
from baft.store.peer import PeerStore
from baft.store.shm import MAX_SLOTS, SnapshotStore


def test_layout_is_four_native_int64_in_field_order() -> None:
    page = bytearray(4096)
    p = progress.fields(page)
    progress.clear(p)
    progress.publish(p, 7, 1, 100)
    assert progress.NBYTES == 32
    assert struct.unpack_from("=4q", page) == (7, 1, 100, 1)
    assert progress.unpack(p) == {"version": 7, "slot": 1, "covered": 100, "changes": 1}
    assert bytes(page[progress.NBYTES :]) == bytes(4096 - progress.NBYTES)


def test_publish_then_covered_round_trip() -> None:
    page = bytearray(64)
    writer = progress.fields(page)
    reader = progress.fields(bytes(page))  # a read-only view sees the same layout
    assert not reader.flags.writeable
    progress.clear(writer)
    assert progress.covered(progress.fields(page), 3, MAX_SLOTS) is None
    progress.publish(writer, 3, 1, 10)
    progress.publish(writer, 3, 1, 25)  # same version: only covered moves
    assert progress.covered(progress.fields(bytes(page)), 3, MAX_SLOTS) == (1, 25)
    assert progress.covered(writer, 2, MAX_SLOTS) is None  # another version
    progress.publish(writer, 4, 0, 5)
    assert progress.covered(writer, 4, MAX_SLOTS) == (0, 5)
    assert progress.unpack(writer)["changes"] == 3
    progress.clear(writer)
    assert progress.unpack(writer) == {"version": -1, "slot": -1, "covered": 0, "changes": 3}


def test_a_slot_out_of_range_reads_as_nothing() -> None:
    p = progress.fields(bytearray(progress.NBYTES))
    progress.publish(p, 5, 3, 8)
    assert progress.covered(p, 5, max_slots=3) is None
    assert progress.covered(p, 5, max_slots=4) == (3, 8)


def test_store_publishes_what_a_peer_reads(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, "job", 0, 1, 1 << 20)
    store.allocate(4096, 0)
    peer = PeerStore(store.path, 1)
    try:
        assert peer.covered(9) is None
        store.publish(9, 1, 2048)
        assert peer.covered(9) == (1, 2048)
        store.publish(9, 1, 4096)
        assert peer.covered(9) == (1, 4096)
        raw = (store.path / PROGRESS_FILE).read_bytes()
        assert struct.unpack_from("=4q", raw) == (9, 1, 4096, 2)
        assert np.frombuffer(raw, np.int64, count=4).tolist() == [9, 1, 4096, 2]
    finally:
        peer.close()
        store.close()
