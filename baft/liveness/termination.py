"""Torn down for good: SIGTERM turns into an agreed, flushed, clean exit.

A scheduler's preemption (or ``torchrun`` being stopped) sends SIGTERM to every worker.
Instead of dying with the newest state only in host memory that is about to go away, the
handler just raises a flag; the engine votes it with the next commit (the same tiny MIN
all-reduce, no extra collective), and once every rank has seen the vote, every rank
persists the live state (the version the next iteration starts from, complete on every
rank) as a plain DCP checkpoint within ``TimeoutConfig.flush_s`` and exits with status 0. The
next launch of the same run resumes from that checkpoint (DESIGN.md §3; DLRover calls
it "persist at breakpoint").

A SIGTERM that a crashed peer triggers (torchrun stopping the rest of the group before a
restart) cannot be flushed collectively: the dead rank never votes. So a thread watches
from the signal on (:meth:`Termination._watch`) and the process dies of the SIGTERM, as
it would have without baft, as soon as one of these holds, so that the restart is not
held up (its memory stores keep the newest version for the restart):

- a peer can no longer vote: its process on this host has exited, or its heartbeat (or
  the store) has been silent for three beats (asked of the running watchdog, the
  ``absent`` probe the engine is built with; checked at once and every 50 ms);
- the process is leaving without an agreed flush (an error ended training: a collective
  with the dead rank broke), where the interpreter's finalization would take seconds;
- the grace period ran out: three iterations and at least 5 s (see :meth:`pace`), the
  bound when nothing tells a dead peer apart (no watchdog, a remote peer not yet silent).

A preemption SIGTERM reaches every rank and every peer keeps beating, so none of the
first two holds, and the agreed flush goes ahead as before; once this rank begins it
(:meth:`Termination.flushing`), the watch ends. A rank that finished cleanly never
counts as absent.

torchrun stops its workers with ``killpg``: the SIGTERM also reaches every process the
training process forked, its DataLoader workers first. A worker dying of it makes torch
raise in the training thread (``DataLoader worker ... exited unexpectedly``) before the
flush's vote. While the handler is installed, DataLoader workers forked from then on
ignore SIGTERM (:mod:`baft.liveness.loader`), and a forked process that inherits the
handler itself ignores it there (it was installed by another pid): the workers live on
until their parent flushed and shut them down, as on any clean end.

Under in-process recovery (:func:`baft.run`) the training function is re-entered, and
between one generation's engine and the next there is no :class:`Termination`: the
supervisor's channel holds a SIGTERM then (:class:`baft.inprocess.channel.SigtermHold`)
until the next engine's :class:`Termination` takes it over (:func:`install` asks the
generation's link), and its flush follows the restore.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from baft.liveness import generation
from baft.liveness.loader import keep_loader_workers_through_sigterm

log = logging.getLogger("baft")


POLL_S = 0.05
"""Seconds between two looks for an absent peer while a SIGTERM waits for its flush."""


class Termination:
    """A SIGTERM flag (installed only from the main thread; a no-op elsewhere).

    ``absent``: why a peer can no longer vote, or None (the running watchdog's
    ``absent_peer``; default: no evidence, the grace alone bounds the wait)."""

    def __init__(
        self,
        grace_s: float = 2.0,
        *,
        max_grace_s: float = 20.0,
        absent: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.requested = False
        self.grace_s = grace_s
        """Seconds from SIGTERM to an agreed flush before dying of the signal anyway."""
        self.max_grace_s = max_grace_s
        """The grace never exceeds the flush's own bound (``TimeoutConfig.flush_s``)."""
        self.absent = absent
        self._profiled_s = 0.0
        self._last_step: float | None = None
        self._previous: Any = None
        self._installed = False
        self._settled = threading.Event()
        """Set once the agreed flush begins or the handler is removed: the watch ends."""
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def pace(self, iteration_s: float, *, profiled: bool = False) -> None:
        """Follow the iteration time: the agreed flush comes at the latest two votes
        later, so the grace is three iterations (of the profiled one, ``profiled``, or the
        last one, whichever is longer), at least 5 s and at most ``max_grace_s``."""
        if profiled:
            self._profiled_s = iteration_s
        longest = max(iteration_s, self._profiled_s)
        self.grace_s = min(self.max_grace_s, max(5.0, 1.0 + 3.0 * longest))

    def step_done(self) -> None:
        """An optimizer step ended: time the iteration since the last one."""
        now = time.perf_counter()
        if self._last_step is not None:
            self.pace(now - self._last_step)
        self._last_step = now

    def install(self) -> Termination:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        keep_loader_workers_through_sigterm()
        atexit.register(self._at_exit)
        self._installed = True
        link = generation.current()
        if link is not None and link.take_held_sigterm():  # came during a recovery: flush
            self._handle(signal.SIGTERM, None)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or os.getpid() != self._pid:  # forked children: not theirs
            return
        self.requested = True
        log.warning(
            "SIGTERM: flushing the newest state to DCP at the next agreed commit (within "
            "%.1f s), then exiting",
            self.grace_s,
        )
        self._thread = threading.Thread(target=self._watch, name="baft-sigterm", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Until the agreed flush begins: leave at once when a peer can no longer vote,
        or when the grace runs out (see the module docstring)."""
        deadline = time.monotonic() + self.grace_s
        while not self._settled.is_set():
            try:
                why = self.absent()
            except Exception as e:  # noqa: BLE001 - no evidence: the grace still bounds it
                log.debug("SIGTERM: cannot tell whether a peer is gone: %s", e)
                why = None
            if why is not None:
                self._die(f"{why}, so no flush can be agreed: exiting without the grace")
            if time.monotonic() >= deadline:
                self._die(f"no agreed flush within {self.grace_s:.1f} s (a peer is gone?): exiting")
            self._settled.wait(POLL_S)

    def flushing(self) -> None:
        """Every rank agreed: the flush is on (bounded by its own timeout), keep living."""
        self._settled.set()

    def _at_exit(self) -> None:
        """The interpreter is ending after a SIGTERM without an agreed flush (an error
        ended training, typically a collective the dead rank broke): die of the SIGTERM
        now instead of finalizing (seconds of tearing torch's objects down). A live child
        process (a peer library's saver) keeps the normal exit, which joins it."""
        if self.requested and not self._settled.is_set() and not multiprocessing.active_children():
            self._die("leaving without an agreed flush (training ended by an error): exiting now")

    @staticmethod
    def _die(why: str) -> None:
        die_of_sigterm(why)

    def uninstall(self) -> None:
        unflushed = self.requested and not self._settled.is_set()
        self._settled.set()
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            atexit.unregister(self._at_exit)
            self._installed = False
            link = generation.current()
            if unflushed and link is not None:
                link.hold_sigterm_again()


def die_of_sigterm(why: str) -> None:
    """Leave at once with the status a SIGTERM death gives (128 + 15), as without baft
    (from any thread: Python cannot re-install a signal handler outside the main one)."""
    log.warning("SIGTERM: %s", why)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)
