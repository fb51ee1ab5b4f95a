"""The watchdog's decision, pure: is something hung, and who is suspected.

Every time is a monotonic second passed in; :class:`~baft.liveness.watchdog.Watchdog`'s
monitor thread calls :func:`decide` with what its beat thread saw (see the timeout
hierarchy in :mod:`baft.liveness.watchdog`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SECTION_FACTORS = {"iteration": 2.0, "restore": 10.0, "close": 10.0}
"""Own-section limit as a multiple of the timeout, by section kind (the name's first word)."""
MAX_WATCH_ALL = 64
"""Up to this world size every rank watches every peer; above, its 4 ring neighbours."""


def beat_period(timeout_s: float) -> float:
    """Seconds between heartbeats for a job timeout of ``timeout_s``."""
    return min(1.0, timeout_s / 10.0)


def watched_peers(rank: int, world_size: int) -> list[int]:
    """The peers ``rank`` watches: all of them in small jobs, else ring neighbours
    (consecutive ranks usually share a host, so a watcher can kill a frozen neighbour)."""
    if world_size <= MAX_WATCH_ALL:
        return [r for r in range(world_size) if r != rank]
    near = {(rank + d) % world_size for d in (-2, -1, 1, 2)}
    return sorted(near - {rank})


@dataclass(frozen=True, slots=True)
class PeerView:
    """What the beat thread last saw of one watched peer (monotonic local clock)."""

    rank: int
    last_change: float
    """When its heartbeat last changed (or watching started, if never seen)."""
    section: str = ""
    """Its section at its last heartbeat."""
    done: bool = False
    """It left training cleanly (never a hang)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """A hang: who is suspected and why."""

    kind: str
    """``peer`` (a peer stopped beating), ``store`` (the store stopped answering) or
    ``self`` (this rank's own section ran past its limit)."""
    rank: int | None
    """The suspect rank (None when unknown)."""
    section: str
    """The suspect's last known section."""
    silent_s: float
    """How long the suspect has been silent (or this section has run)."""


def decide(
    now: float,
    peers: Sequence[PeerView],
    *,
    store_ok_at: float,
    store_rank: int | None,
    section: str | None,
    section_since: float,
    section_limit_s: float,
    timeout_s: float,
) -> tuple[Verdict | None, str]:
    """Is something hung? Pure: every time is a monotonic second passed in.

    The store comes first: when it stops answering, every peer looks silent too, and
    the suspect is the rank hosting it (``store_rank``), not the first peer in the list.
    """
    store_silent = now - store_ok_at
    if store_silent > timeout_s:
        who = f"rank {store_rank}" if store_rank is not None else "its host"
        return Verdict("store", store_rank, "", store_silent), (
            f"the rendezvous store (hosted by {who}) has not answered for "
            f"{store_silent:.1f} s (timeout {timeout_s:g} s)"
        )
    live = [p for p in peers if not p.done]
    if live:
        worst = min(live, key=lambda p: p.last_change)
        silent = now - worst.last_change
        if silent > timeout_s:
            where = f" in section '{worst.section}'" if worst.section else ""
            return Verdict("peer", worst.rank, worst.section, silent), (
                f"rank {worst.rank} has not sent a heartbeat for {silent:.1f} s{where} "
                f"(timeout {timeout_s:g} s): it is frozen or gone"
            )
    if section is not None:
        ran = now - section_since
        if ran > section_limit_s:
            return Verdict("self", None, section, ran), (
                f"this rank has been in section '{section}' for {ran:.1f} s "
                f"(limit {section_limit_s:g} s = {section_limit_s / timeout_s:g} x timeout)"
            )
    return None, "ok"


def section_limit(name: str, timeout_s: float) -> float:
    """Seconds a section called ``name`` may run (see :data:`SECTION_FACTORS`)."""
    return SECTION_FACTORS.get(name.split(" ", 1)[0], 2.0) * timeout_s
