"""A restore from memory into another DP degree: an elastic job that shrank or grew (pure).

With elastic replicas (``CheckpointConfig.elastic``) a stage's flat state has one layout
whatever the number of ranks computing its replicas (each replica's records are named by
its virtual index), so the shards a job of ``dp`` ranks per stage wrote can be put back
together by a job of ``dp'``. :func:`plan_resize` sees which DP degree holds the newest
version in memory; when it is not the job's own, it returns a :class:`Resize`: the
recovery coordinator then plans as if the old job were running (its topology, its
redundancy: *logical* ranks), with each logical rank played by a current rank
(:attr:`Resize.to_physical`) on that rank's host. Every shard is rebuilt exactly as a
restart of the old job would rebuild it (its own store on the host, another host's
memory, a replica, parity), by the current rank playing it, and each current rank then
assembles its stage's flat state from the logical shards of its ``(pp, tp)``
(:func:`baft.recover.transfer.assemble_resized`).

Logical rank ``(pp, d, tp)`` of a job with ``dp`` ranks per stage computed replicas
``d*k .. d*k+k-1`` (``k = R / dp``); it is played by the current rank that computes the
first of them: ``(pp, d*k // k', tp)``. After a grow some current ranks play none: they
receive their stage's state from those that do.

No processes, threads or I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baft.recover.plans import LocatedInventory, TopologyMismatchError
from baft.store.policy import Redundancy
from baft.topology import Topology

__all__ = ["Resize", "plan_resize"]


@dataclass(frozen=True)
class Resize:
    """The old job's topology and redundancy, and which current rank plays each of its
    ranks."""

    old: Topology
    redundancy: Redundancy
    to_physical: Mapping[int, int]
    """Logical (old) rank -> the current rank playing it."""
    hosts: Mapping[int, str]
    """Logical rank -> the host of the current rank playing it."""
    new: Topology
    """The job's topology now."""
    num_replicas: int
    """The job's elastic replicas."""
    physical_hosts: Mapping[int, str]
    """Current rank -> its host."""

    def played_by(self, rank: int) -> list[int]:
        """The logical ranks current rank ``rank`` plays, ascending."""
        return sorted(lg for lg, p in self.to_physical.items() if p == rank)

    def stage_shards(self, new: Topology, rank: int) -> list[int]:
        """The logical ranks whose shards make current rank ``rank``'s flat state, in the
        order the old job laid them out (dp order)."""
        c = new.coords(rank)
        return [self.old.rank_of(c.pp, d, c.tp) for d in range(self.old.num_dp)]

    def describe(self, new: Topology) -> str:
        return (
            f"shards of dp={self.old.num_dp} (pp={self.old.num_pp}, tp={self.old.num_tp}, "
            f"{self.redundancy}) rebuilt for dp={new.num_dp}"
        )


def _degree(loc: LocatedInventory) -> tuple[tuple[int, int, int], int] | None:
    """A store's (pp, dp, tp) and newest version, from its newest manifest."""
    ms = [v.manifest for v in loc.inventory.versions if v.manifest is not None]
    if not ms:
        return None
    m = max(ms, key=lambda m: m.version)
    return (m.num_pp, m.num_dp, m.num_tp), m.version


def plan_resize(
    new: Topology,
    num_replicas: int,
    stores: Sequence[LocatedInventory],
    hosts: Mapping[int, str],
) -> tuple[Resize | None, list[LocatedInventory], str]:
    """Which stores to restore from, and how: ``(resize, kept, note)``.

    Stores of the job's pipeline and tensor sizes are grouped by the DP degree they were
    written under; the group holding the newest version wins (``note`` says what was set
    aside). ``resize`` is None when that is the job's own degree (or there is nothing to
    choose), else the mapping for a restore into this degree. Stores of other pipeline
    or tensor sizes are kept: the coordinator refuses them as another topology."""
    by_degree: dict[int, list[LocatedInventory]] = {}
    newest: dict[int, int] = {}
    kept: list[LocatedInventory] = []
    for loc in stores:
        seen = _degree(loc)
        if seen is None or (seen[0][0], seen[0][2]) != (new.num_pp, new.num_tp):
            kept.append(loc)
            continue
        dp = seen[0][1]
        by_degree.setdefault(dp, []).append(loc)
        newest[dp] = max(newest.get(dp, -1), seen[1])
    if not by_degree:
        return None, kept, ""
    chosen = max(by_degree, key=lambda d: (newest[d], d == new.num_dp))
    aside = sorted(d for d in by_degree if d != chosen)
    note = ""
    if aside:
        note = (
            f"stores of dp={'/'.join(map(str, aside))} set aside: dp={chosen} holds the "
            f"newest version v{newest[chosen]}"
        )
    kept += by_degree[chosen]
    if chosen == new.num_dp:
        return None, kept, note
    if num_replicas % chosen or num_replicas % new.num_dp:
        raise TopologyMismatchError(
            f"the stores hold shards of dp={chosen} ranks per stage, this job runs "
            f"dp={new.num_dp}: both must divide the elastic replicas ({num_replicas})"
        )
    m = next(
        v.manifest
        for loc in by_degree[chosen]
        for v in loc.inventory.versions
        if v.manifest is not None and v.manifest.num_dp == chosen
    )
    old = m.topology()
    k_old, k_new = num_replicas // old.num_dp, num_replicas // new.num_dp
    to_physical = {}
    for lg in range(old.world_size):
        c = old.coords(lg)
        to_physical[lg] = new.rank_of(c.pp, c.dp * k_old // k_new, c.tp)
    resize = Resize(
        old=old,
        redundancy=Redundancy.parse(m.redundancy),
        to_physical=to_physical,
        hosts={lg: hosts[p] for lg, p in to_physical.items()},
        new=new,
        num_replicas=num_replicas,
        physical_hosts=dict(hosts),
    )
    return resize, kept, note
