"""Hangs become failures: every wait bounded by the timeout, and a watchdog per rank.

A crashed rank ends its process and torchrun restarts the group; a *frozen* one (a hung
kernel, a stuck collective, a swapped-out host, ``kill -STOP``) ends nothing, and its
peers wait for it. Two mechanisms turn a hang into a crash that recovery already handles:

1. **Bounded waits** (:func:`bound_waits`). Every process group baft waits on gets the
   job's timeout ``T`` (``CheckpointConfig.timeouts.collective_s``, ``--timeout``), so collectives
   (DP/TP all-reduces, the checkpoint commit vote, restore broadcasts) raise after ``T``;
   pipeline and checkpoint send/receive waits pass ``T`` to ``Work.wait`` explicitly,
   because gloo does not apply a group's timeout to the wait of a point-to-point op. On
   CUDA the same call sets the NCCL groups' timeout, after which NCCL's own watchdog
   aborts a stuck collective (``TORCH_NCCL_ASYNC_ERROR_HANDLING``; untested here).
2. **The watchdog** (:class:`Watchdog`): two daemon threads per rank. The *beat* thread
   publishes a heartbeat (sequence number, current section, pid, host) every ``T/10``
   seconds (at most 1 s) through the job's c10d TCPStore on a connection of its own,
   independent of the training process groups, and reads its watched peers' beats. The
   *monitor* thread does no I/O: it decides (:func:`decide`, pure) from what the beat
   thread saw. A peer whose heartbeat has not changed for ``T`` seconds, an unresponsive
   store for ``T`` seconds, or this rank's own section running longer than its limit,
   makes the rank log which rank and section, dump the Python stacks of its threads
   (``faulthandler``), append a record to ``RUN_DIR/hangs.jsonl``, SIGKILL the suspect if
   it is a stopped process on this host (torchrun would wait 30 s for it to honour SIGTERM)
   and leave with :data:`WATCHDOG_EXIT_CODE`; torchrun then restarts the group and the
   restore proceeds as for a crash.

Timeout hierarchy (why the numbers relate as they do):

- heartbeat period ``h = min(1 s, T/10)``: a frozen peer is seen within ``T + h``.
- every single wait: ``T``. The wait's own error names the wait (``pipeline wait w3``);
  when it fires, the watchdog's error hook (:meth:`Watchdog.section`) still looks for
  peers silent for more than ``3h`` and kills a frozen one on this host.
- peer silence and store silence: ``T``. A slow rank (a straggler) keeps beating, because
  the beat runs on its own thread, so only a process that stopped running is declared.
- own section: ``2T`` per iteration (beyond any single wait, so a rank blocked on a peer
  is failed by the wait first and names it; the section limit catches hangs outside any
  timed wait: a stuck kernel, a Python deadlock), ``10T`` for restore and close (many
  bounded waits plus local reads and DCP I/O), matching the persister's ``10T``.

A straggler is therefore killed only if one of its iterations takes longer than ``T``
(its peers' waits give up) or ``2T`` (its own section): pick ``T`` well above the slowest
legitimate iteration (the default 60 s fits iterations up to about 10 s that slow down 5x).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from baft.liveness import generation
from baft.liveness.absence import (
    PeerBeat,
    absent,
    is_stopped,
    kill_if_stopped,
    start_time,
)
from baft.liveness.hangs import HANGS_FILE, agreed_attempt, append_hang, attempt_key, read_hangs
from baft.liveness.verdict import (
    PeerView,
    Verdict,
    beat_period,
    decide,
    section_limit,
    watched_peers,
)

WATCHDOG_EXIT_CODE = 86
"""Exit status of a rank its watchdog ended (shown by torchrun's failure summary)."""
_log = logging.getLogger("baft")
__all__ = [
    "HANGS_FILE",
    "NoWatchdog",
    "PeerView",
    "Verdict",
    "Watchdog",
    "attempt_key",
    "bound_waits",
    "decide",
    "read_hangs",
    "start_watchdog",
]


# ---------------------------------------------------------------------- bounded waits
def bound_waits(mesh: Any, stages: Sequence[Any], timeout_s: float) -> None:
    """Bound every wait of training by ``timeout_s``: the default group's, the mesh
    groups' and the pipeline stages' collectives (the step runner bounds the pipeline's
    point-to-point waits with the same ``timeout_s``).

    Groups made by ``init_device_mesh`` or ``new_group`` without a timeout get torch's
    default (30 min on gloo), not the default group's; ``_set_pg_timeout`` is the one
    c10d call that changes a live group's timeout (gloo and NCCL backends).
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout

    limit = timedelta(seconds=timeout_s)
    groups: list[Any] = [None]  # None = the default group
    for name in mesh.mesh.mesh_dim_names or ():
        groups.append(mesh.mesh.get_group(name))
    groups += [getattr(s, "group", None) for s in stages]
    seen: set[int] = set()
    for g in groups:
        key = id(g)
        if key in seen:
            continue
        seen.add(key)
        try:
            _set_pg_timeout(limit, g)
        except (ValueError, RuntimeError, AssertionError) as e:
            _log.warning("baft: cannot set the timeout of process group %s: %s", g, e)


# ---------------------------------------------------------------------- the watchdog
class Watchdog:
    """Heartbeat and hang detection of one rank; see the module docstring."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        run_dir: Path,
        host: str,
        port: int,
        store_rank: int | None = 0,
        attempt: int = 0,
        exit_process: bool = True,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.beat_s = beat_period(timeout_s)
        self.run_dir = Path(run_dir)
        self.store_addr = (host, port)
        self.store_rank = store_rank
        self.attempt = attempt
        self.exit_process = exit_process
        self.peers = watched_peers(rank, world_size)
        self.hostname = socket.gethostname()
        self.verdict: tuple[Verdict, str] | None = None
        """Set when the watchdog fired (tests run with ``exit_process=False``)."""
        self._lock = threading.Lock()
        self._section: str | None = None
        self._section_since = 0.0
        self._seq = 0
        self._done = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Wakes the beat thread at once (stop: the last beat says done)."""
        self._started = time.monotonic()
        self._store_ok_at = self._started
        self._seen: dict[int, tuple[bytes, float, dict[str, Any]]] = {}
        self._threads: list[threading.Thread] = []
        self._chained_hook = sys.excepthook

    @classmethod
    def from_env(
        cls, *, rank: int, world_size: int, timeout_s: float, run_dir: str, attempt: int = 0
    ) -> Watchdog | None:
        """A watchdog on torchrun's store (``MASTER_ADDR``/``MASTER_PORT``); None (with a
        warning) when the job was not started that way, or ``BAFT_WATCHDOG=0``."""
        if os.environ.get("BAFT_WATCHDOG", "1") == "0" or world_size < 2:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            _log.warning("baft: no MASTER_ADDR/MASTER_PORT: the hang watchdog is off")
            return None
        # With torchrun's shared rendezvous store the agent hosts it; else rank 0 does.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return cls(
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            run_dir=Path(run_dir),
            host=host,
            port=int(port),
            store_rank=None if agent_store else 0,
            attempt=attempt,
            exit_process=generation.current() is None,
        )

    # ------------------------------------------------------------------ main thread
    def start(self) -> Watchdog:
        for target, name in ((self._beat_loop, "beat"), (self._monitor_loop, "monitor")):
            t = threading.Thread(target=target, name=f"baft-watchdog-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self._chained_hook = sys.excepthook
        sys.excepthook = self._excepthook
        return self

    def absent_peer(self) -> str | None:
        """Why a watched peer can no longer take part (its process on this host exited,
        its heartbeat or the store silent for more than three beats), or None; see
        :func:`baft.liveness.absence.absent`. Called from any thread."""
        if self._stop.is_set():  # stopped: it saw nothing since
            return None
        now = time.monotonic()
        with self._lock:
            seen = dict(self._seen)
            store_silent = now - self._store_ok_at
        beats = []
        for p in self.peers:
            raw_at_info = seen.get(p)
            if raw_at_info is None:
                beats.append(PeerBeat(p, self._started))
                continue
            _, at, info = raw_at_info
            beats.append(
                PeerBeat(
                    p, at, host=str(info.get("host", "")), pid=int(info.get("pid") or 0),
                    start=str(info.get("start") or ""), done=bool(info.get("done")),
                )
            )  # fmt: skip
        return absent(
            now, beats, here=self.hostname, store_silent_s=store_silent, quiet_s=3 * self.beat_s
        )

    def _excepthook(self, kind: type[BaseException], error: BaseException, tb: Any) -> None:
        """An exception ends the process outside any section (a collective of the
        user's loop between steps, a metrics all-reduce, that timed out on a frozen
        peer): the same as in a section, so the hang is recorded and the frozen process
        killed rather than left to torchrun's 30 s grace. Then the previous hook."""
        try:
            # not twice: an error leaving a section was dealt with on its way out
            if self.verdict is None and not self._done and isinstance(error, Exception):
                self.after_error(error)
        finally:
            self._chained_hook(kind, error, tb)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run a section of the main thread under its limit. An exception leaving it (a
        wait that timed out) first looks for frozen peers: recorded and, on this host,
        killed, so that torchrun's restart does not wait for them."""
        with self._lock:
            self._section, self._section_since = name, time.monotonic()
        try:
            yield
        except BaseException as e:
            self.after_error(e)
            raise
        finally:
            with self._lock:
                self._section = None

    def after_error(self, error: BaseException) -> None:
        """An exception is ending this rank: deal with peers that look frozen."""
        now = time.monotonic()
        quiet = 3 * self.beat_s
        with self._lock:
            store_silent = now - self._store_ok_at
        if store_silent > quiet:  # every peer looks silent: blame the store's host only
            verdict = Verdict("store", self.store_rank, "", store_silent)
            kill = [self.store_rank] if self.store_rank not in (None, self.rank) else []
        else:
            stale = [p for p in self._views(now) if not p.done and now - p.last_change > quiet]
            if not stale:
                return
            worst = min(stale, key=lambda p: p.last_change)
            verdict = Verdict("peer", worst.rank, worst.section, now - worst.last_change)
            kill = [p.rank for p in stale]
        who = f"rank {verdict.rank}" if verdict.rank is not None else "the store"
        reason = (
            f"{type(error).__name__} while {who} has been silent for "
            f"{verdict.silent_s:.1f} s: {error}"
        )
        self._report(verdict, reason, kill=[r for r in kill if r is not None])

    def stop(self) -> None:
        """Training ended here: tell peers (a finished rank is no hang), stop the threads
        and join them (a daemon thread still inside a store call at interpreter exit can
        abort the process)."""
        with self._lock:
            self._done = True
            self._section = None
            seq = self._seq
        deadline = time.monotonic() + 3 * self.beat_s
        # the round in flight may have read done=False; the next one carries done=True
        while self._seq < seq + 2 and time.monotonic() < deadline and self._threads:
            self._wake.set()
            time.sleep(self.beat_s / 20)
        self._end_threads(join_s=2 * self.beat_s + 2.0)

    def _end_threads(self, join_s: float) -> None:
        """Stop and join the threads; give the excepthook back."""
        self._stop.set()
        self._wake.set()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._chained_hook
        for t in self._threads:
            t.join(timeout=join_s)
        self._threads = []

    # ------------------------------------------------------------------ threads
    def _connect(self) -> Any:
        store = dist.TCPStore(
            self.store_addr[0],
            self.store_addr[1],
            is_master=False,
            timeout=timedelta(seconds=max(self.beat_s * 2, 1.0)),
            wait_for_workers=False,
        )
        return dist.PrefixStore(f"baft-watchdog/{self.attempt}", store)

    def _beat_loop(self) -> None:
        store: Any = None
        me = {"pid": os.getpid(), "host": self.hostname, "start": start_time(os.getpid())}
        unseen = set(self.peers)
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect()
                with self._lock:
                    beat = dict(me, seq=self._seq, section=self._section or "", done=self._done)
                store.set(f"hb/{self.rank}", json.dumps(beat))
                for p in sorted(unseen):
                    if store.check([f"hb/{p}"]):
                        unseen.discard(p)
                known = [p for p in self.peers if p not in unseen]
                values = store.multi_get([f"hb/{p}" for p in known]) if known else []
                now = time.monotonic()
                with self._lock:
                    for p, raw in zip(known, values, strict=True):
                        prev = self._seen.get(p)
                        if prev is None or prev[0] != raw:
                            self._seen[p] = (raw, now, json.loads(raw))
                    self._store_ok_at = now
                    self._seq += 1
            except Exception as e:  # noqa: BLE001 - the store is down or slow: keep trying
                _log.debug("baft watchdog: store round failed: %s", e)
                store = None
            self._wake.wait(self.beat_s)
            self._wake.clear()

    def _views(self, now: float) -> list[PeerView]:
        with self._lock:
            out = []
            for p in self.peers:
                seen = self._seen.get(p)
                if seen is None:
                    out.append(PeerView(p, self._started))
                else:
                    info = seen[2]
                    out.append(
                        PeerView(p, seen[1], info.get("section", ""), bool(info.get("done")))
                    )
            return out

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.beat_s / 2):
            now = time.monotonic()
            with self._lock:
                section, since, done = self._section, self._section_since, self._done
                store_ok_at = self._store_ok_at
            if done:
                return
            verdict, reason = decide(
                now,
                self._views(now),
                store_ok_at=store_ok_at,
                store_rank=self.store_rank if self.store_rank != self.rank else None,
                section=section,
                section_since=since,
                section_limit_s=section_limit(section or "", self.timeout_s),
                timeout_s=self.timeout_s,
            )
            if verdict is not None:
                self._report(
                    verdict, reason, kill=[verdict.rank] if verdict.rank is not None else []
                )
                self._leave()
                return

    # ------------------------------------------------------------------ acting
    def _report(self, verdict: Verdict, reason: str, *, kill: list[int]) -> None:
        """Log, dump this rank's stacks, record, and SIGKILL frozen peers on this host."""
        self.verdict = (verdict, reason)
        now_wall, now = time.time(), time.monotonic()
        _log.error(
            "baft watchdog (rank %d, attempt %d): %s; %s (stacks of this rank's threads follow)",
            self.rank,
            self.attempt,
            reason,
            "this rank leaves so that torchrun restarts the group"
            if self.exit_process
            else "the supervisors replace the suspect and this rank recovers in-process",
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        link = generation.current()
        if link is not None:  # the suspects' supervisors replace them; every rank re-enters
            link.suspect(kill, reason)
        with self._lock:
            seen = dict(self._seen)
        frozen: dict[int, tuple[int, str]] = {}  # rank -> (pid, start) of a stopped process here
        for r in kill:
            info = seen.get(r, (b"", 0.0, {}))[2]
            if info.get("host") == self.hostname and info.get("pid"):
                pid, start = int(info["pid"]), str(info.get("start") or "")
                if is_stopped(pid, start):
                    frozen[r] = (pid, start)
        # The record goes to disk before the kill: once a worker dies torchrun tears the
        # group down within its monitor interval (0.1 s), and its SIGTERM would end this
        # process in the middle of a slow fsync, leaving the restart nobody to blame.
        last_seen = now_wall - verdict.silent_s
        append_hang(
            self.run_dir,
            {
                "attempt": self.attempt,
                "generation": generation.number(),
                "detected_by": self.rank,
                "detected_at": now_wall,
                "last_seen_at": last_seen,
                "kind": verdict.kind,
                "suspect": verdict.rank,
                "section": verdict.section,
                "silent_s": round(verdict.silent_s, 3),
                "killed": sorted(frozen),
                "reason": reason,
                "monotonic": now,
            },
        )
        killed = [r for r, (pid, start) in frozen.items() if kill_if_stopped(pid, start)]
        if killed:
            _log.error(
                "baft watchdog (rank %d): killed frozen rank(s) %s on this host", self.rank, killed
            )

    def abandon(self) -> None:
        """The generation is over (an in-process recovery): stop at once, no last beat."""
        self._done = True
        self._end_threads(join_s=0.5)

    def _leave(self) -> None:
        if not self.exit_process:  # in-process recovery: the supervisors act on the verdict
            return
        for h in logging.getLogger().handlers + _log.handlers:
            with contextlib.suppress(Exception):
                h.flush()
        sys.stderr.flush()
        os._exit(WATCHDOG_EXIT_CODE)


class NoWatchdog:
    """Stand-in when the watchdog is off: sections are plain blocks."""

    verdict = None

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        yield

    def stop(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def absent_peer(self) -> str | None:
        return None


def start_watchdog(
    mesh: Any, stages: Sequence[Any], timeout_s: float, run_dir: str
) -> Watchdog | NoWatchdog:
    """Both front doors (``baft train`` workers, ``baft.protect``): bound every wait of
    the mesh and the pipeline ``stages`` by ``timeout_s`` and start this rank's watchdog
    (off with ``BAFT_WATCHDOG=0``). Collective (the job's attempt is agreed)."""
    bound_waits(mesh, stages, timeout_s)
    wd = Watchdog.from_env(
        rank=mesh.rank, world_size=dist.get_world_size(), timeout_s=timeout_s, run_dir=run_dir,
        attempt=agreed_attempt(),
    )  # fmt: skip
    return wd.start() if wd is not None else NoWatchdog()
