"""When a supervisor recovers in-process and when it gives up (pure, no I/O).

In-process recovery helps when one process failed and the rest of the job can go on
around its replacement. It cannot help, and the supervisor hands the failure to
torchrun's group restart (every process restarts, the restore runs as after any crash),
when:

- the same rank fails again in a generation that has not completed an iteration yet: a
  failure during a recovery (a replacement that crashes while restoring, a second fault
  before the first is repaired), where a clean start of every process is the safer bet;
- a rank failed more than ``max_failures`` times in this launch attempt (a rank that
  keeps failing: a bad host, a bug that fires on every attempt);
- a peer supervisor's lease ended or it went silent: its host is gone (node loss) or
  frozen, and no replacement process can join until torchrun's rendezvous brings in a
  new node; unless the job has elastic replicas and lost whole hosts, which it then
  shrinks off in-process (:class:`LostPeers`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from baft.config import dp_degree


@dataclass
class Ledger:
    """One rank's failures in this launch attempt, kept by its supervisor."""

    max_failures: int = 3
    failures: int = 0
    progressed: set[int] = field(default_factory=set)
    """Generations in which this rank completed an iteration."""

    def progress(self, generation: int) -> None:
        self.progressed.add(generation)

    def failure(self, generation: int) -> str | None:
        """Count a failure of this rank in ``generation``; why to give up, or None."""
        self.failures += 1
        if generation > 0 and generation not in self.progressed:
            return (
                f"failed in generation {generation} before its first iteration "
                "(a failure during a recovery)"
            )
        if self.failures > self.max_failures:
            return f"{self.failures} failures of this rank (limit {self.max_failures})"
        return None


def must_replace(rank: int, kill: set[int], spawned_in: int, generation: int) -> bool:
    """Whether ``rank``'s child must be killed and replaced: the supervisors named it in
    ``generation``'s kill list (a frozen rank) and it was spawned before that generation
    (never the replacement itself)."""
    return rank in kill and spawned_in < generation


def silent_peers(now: float, last_change: dict[int, float], limit_s: float) -> list[int]:
    """Peers whose supervisor heartbeat has not changed for more than ``limit_s``."""
    return sorted(r for r, at in last_change.items() if now - at > limit_s)


@dataclass
class Silence:
    """A peer supervisor (not rank 0) facing silent peers: rank 0 takes them for lost
    and shrinks the job or gives up, and that verdict reaches every supervisor through
    the control store. The peer gives up itself only when rank 0 is among the silent or
    the silence outlasts another ``limit_s`` with no verdict."""

    limit_s: float
    since: float | None = None

    def why_give_up(self, silent: Collection[int], now: float) -> str | None:
        if not silent:
            self.since = None
            return None
        why = f"the supervisors of ranks {sorted(silent)} are silent (host lost?)"
        if 0 in silent:
            return why
        self.since = now if self.since is None else self.since
        if now - self.since > self.limit_s:
            return f"{why}, and rank 0 decided nothing in {self.limit_s:g} s"
        return None


@dataclass(frozen=True, slots=True)
class Elastic:
    """What a training process said of its job's elastic replicas
    (:class:`baft.config.ElasticConfig`): the supervisors may shrink it in-process."""

    num_replicas: int
    model_ranks: int
    """Ranks per copy of the model (``pp * tp``): a world must hold whole copies."""


def partial_hosts(
    members: Sequence[int], host_of: Mapping[int, int], lost: Collection[int]
) -> list[int]:
    """The hosts of ``lost`` ranks that still have a live member."""
    gone_hosts = {host_of[r] for r in lost}
    return sorted({host_of[r] for r in members if r not in lost and host_of[r] in gone_hosts})


def shrunk_world(
    members: Sequence[int], host_of: Mapping[int, int], lost: Collection[int],
    elastic: Elastic | None,
) -> tuple[tuple[int, ...] | None, str]:  # fmt: skip
    """The ranks that go on without the ``lost`` ones (in rank order: a survivor's new
    rank is its index), or None and why the job cannot shrink in-process. ``host_of``
    maps each rank to its host (torchrun's ``GROUP_RANK``): only whole hosts are dropped
    (a host with a live rank left would keep a member outside the world), and the world
    left must hold whole copies of the model with a DP degree dividing the replicas."""
    if elastic is None:
        return None, "the job has no elastic replicas (CheckpointConfig.elastic)"
    partial = partial_hosts(members, host_of, lost)
    if partial:
        return None, f"host(s) {partial} lost only some of their ranks"
    world = tuple(r for r in members if r not in lost)
    if dp_degree(elastic.num_replicas, len(world), elastic.model_ranks) is None:
        return None, (
            f"{len(world)} ranks cannot hold a copy of every stage ({elastic.model_ranks} "
            f"ranks each) with a DP degree dividing {elastic.num_replicas} replicas"
        )
    return world, ""


def world_env(world: Sequence[int], host_of: Mapping[int, int], rank: int) -> dict[str, str]:
    """The torchrun variables of launch rank ``rank`` in the shrunk ``world`` (launch
    ranks in order), as torchrun would set them for a job on the hosts left: ranks and
    hosts renumbered in order, local ranks as they were."""
    hosts = sorted({host_of[r] for r in world})
    new_rank = world.index(rank)
    return {
        "RANK": str(new_rank), "ROLE_RANK": str(new_rank),
        "WORLD_SIZE": str(len(world)), "ROLE_WORLD_SIZE": str(len(world)),
        "GROUP_RANK": str(hosts.index(host_of[rank])), "GROUP_WORLD_SIZE": str(len(hosts)),
    }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Verdict:
    """What rank 0's supervisor does about peers whose supervisors died."""

    lost: tuple[int, ...]
    world: tuple[int, ...] | None
    """The launch ranks the job shrinks to, or None: give up (the group restart)."""
    why_not: str = ""
    hosts: tuple[int, ...] = ()
    """The lost hosts."""


@dataclass
class LostPeers:
    """Rank 0's record of peer supervisors whose lease ended (:mod:`.lease`): their
    process is gone with its host or torchrun agent. A host's supervisors die an instant
    apart, so a partly lost host is given ``grace_s`` for the rest of its leases to end
    before the verdict."""

    grace_s: float = 1.0
    elastic: Elastic | None = None
    """The job's elastic replicas, as rank 0's training process reported them."""
    gone: set[int] = field(default_factory=set)
    since: float | None = None

    def ended(self, ranks: Collection[int], now: float) -> None:
        if ranks:
            self.gone.update(ranks)
            self.since = now if self.since is None else self.since

    def verdict(
        self, members: Sequence[int], done: Collection[int], host_of: Mapping[int, int] | None,
        now: float,
    ) -> Verdict | None:  # fmt: skip
        """Shrink, give up, or None: nothing to do yet (no lost member, or a host partly
        lost within the grace). ``done``: peers that finished (their lease ends cleanly);
        ``host_of``: every rank's host, None when not all are known."""
        lost = tuple(sorted(r for r in self.gone if r in members and r not in done))
        if not lost:
            self.gone.clear()
            self.since = None
            return None
        waited = now - (self.since if self.since is not None else now)
        if host_of is None:
            world, why = None, "the ranks' hosts are not all known"
        else:
            if partial_hosts(members, host_of, lost) and waited < self.grace_s:
                return None
            world, why = shrunk_world(members, host_of, lost, self.elastic)
        self.gone.clear()
        self.since = None
        hosts = tuple(sorted({host_of[r] for r in lost})) if host_of is not None else ()
        return Verdict(lost, world, why, hosts)
