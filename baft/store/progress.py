"""The progress page of a rank's store: its layout and its write/read protocol, once.

A store's ``progress`` file (:data:`baft.store.paths.PROGRESS_FILE`, one page) tells
same-host readers how far the rank's snapshot of the version it is writing has got. Its
first :data:`NBYTES` bytes are :data:`FIELDS`, native int64 (writer and readers share one
host's memory):

- ``version``: the version being written, -1 while none is (or while the fields change);
- ``slot``: the slot it is written into;
- ``covered``: how many of its shard bytes are final;
- ``changes``: a count of publishes (for observers; nobody waits on it).

The writer (:class:`~baft.store.shm.SnapshotStore`, :func:`publish`) never lets a reader
pair a version with another version's slot: a new version is published as ``version=-1``,
then slot and covered, then the version; a reader (:class:`~baft.store.peer.PeerStore`,
:func:`covered`) reads the version, the fields, and the version again (x86-TSO order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

FIELDS = ("version", "slot", "covered", "changes")
"""The page's int64 fields, in byte order."""
NBYTES = 8 * len(FIELDS)
"""Bytes of the page the fields take (the rest of the page is unused)."""
_VERSION, _SLOT, _COVERED, _CHANGES = range(len(FIELDS))


def fields(page: Any) -> np.ndarray:
    """The page's fields as an int64 array over ``page`` (an mmap, a bytearray or a uint8
    array of at least :data:`NBYTES` bytes); writable when ``page`` is."""
    return np.frombuffer(page, np.int64, count=len(FIELDS))


def clear(p: np.ndarray) -> None:
    """No version being written (a fresh or re-allocated store); ``changes`` kept."""
    p[_VERSION] = -1
    p[_SLOT] = -1
    p[_COVERED] = 0


def publish(p: np.ndarray, version: int, slot: int, covered: int) -> None:
    """The first ``covered`` shard bytes of ``version`` in ``slot`` are final. A reader
    that sees the version also sees its slot (see the module docstring)."""
    if p[_VERSION] != version:
        p[_VERSION] = -1
        p[_SLOT] = slot
        p[_COVERED] = covered
        p[_VERSION] = version
    else:
        p[_COVERED] = covered
    p[_CHANGES] += 1


def covered(p: np.ndarray, version: int, max_slots: int) -> tuple[int, int] | None:
    """``(slot, final shard bytes)`` of ``version`` as published, or None while the
    writer is not writing that version (or changed it while this read ran)."""
    if int(p[_VERSION]) != version:
        return None
    slot, done = int(p[_SLOT]), int(p[_COVERED])
    if int(p[_VERSION]) != version or slot not in range(max_slots):  # changed under us
        return None
    return slot, done


def unpack(p: np.ndarray) -> dict[str, int]:
    """Every field by name (inspection and tests)."""
    return {name: int(p[i]) for i, name in enumerate(FIELDS)}
