"""Background checkpoint threads yield the CPU to training.

Linux schedules threads individually, so a protect or copy thread can drop to
``SCHED_IDLE`` (runs only when a core would otherwise idle) without touching the training
thread. Elsewhere, or where the call is refused, the thread keeps its priority and the
reason is logged once. ``BAFT_BACKGROUND_PRIORITY`` chooses which threads drop (for
measuring): ``idle`` (default) the protect worker and the snapshot copy thread,
``worker`` only the protect worker, ``normal`` none.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator

log = logging.getLogger("baft")
ENV = "BAFT_BACKGROUND_PRIORITY"
"""``idle`` (default), ``worker`` or ``normal``."""
VALUES = ("idle", "worker", "normal")


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


def set_thread_idle(native_id: int, idle: bool) -> bool:
    """Move a thread of this process to ``SCHED_IDLE`` or back to ``SCHED_OTHER``.

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
