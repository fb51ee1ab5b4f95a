"""Where a rank's CPU goes, per thread: the attribution of the overhead bench.

Linux keeps, per thread, ``/proc/self/task/<tid>/schedstat``: nanoseconds run on a CPU,
nanoseconds spent runnable but waiting for one (run-queue delay: the wake-up latency a
busy core adds), and time slices. Sampled around every measured iteration, the deltas
say what each mode costs where: the training (main) thread's own CPU and its run-queue
delay, baft's Python helper threads (named by :mod:`threading`), and every other thread
(gloo's transport and device loops, torch's intra-op pool, a peer library's threads).

A Python thread's OS name is the process's, so threads are named here through
``threading.enumerate()`` (``native_id`` -> ``name``); the rest are grouped as C++ threads.
Reading ~30 small files costs ~0.2 ms and is paid by every mode alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

GROUPS = ("main", "baft", "other")
"""Thread groups: the training thread, baft's helper threads (``baft-*``), the rest."""
FIELDS = ("main_cpu_s", "main_runq_s", "baft_cpu_s", "baft_runq_s", "other_cpu_s", "main_sys_s")
"""Per-iteration seconds this module adds to the bench's fields."""


@dataclass(frozen=True, slots=True)
class ThreadTimes:
    """Cumulative seconds of one thread."""

    cpu_s: float
    runq_s: float


def parse_schedstat(text: str) -> ThreadTimes:
    """``"<run ns> <wait ns> <slices>"`` -> seconds (pure)."""
    run, wait, *_ = text.split()
    return ThreadTimes(int(run) / 1e9, int(wait) / 1e9)


def group_of(tid: int, main_tid: int, names: Mapping[int, str]) -> str:
    """The :data:`GROUPS` entry of thread ``tid`` (pure)."""
    if tid == main_tid:
        return "main"
    return "baft" if names.get(tid, "").startswith("baft") else "other"


def sample() -> dict[int, ThreadTimes]:
    """Every live thread of this process -> its cumulative times (threads that end
    between listing and reading are skipped)."""
    out = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/schedstat") as f:
                out[int(entry)] = parse_schedstat(f.read())
        except (OSError, ValueError):
            continue
    return out


def python_thread_names() -> dict[int, str]:
    """Native thread id -> :mod:`threading` name of every live Python thread."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def deltas(
    before: Mapping[int, ThreadTimes],
    after: Mapping[int, ThreadTimes],
    main_tid: int,
    names: Mapping[int, str],
) -> dict[str, float]:
    """Seconds per :data:`FIELDS` between two samples (pure). A thread born in between
    counts from zero; one that ended in between is lost (its last interval unseen)."""
    acc = dict.fromkeys(FIELDS, 0.0)  # main_sys_s: set by ThreadClock
    for tid, t in after.items():
        b = before.get(tid, ThreadTimes(0.0, 0.0))
        g = group_of(tid, main_tid, names)
        acc[f"{g}_cpu_s"] += t.cpu_s - b.cpu_s
        if f"{g}_runq_s" in acc:
            acc[f"{g}_runq_s"] += t.runq_s - b.runq_s
    return acc


class ThreadClock:
    """Samples this process's threads around one iteration."""

    def __init__(self) -> None:
        self.main_tid = threading.main_thread().native_id or os.getpid()
        self._before: dict[int, ThreadTimes] = {}
        self._sys0 = 0.0

    def start(self) -> None:
        self._before = sample()
        self._sys0 = system_seconds(self.main_tid)

    def stop(self) -> list[float]:
        """The :data:`FIELDS` values since :meth:`start`, in order."""
        d = deltas(self._before, sample(), self.main_tid, python_thread_names())
        d["main_sys_s"] = system_seconds(self.main_tid) - self._sys0
        return [d[f] for f in FIELDS]


def parse_stime(stat: str) -> float:
    """Kernel-mode seconds of a thread from its ``stat`` line (pure): field 15, in clock
    ticks (the command name, field 2, may hold spaces: split after its ')')."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def system_seconds(tid: int) -> float:
    """Kernel-mode CPU seconds of thread ``tid`` of this process (system calls, and
    interrupts or softirqs the kernel charged to it: on loopback TCP, the receiving
    side's network stack), at clock-tick resolution (10 ms: read over many iterations)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return parse_stime(f.read())
    except OSError:
        return 0.0
