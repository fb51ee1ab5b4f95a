"""Which supervisors are in the job, and how a supervisor sees that a peer is gone.

- **Heartbeats** (every supervisor): each beats in the control store twice a second and
  watches its peers' beats; a peer silent for ``peer_silence_s`` is taken for lost (a
  frozen host, a cut network: what closes no connection). Rank 0 counts it lost as an
  ended lease (below); the other supervisors wait for rank 0's verdict.
- **Leases** (:mod:`.lease`): every peer holds a connection to rank 0's supervisor for
  its life, so rank 0 reads at once that a peer's process died with its host or its
  torchrun agent. A peer that finished says so first.
- **A lost host** (rank 0, :class:`~.policy.LostPeers`; killed or frozen): an elastic job
  (:class:`baft.config.ElasticConfig`) that lost whole hosts *shrinks in-process*: the
  next generation runs on the hosts left, the survivors keep their processes and
  re-enter with their ranks renumbered as torchrun would number them
  (:func:`~.policy.world_env`), restore from memory and compute the lost hosts'
  replicas. Otherwise (no elastic replicas, a stage's only copy lost, part of a host)
  in-process recovery gives up and torchrun's group restart takes over. A host that
  joins later grows the job back: torchrun restarts the group on a membership change.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from baft.config import InprocessTimeouts
from baft.inprocess.control import Control
from baft.inprocess.lease import LeaseServer, hold_lease, serve_leases
from baft.inprocess.policy import LostPeers, Silence, Verdict, silent_peers, world_env

log = logging.getLogger("baft")


class NotInWorld(Exception):
    """The job shrank in-process without this rank (its host was taken for lost)."""


class Membership:
    """One supervisor's view of the job's members (see the module docstring)."""

    def __init__(self, control: Control, grace_s: float, timeouts: InprocessTimeouts) -> None:
        self.control = control
        self.rank = control.rank
        self.timeouts = timeouts
        control.publish_host(int(os.environ.get("GROUP_RANK", "0")))
        self.lease: LeaseServer | None = None
        """Rank 0: every peer supervisor's lease (a death seen at once, not after silence)."""
        self._lease_held: socket.socket | None = None
        """A peer: its end of the lease, open for the supervisor's life."""
        if control.world_size > 1 and self.rank == 0:
            self.lease = serve_leases()
            control.publish_lease(self.lease.port if self.lease is not None else 0)
        elif control.world_size > 1:
            port = control.lease_port()
            self._lease_held = hold_lease(control.host, port, self.rank)
        self.lost = LostPeers(grace_s)
        """Rank 0: peer supervisors whose lease ended, and the job's elastic replicas."""
        self._beat = 0
        self._beat_at = 0.0
        self._peer_seen: dict[int, tuple[bytes, float]] = {}
        """Peer supervisors' last heartbeat value and when it changed (monotonic)."""
        self._done: set[int] = set()
        self._silent: list[int] = []
        """The last heartbeat check's silent peers (between checks, the answer stands)."""
        self._silence = Silence(timeouts.peer_silence_s)
        self._fed: set[int] = set()
        """Rank 0: the silent peers already counted lost (until they beat again)."""

    def waitables(self) -> list[Any]:
        """What the supervisor's wait wakes on for leases (rank 0)."""
        return self.lease.waitables() if self.lease is not None else []

    def launch_ranks(self, ranks: Sequence[int]) -> list[int]:
        """The launch ranks of the current generation's ``ranks`` (they differ once the
        job shrank: a survivor's rank is its index among the members)."""
        members = self.control.members
        return [members[r] for r in ranks if 0 <= r < len(members)]

    # ------------------------------------------------------------------ the world
    def world_env(self, g: int) -> tuple[tuple[str, str], ...]:
        """Generation ``g``'s torchrun variables for this rank's child when the job shrank
        in-process (empty: as launched); follows the shrink (members, peers watched).
        Raises :class:`NotInWorld` when the job shrank without this rank."""
        host_of = self.control.world(g)
        if host_of is None:
            return ()
        world = tuple(sorted(host_of))
        if self.rank not in host_of:
            raise NotInWorld(f"the job shrank in generation {g} to ranks {list(world)}")
        if world != self.control.members:
            self.control.members = world
            self._peer_seen = {r: v for r, v in self._peer_seen.items() if r in host_of}
        return tuple(world_env(world, host_of, self.rank).items())

    # ------------------------------------------------------------------ leases (rank 0)
    def check_leases(self, idle: bool) -> None:
        """Rank 0: peer supervisors whose lease ended without finishing are gone with
        their host (or torchrun agent), and in-process recovery cannot replace them: an
        elastic job that lost whole hosts shrinks onto the hosts left at once
        (:meth:`_shrink`); otherwise give up now (the group restart, which waits for a
        replacement or shrinks under torchrun's elastic range) instead of after
        ``peer_silence_s`` of silence. ``idle``: the child is past the job's end or
        being stopped (nothing to recover)."""
        now = time.monotonic()
        self.lost.ended(self.lease.poll() if self.lease is not None else [], now)
        if not self.lost.gone or idle:
            return
        done = {r for r, b in self.control.beats().items() if b == b"done"}
        host_of = self.control.hosts()
        verdict = self.lost.verdict(self.control.members, done, host_of, now)
        if verdict is None or self.control.given_up() is not None:
            return
        if verdict.world is not None and host_of is not None:
            self._shrink(verdict, verdict.world, host_of)
            return
        log.warning(
            "baft supervisor 0: the supervisors of ranks %s are gone; not shrinking "
            "in-process: %s", list(verdict.lost), verdict.why_not,
        )  # fmt: skip
        self.control.give_up(
            f"the supervisors of ranks {list(verdict.lost)} are gone or silent (their host or "
            f"torchrun agent died or froze)"
        )

    def _shrink(self, verdict: Verdict, world: tuple[int, ...], host_of: dict[int, int]) -> None:
        """Rank 0: the job goes on without the lost hosts from the next generation no
        supervisor entered yet (its store is not open: every supervisor reads the new
        world before it can enter)."""
        first = self.control.hosted + 1
        self.control.shrink(first, {r: host_of[r] for r in world})
        cause = (
            f"host(s) {list(verdict.hosts)} lost (ranks {list(verdict.lost)}): the job "
            f"shrinks in-process to {len(world)} ranks"
        )
        log.warning("baft supervisor 0: %s", cause)
        self.control.begin(first - 1, cause)

    # ------------------------------------------------------------------ heartbeats
    def silent(self) -> list[int]:
        """Beat (at most twice a second) and return the peers silent for longer than
        ``peer_silence_s``."""
        now = time.monotonic()
        if now - self._beat_at < 0.5:
            return self._silent
        self._beat_at = now
        self._beat += 1
        self.control.beat(self._beat)
        for r, raw in self.control.beats().items():
            if raw == b"done":  # finished: never silent
                self._peer_seen.pop(r, None)
                self._done.add(r)
            elif r not in self._done and self._peer_seen.get(r, (b"", 0.0))[0] != raw:
                self._peer_seen[r] = (raw, now)
        members = set(self.control.members)
        last = {r: at for r, (_, at) in self._peer_seen.items() if r in members}
        self._silent = silent_peers(now, last, self.timeouts.peer_silence_s)
        return self._silent

    def on_silence(self, silent: Sequence[int]) -> str | None:
        """What to do about peers silent for ``peer_silence_s`` (a frozen host: power or
        network lost, its sockets never close, so no lease ends): why to give up, or
        None. Rank 0 counts them lost as if their leases ended, so an elastic job that
        lost whole hosts shrinks in-process (:meth:`check_leases`); a peer waits for rank
        0's verdict (:class:`~.policy.Silence`)."""
        now = time.monotonic()
        if self.rank == 0:  # each silence once, as a lease ends once
            self.lost.ended(set(silent) - self._fed, now)
            self._fed = set(silent)
            return None
        return self._silence.why_give_up(silent, now)

    def await_peers(self, poll_s: float) -> None:
        """Rank 0's child ended: keep the control store up until every peer's child
        finished too (their work after ``ft.close()`` may take long), or fell silent (its
        host is gone), beating meanwhile so that no peer takes this host for lost."""
        gone: set[int] = set()  # peers whose lease ended: their process is gone
        while True:
            try:
                silent = self.silent()
                beats = self.control.beats()
            except (RuntimeError, OSError):
                return
            gone.update(self.lease.poll() if self.lease is not None else [])
            waiting = {r for r, b in beats.items() if b != b"done"} - set(silent) - gone
            if len(beats) == len(self.control.members) - 1 and not waiting:
                return
            time.sleep(poll_s)
