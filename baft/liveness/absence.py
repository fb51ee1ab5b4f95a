"""Who can no longer take part: a peer whose process is gone, or whose heartbeat stopped.

Two questions of the other liveness modules rest on the same evidence, a peer's
heartbeat (its pid, host and process start time, and when its sequence number last
moved) and this host's ``/proc``:

- the watchdog (:mod:`.watchdog`) kills a *stopped* peer on this host, so that torchrun's
  restart does not wait 30 s for it (:func:`kill_if_stopped`);
- the SIGTERM handling (:mod:`.termination`) asks whether an agreed flush can still
  happen at all (:func:`absent`): when torchrun stops the survivors of a crashed rank,
  the crashed rank never votes, and waiting out the grace for it only delays the restart.

The rule is pure (:func:`absent`, every time and process state passed in); the ``/proc``
readers below are its inputs on Linux. The running watchdog applies it to what it saw
(``Watchdog.absent_peer``), and the engine's SIGTERM handling is built with that probe.
A process start time (clock ticks since boot)
tells a reused pid apart from the process that sent the heartbeat.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


def start_time(pid: int) -> str | None:
    """Start time of ``pid`` (clock ticks since boot), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def proc_state(pid: int) -> str:
    """One-letter state of ``pid`` from ``/proc`` (``T`` = stopped), '' if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def is_stopped(pid: int, start: str) -> bool:
    """``pid`` is still the process that started at ``start``, and it is stopped."""
    return bool(start) and start_time(pid) == start and proc_state(pid) in ("T", "t")


def has_exited(pid: int, start: str) -> bool:
    """The process ``pid`` that started at ``start`` is no longer running: no such pid,
    a zombie its parent has not reaped yet (a SIGKILLed worker until torchrun polls it),
    or the pid now belongs to another process."""
    state = proc_state(pid)
    return state in ("", "Z", "X", "x") or (bool(start) and start_time(pid) != start)


def kill_if_stopped(pid: int, start: str) -> bool:
    """SIGKILL ``pid`` if it is still the process that started at ``start`` and it is
    stopped. A stopped process leaves a pending SIGTERM pending, so torchrun would wait
    its 30 s grace for it; a running one (even a hung one) dies of torchrun's SIGTERM."""
    if not is_stopped(pid, start):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class PeerBeat:
    """One watched peer as its last heartbeat described it (times: monotonic, local)."""

    rank: int
    last_change: float
    """When its heartbeat last changed (or watching started, if never seen)."""
    host: str = ""
    pid: int = 0
    start: str = ""
    """Its process start time ('' when not seen yet)."""
    done: bool = False
    """It left training cleanly: never counted absent (a finished rank exits)."""


def absent(
    now: float,
    peers: Sequence[PeerBeat],
    *,
    here: str,
    store_silent_s: float,
    quiet_s: float,
    exited: Callable[[int, str], bool] = has_exited,
) -> str | None:
    """Why some peer can no longer take part in a collective, or None when every peer
    may still (pure but for ``exited``, which reads ``/proc``).

    In order: a peer on this host (``here``) whose process has exited (certain, and seen
    at once); the store not answering for more than ``quiet_s`` (its host is gone, and
    with it every heartbeat); a peer whose heartbeat has not moved for more than
    ``quiet_s`` (on another host this is the only evidence; a live peer beats every
    ``quiet_s / 3`` from a thread of its own, also while its training thread is busy).
    A peer that finished cleanly (``done``) never counts."""
    live = [p for p in peers if not p.done]
    for p in live:
        if p.host == here and p.pid and p.start and exited(p.pid, p.start):
            return f"rank {p.rank} has exited (pid {p.pid} on this host)"
    if store_silent_s > quiet_s:
        return f"the store has not answered for {store_silent_s:.1f} s (its host is gone)"
    if live:
        worst = min(live, key=lambda p: p.last_change)
        silent = now - worst.last_change
        if silent > quiet_s:
            return f"rank {worst.rank} has not sent a heartbeat for {silent:.1f} s"
    return None
