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
restart) cannot be flushed collectively: the dead rank never votes. So the flag has a
grace period (three iterations and at least 5 s, see ``grace_s``): when no agreed flush has begun by
then, the process dies of the SIGTERM as it would have without baft, and the restart is
not held up; its memory stores keep the newest version for the restart.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

log = logging.getLogger("baft")


class Termination:
    """A SIGTERM flag (installed only from the main thread; a no-op elsewhere)."""

    def __init__(self, grace_s: float = 2.0, *, max_grace_s: float = 20.0) -> None:
        self.requested = False
        self.grace_s = grace_s
        """Seconds from SIGTERM to an agreed flush before dying of the signal anyway."""
        self.max_grace_s = max_grace_s
        """The grace never exceeds the flush's own bound (``TimeoutConfig.flush_s``)."""
        self._profiled_s = 0.0
        self._last_step: float | None = None
        self._previous: Any = None
        self._installed = False
        self._timer: threading.Timer | None = None

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
        self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            return
        self.requested = True
        log.warning(
            "SIGTERM: flushing the newest state to DCP at the next agreed commit (within "
            "%.1f s), then exiting",
            self.grace_s,
        )
        self._timer = threading.Timer(self.grace_s, self._die)
        self._timer.daemon = True
        self._timer.start()

    def flushing(self) -> None:
        """Every rank agreed: the flush is on (bounded by its own timeout), keep living."""
        if self._timer is not None:
            self._timer.cancel()

    def _die(self) -> None:
        """Runs on the timer thread, where Python cannot re-install a signal handler: leave
        at once with the status a SIGTERM death gives (128 + 15), as without baft."""
        log.warning(
            "SIGTERM: no agreed flush within %.1f s (a peer is gone?): exiting", self.grace_s
        )
        logging.shutdown()
        os._exit(128 + signal.SIGTERM)

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False
