"""The training process's line to its supervisor, for in-process recovery.

Under ``python -m baft.inprocess`` (see :mod:`baft.inprocess`) every rank's training code
runs in a child of a small supervisor, and the two talk over a Unix pipe (never TCP:
an abort shuts TCP sockets down, see below). This module is the child's end:

- **down** (supervisor -> child), one message kind: ``("gen", g, port, cause, began_at)``,
  "the job moved to generation ``g``; its c10d store listens on ``port``". A reader
  thread takes it, marks the recovery pending and at once aborts this process's
  communication of the old generation by shutting down the TCP sockets the training
  function opened (:func:`baft.liveness.sockets.shutdown_tcp`): whatever the main thread
  is blocked in (a gloo collective, a pipeline receive, the store) raises, and
  :func:`baft.api.run` re-enters the training function in generation ``g``.
- **up** (child -> supervisor): ``("progress", g)`` after the first iteration completed
  in generation ``g`` (a recovery that finished); ``("failed", g, reason)`` when the
  training function raised and no new generation came (a failure of this rank: the
  supervisor starts a recovery or gives up); ``("suspect", g, ranks, reason)`` when this
  rank's watchdog found frozen ranks (their supervisors replace them); ``("entered", g)``
  when it re-entered the training function in generation ``g`` (a death before it
  belongs to the generation before: a node lost at once is one failure, not a failure
  during its recovery); ``("stuck", g)`` when the training thread has not taken the
  announced generation ``g`` within :data:`STUCK_S` (its supervisor replaces it);
  ``("ended", g)`` when the training function returned after every rank agreed the job
  ended (``ft.close()``): from then on this rank's work (saving a model, a logger) is
  its own, a failure of it is not recovered, and rank 0's supervisor keeps the control
  store up until every rank ended; ``("refused", g, reason)`` when the training function
  raised a :class:`baft.errors.Refusal`: every attempt would refuse again, so the
  supervisors end the job once, with no restart.

Nothing here imports from baft outside :mod:`baft.liveness`; without a supervisor
:func:`current` is None and nothing changes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from baft.liveness.sockets import shutdown_tcp, tcp_inodes

log = logging.getLogger("baft")

STUCK_S = float(os.environ.get("BAFT_INPROCESS_STUCK_S", "1"))
"""Seconds a training thread has to take an announced generation (a survivor's abort
and re-entry take well under one here) before its process counts as hung."""
GENERATION_ENV = "BAFT_GENERATION"
"""The generation a process (re-)entered the training function in; 0 at first."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation of the job's process groups, as the supervisors announced it."""

    number: int
    port: int
    """The c10d store of this generation (``MASTER_PORT`` inside the training function)."""
    cause: str = ""
    """Why it began (empty for generation 0)."""
    began_at: float = 0.0
    """Wall time the failure was seen by a supervisor (0 for generation 0)."""


