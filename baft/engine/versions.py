"""A rank's versions from written to committed to persisted.

:class:`Version` is the bookkeeping of the version being written (chunks done, checksums,
seconds per protect component). :class:`CommitVote` is the global agreement: after a
version's protect work each rank posts the newest version it completed (-1 if it could
not) in a tiny asynchronous MIN all-reduce on the transport; the answer is read at the
next version's start, while the rank computed in between, and the version is committed
only when every rank completed it. :class:`PersistSchedule` hands every
``persist_every``-th committed version to the DCP persister in the background and keeps
the store from overwriting a slot the persister still reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from baft.engine.transport import Transport, VoteHandle
from baft.store.disk import Persister, SaveHandle
from baft.store.shm import SnapshotStore

COMPONENTS = ("copy", "hash", "send", "pull", "recv_wait", "encode", "deadline_wait")
"""Where a version's protect time goes: ``copy`` (snapshot copies, hashing included where
the copier hashes on the way), ``hash`` (a separate checksum pass: CUDA only), ``send``
(network sends), ``pull`` (same-host redundancy copies from a peer's store), ``recv_wait``
(waiting for network receives and peers' progress), ``encode`` (parity), and
``deadline_wait`` (the training thread waiting for copies at the step deadline)."""


class Version:
    """Bookkeeping of the version being written."""

    def __init__(self, version: int, slot: int, data: torch.Tensor, red: torch.Tensor) -> None:
        self.version = version
        self.slot = slot
        self.data = data
        self.red = red
        self.done: set[int] = set()
        self.covered = 0
        self.checksums: dict[int, int] = {}
        self.in_bubble_s = 0.0
        self.exposed_s = 0.0
        self.snapshot_bytes = 0
        self.protected: set[int] = set()
        self.snapshot_event: threading.Event | None = None
        self.has_record = False
        """Differential: the payload carries the record of step ``version - 1``."""
        self.seconds: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
        """Seconds per protect component (see COMPONENTS), summed over threads."""


class CommitVote:
    """The global commit of versions, one vote in flight at a time."""

    def __init__(self, transport: Transport, store: SnapshotStore) -> None:
        self.transport = transport
        self.store = store
        self.committed: int | None = None
        """Newest version every rank completed (and this store recorded as committed)."""
        self.num_committed = 0
        """Versions committed since this process started."""
        self._pending: tuple[int, VoteHandle] | None = None
        self.stop_agreed = False
        """Some rank voted to stop (SIGTERM): every rank learns it from the same vote."""

    def post(self, version: int, complete: bool, stopping: bool = False) -> None:
        """Start the agreement on ``version``; a rank that could not complete it votes -1,
        a rank asked to stop (SIGTERM) says so in the same all-reduce."""
        assert self._pending is None, "one commit vote at a time"
        vote = [version if complete else -1, 0 if stopping else 1]
        self._pending = (version, self.transport.all_min_async(vote))

    def resolve(self) -> int | None:
        """Wait for the vote in flight, if any; returns the version it committed, or None."""
        if self._pending is None:
            return None
        version, handle = self._pending
        self._pending = None
        agreed, keep_going = handle.wait()
        self.stop_agreed = self.stop_agreed or keep_going == 0
        if agreed != version:
            return None
        self.store.commit(version)
        self.committed = version
        self.num_committed += 1
        return version

    def adopt(self, version: int | None) -> None:
        """A restore brought back ``version``: it counts as committed."""
        self.committed = version


class PersistSchedule:
    """Every ``persist_every``-th committed version goes to DCP in the background."""

    def __init__(self, persister: Persister | None, persist_every: int) -> None:
        self.persister = persister
        self.persist_every = persist_every
        self._inflight: tuple[int, SaveHandle] | None = None

    def due(self, num_committed: int) -> bool:
        return (
            self.persister is not None
            and self.persist_every > 0
            and num_committed % self.persist_every == 0
        )

    def start(
        self, version: int, state: Callable[[], dict[str, torch.Tensor]], meta: dict[str, Any]
    ) -> None:
        """Persist ``version`` (``state()`` gives its tensors) after any save in flight."""
        assert self.persister is not None
        self.join()
        self._inflight = (version, self.persister.save_async(version, state(), meta))

    def join(self) -> None:
        """Wait for the DCP save in flight, if any."""
        if self._inflight is not None:
            self._inflight[1].wait()
            self._inflight = None

    def reading_other_than(self, committed: int | None) -> bool:
        """A save is still reading a slot that is not the committed one (the slot about
        to be overwritten)."""
        return self._inflight is not None and self._inflight[0] != committed

    def shutdown(self) -> None:
        self.join()
        if self.persister is not None:
            self.persister.shutdown()
