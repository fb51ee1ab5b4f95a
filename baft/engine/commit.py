"""The commit: the only owner of "committed", in memory and in the store's commit record.

After a version's protect work each rank posts the newest version it completed (-1 if
it could not) in a tiny asynchronous MIN all-reduce on the transport; the answer is read
when the next version opens, while the rank computed in between, and the version is
committed only when every rank completed it: then, and only then, the store's commit
record names it. The same vote carries a SIGTERM stop, so every rank learns it at the
same version, and whether every rank can persist the version to DCP without waiting for
its previous save (:attr:`Commit.persist_agreed`). Once a restore from memory is a whole
window behind, the stores that an earlier rank numbering left on this host are freed
(their last use was the restore).
"""

from __future__ import annotations

import logging
from pathlib import Path

from baft.engine.transport import Transport, VoteHandle
from baft.store import reclaim
from baft.store.shm import SnapshotStore
from baft.topology import Topology

log = logging.getLogger("baft")


class Commit:
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
        self.persist_agreed = False
        """Every rank could persist the version the last resolved vote committed."""
        self._reclaim_after: int | None = None

    def post(
        self, version: int, complete: bool, stopping: bool = False, persist: bool = False
    ) -> None:
        """Start the agreement on ``version``; a rank that could not complete it votes -1,
        a rank asked to stop (SIGTERM) says so in the same all-reduce, and ``persist``:
        this rank can write the version to DCP at its commit without waiting."""
        assert self._pending is None, "one commit vote at a time"
        vote = [version if complete else -1, 0 if stopping else 1, int(persist)]
        self._pending = (version, self.transport.all_min_async(vote))

    def resolve(self) -> int | None:
        """Wait for the vote in flight, if any; returns the version it committed, or None."""
        if self._pending is None:
            return None
        version, handle = self._pending
        self._pending = None
        agreed, keep_going, persist = handle.wait()
        self.stop_agreed = self.stop_agreed or keep_going == 0
        self.persist_agreed = persist == 1
        if agreed != version:
            return None
        self.store.commit(version)
        self.committed = version
        self.num_committed += 1
        return version

    def adopt(self, version: int | None) -> None:
        """``version`` counts as committed (a restore brought it back), or nothing does
        (the store forgot its versions)."""
        self.committed = version

    def restored(self, version: int | None) -> None:
        """A restore from memory brought back ``version``: it is committed, and copies of
        an earlier rank numbering are freed once the own stores are a window newer."""
        self._reclaim_after = version
        if version is not None:
            self.adopt(version)

    def reclaim_foreign(
        self, version: int, k: int, *, rank: int, peers: set[int], topology: Topology, job_id: str
    ) -> None:
        """Once the own stores committed a whole window (``k``) after a restore from
        memory, free this job's store directories that no current rank writes: the
        restore was their last use. The lowest rank of this host does it; every current
        rank's directory is spared, wherever it lives."""
        if self._reclaim_after is None or version < self._reclaim_after + k:
            return
        self._reclaim_after = None
        if rank != min({rank, *peers}):
            return
        own = {(topology.node_of(r), r) for r in range(topology.world_size)}
        freed = reclaim.reclaim_foreign(Path(self.store.root), job_id, own, version)
        if freed:
            log.info("freed %d store(s) of an earlier rank numbering: %s", len(freed), freed)
