"""Background checkpoint threads yield the CPU to training.

Linux schedules threads individually, so a protect or copy thread can drop to
``SCHED_IDLE`` (runs only when a core would otherwise idle) without touching the training
thread. Elsewhere, or where the call is refused, the thread keeps its priority and the
reason is logged once. ``BAFT_BACKGROUND_PRIORITY`` chooses which threads drop (for
measuring): ``idle`` (default) the protect worker, the snapshot copy thread and the
checkpoint transport's gloo threads (:class:`ForeignThreads`), ``threads`` baft's own
two but not gloo's, ``worker`` only the protect worker, ``normal`` none.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterable, Iterator

log = logging.getLogger("baft")
ENV = "BAFT_BACKGROUND_PRIORITY"
"""``idle`` (default), ``threads``, ``worker`` or ``normal``."""
VALUES = ("idle", "threads", "worker", "normal")


def background_priority() -> str:
    """The configured policy of background checkpoint threads (see :data:`ENV`)."""
    value = os.environ.get(ENV, "idle")
    if value not in VALUES:
        raise ValueError(f"{ENV} must be one of {', '.join(VALUES)}, got {value!r}")
    return value


def lower_thread_priority(kind: str = "worker") -> bool:
    """Put the calling thread (``kind`` ``worker`` or ``copy``) at ``SCHED_IDLE`` when
    the configuration says so; True if it took."""
    setting = background_priority()
    if setting == "normal" or (setting == "worker" and kind != "worker"):
        return False
    return set_thread_idle(threading.get_native_id(), True)


def set_thread_idle(native_id: int, idle: bool, quiet: bool = False) -> bool:
    """Move a thread of this process to ``SCHED_IDLE`` or back to ``SCHED_OTHER``;
    ``quiet``: a refusal is expected (the thread may have ended) and not logged.

    Waiting on an idle-priority thread is a priority inversion: while the training
    thread waits for it (the worker's drain at the step), any runnable thread of another
    rank starves it. So whoever waits raises it for the wait and lowers it again after.
    """
    setter = getattr(os, "sched_setscheduler", None)
    policy = getattr(os, "SCHED_IDLE" if idle else "SCHED_OTHER", None)
    if setter is None or policy is None:
        return False
    try:
        setter(native_id, policy, os.sched_param(0))
    except OSError as err:
        if not quiet:
            _warn_normal_priority(str(err))
        return False
    return True


@functools.cache
def _warn_normal_priority(err: str) -> None:
    """Once per reason (a cache, not a module flag)."""
    log.info("background checkpoint threads keep normal priority: %s", err)


@contextlib.contextmanager
def raised(native_id: int, idle: bool) -> Iterator[None]:
    """While the caller waits for an idle-priority thread (``idle`` True), run that
    thread at normal priority, then put it back (see :func:`set_thread_idle`)."""
    boosted = idle and set_thread_idle(native_id, False)
    try:
        yield
    finally:
        if boosted:
            set_thread_idle(native_id, True)


class ForeignThreads:
    """Threads started by a library rather than by baft (the gloo I/O loop and work
    threads of the checkpoint transport's group), lowered to ``SCHED_IDLE`` under the
    ``idle`` setting.

    They move every redundancy byte over the network exchange: at normal priority their
    socket copies competed with the training threads for the cores (the attribution's
    "other threads" CPU, +19 ms per iteration over the network vs +1 ms over shared
    memory). Whoever waits on them raises them for the wait (:meth:`boosted`, nestable
    and safe from several threads), as for baft's own background threads."""

    def __init__(self, native_ids: Iterable[int]) -> None:
        self.ids = tuple(native_ids)
        self._lock = threading.Lock()
        self._depth = 0
        self.idle = bool(self.ids) and background_priority() == "idle"
        if self.idle:
            self.idle = all([set_thread_idle(i, True) for i in self.ids])

    def _set(self, idle: bool) -> None:
        for i in self.ids:  # a thread that ended (its group destroyed) is no error
            set_thread_idle(i, idle, quiet=True)

    @contextlib.contextmanager
    def boosted(self) -> Iterator[None]:
        """The threads at normal priority while the caller waits on them."""
        if not self.idle:
            yield
            return
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._set(False)
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._set(True)