class Channel:
    """The child's end of the supervisor pipe (a ``multiprocessing`` Connection)."""

    def __init__(
        self,
        conn: Any,
        generation: Generation,
        rank: int,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.conn = conn
        self._on_lost = on_lost or _die
        self.rank = rank
        self.generation = generation
        self.spawned_in = generation.number
        """The generation this process started in (> 0: it replaced a failed one)."""
        self.entered_at = time.time()
        """Wall time this process (re-)entered the training function."""
        self._keep = tcp_inodes()
        self._lock = threading.Lock()
        self._pending: Generation | None = None
        self._arrived = threading.Event()
        self._progressed = -1
        self.close_agreed: bool | None = None
        """Whether the last ``ft.close()`` of this generation agreed on the job's end
        (None: no close yet)."""
        self._reader = threading.Thread(target=self._read, name="baft-channel", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ child -> supervisor
    def _send(self, *msg: Any) -> None:
        with self._lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError) as e:  # the supervisor is gone: it takes us along
                log.debug("baft channel: send failed: %s", e)

    def progress(self) -> None:
        """An iteration completed in this generation (sent once per generation)."""
        g = self.generation.number
        if self._progressed != g:
            self._progressed = g
            self._send("progress", g)

    def failed(self, reason: str) -> None:
        self._send("failed", self.generation.number, reason)

    def suspect(self, ranks: list[int], reason: str) -> None:
        self._send("suspect", self.generation.number, sorted(ranks), reason)

    def ended(self) -> None:
        """The training function returned after the job's agreed end."""
        self._send("ended", self.generation.number)

    def refused(self, reason: str) -> None:
        self._send("refused", self.generation.number, reason)

    def closed(self, agreed: bool) -> None:
        """``ft.close()`` ran in this generation; ``agreed``: every rank ended with it."""
        self.close_agreed = agreed

    def keep_connections(self) -> None:
        """The TCP connections this process holds now stay through every abort: those the
        script opened before its training function (a metrics or data-service client at
        module level); only what the training function opens belongs to a generation."""
        self._keep = tcp_inodes()

    # ------------------------------------------------------------------ supervisor -> child
    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the supervisor is gone: so is this rank
                log.error("baft: the supervisor of rank %d is gone: leaving", self.rank)
                self._on_lost()
                return
            if msg[0] != "gen":
                continue
            gen = Generation(int(msg[1]), int(msg[2]), str(msg[3]), float(msg[4]))
            with self._lock:
                if gen.number <= self.generation.number:
                    continue
                self._pending = gen
            n = shutdown_tcp(self._keep)
            _abort_nccl()
            log.info(
                "baft: generation %d (%s): aborted this rank's %d connections of generation %d",
                gen.number, gen.cause, n, self.generation.number,
            )  # fmt: skip
            self._arrived.set()
            self._keep_aborting()

    def _keep_aborting(self) -> None:
        """Until the main thread takes the new generation, a connection it opens for the
        old one (a rendezvous it was entering) is shut down too, so it cannot wait there.
        A main thread that has not taken it after :data:`STUCK_S` is hung off any socket
        (a stuck read, a deadlock, a sleep): this rank says so and its supervisor
        replaces the process (its watchdog still beats, so no peer names it)."""
        deadline: float | None = time.monotonic() + STUCK_S
        while True:
            with self._lock:  # enter() takes the lock: no shutdown after it returned
                pending = self._pending
                if pending is None:
                    return
                shutdown_tcp(self._keep)
            if deadline is not None and time.monotonic() > deadline:
                deadline = None
                log.error(
                    "baft: the training thread of rank %d has not taken generation %d within "
                    "%.1f s (hung off any socket): its supervisor replaces this process",
                    self.rank, pending.number, STUCK_S,
                )  # fmt: skip
                self._send("stuck", pending.number)
            try:
                if self.conn.poll(0.05):  # a newer message: read it
                    return
            except (EOFError, OSError):
                return

    def pending(self) -> Generation | None:
        with self._lock:
            return self._pending

    def wait_for_generation(self, timeout_s: float | None) -> bool:
        """Whether a new generation was announced (waiting up to ``timeout_s``)."""
        return self._arrived.wait(timeout_s)

    def abort_again(self) -> None:
        """Shut down what the old generation still holds (sockets opened after the abort)."""
        shutdown_tcp(self._keep)

    def enter(self) -> Generation:
        """Move to the announced generation: its store becomes ``MASTER_PORT``."""
        with self._lock:
            gen, self._pending = self._pending, None
            self._arrived.clear()
        assert gen is not None, "enter() without an announced generation"
        self.generation = gen
        self.close_agreed = None
        self.entered_at = time.time()
        os.environ["MASTER_PORT"] = str(gen.port)
        os.environ[GENERATION_ENV] = str(gen.number)
        self._send("entered", gen.number)
        return gen


def _abort_nccl() -> None:
    """NCCL collectives do not wait on the sockets shut down above: abort the NCCL
    communicators with torch's abort (as NVRx's in-process restart does). Jobs without
    NCCL (gloo, CPU) skip it. Untested here: this machine has no GPU."""
    try:
        import torch.distributed as dist

        if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
            dist.distributed_c10d._abort_process_group()
    except Exception as e:  # noqa: BLE001 - best effort: the bounded waits remain
        log.warning("baft: aborting the NCCL groups failed: %s", e)


class GenerationAborted(RuntimeError):
    """The supervisors announced a new generation: a wait of the old one gives up."""


def check_aborted() -> None:
    """Raise :class:`GenerationAborted` when a new generation was announced to this
    process: for baft's waits that are not on a socket (same-host shared memory polls),
    which the abort's socket shutdown cannot interrupt. Cheap; a no-op without a
    supervisor."""
    ch = _current
    if ch is not None and ch._pending is not None:
        raise GenerationAborted(
            f"generation {ch._pending.number} began ({ch._pending.cause}): this wait of "
            f"generation {ch.generation.number} gives up"
        )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


_current: Channel | None = None


def recovery_phases(fault_at: float | None, t_launch: float) -> dict[str, float]:
    """The in-process recovery's phases up to this process's (re-)entry, when this
    generation is a recovery: ``detect`` (the fault to the supervisor that saw it; when
    the fault's time is known) and ``abort`` (a survivor: from there to re-entering the
    training function) or ``replace`` (a replacement: to its start)."""
    ch = _current
    if ch is None or ch.generation.number == 0 or not ch.generation.began_at:
        return {}
    began = ch.generation.began_at
    out = {"detect": began - fault_at} if fault_at is not None else {}
    out["replace" if ch.spawned_in == ch.generation.number else "abort"] = t_launch - began
    return out


def describe() -> dict[str, object]:
    """This process's generation for a recovery record (empty without a supervisor)."""
    ch = _current
    if ch is None:
        return {}
    g = ch.generation
    return {"generation": g.number, "cause": g.cause, "replacement": ch.spawned_in == g.number}


def current() -> Channel | None:
    """This process's channel to its supervisor, or None (not under ``baft.inprocess``)."""
    return _current


def install(channel: Channel | None) -> None:
    global _current
    _current = channel


def generation() -> int:
    """The generation this process runs in (0 without a supervisor)."""
    return int(os.environ.get(GENERATION_ENV, "0"))
