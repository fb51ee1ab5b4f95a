"""The per-rank supervisor: the process torchrun starts, holding the training process.

torchrun's agent ends every worker when one exits (then starts them all again: a group
restart, 2-3 s of imports and rendezvous per process here, minutes at scale). Under
``torchrun ... -m baft.inprocess script.py ARGS`` the worker torchrun sees is this
supervisor instead, which never exits on a recoverable failure:

1. At start it opens the control store (:mod:`.control`; rank 0's supervisor hosts it on
   torchrun's ``MASTER_PORT``, and one c10d store per generation for the training
   processes) and a forkserver that imports torch and baft once.
2. It forks the training process (:mod:`.child`) and watches three things at once: the
   child's exit, the child's messages (:mod:`baft.inprocess.messages`), and the control
   store (polled every ``poll_s``).
3. **A failure** (its child died, or raised and reported it, or a watchdog named a
   frozen rank) moves the job to the next generation. Every supervisor then tells its
   child, whose channel aborts the old generation's connections at once, so the
   survivors' training functions re-enter in the same process (:func:`baft.run`):
   they keep the interpreter, imports, whatever lives outside the function, the store
   mappings, and on GPUs the CUDA context. The failed rank's supervisor forks a
   replacement (and kills a frozen child first). All meet in the new generation's store
   and restore from memory, each survivor from its own store.
4. **A lost host** (its supervisors' leases ended, :mod:`.membership`): a job with elastic
   replicas shrinks in-process onto the hosts left (survivors re-enter with renumbered
   ranks); otherwise the supervisors give up.
5. **Giving up** (see :mod:`.policy`): the supervisor records why, kills its child and
   exits non-zero; torchrun's group restart (``--max-restarts``) takes over, as without
   in-process recovery. SIGTERM (a preemption) goes to the child, whose agreed flush
   runs as before; the supervisor exits with the child's status.
6. **A refusal** (:class:`baft.errors.Refusal`, reported by the child): no attempt can
   succeed, so every supervisor kills its child and stops its torchrun agent, once.
7. **The job's end**: a child whose training function returned after ``ft.close()``
   agreed on every rank works on as long as it likes; a failure after it is not
   recovered, and rank 0's supervisor keeps the control store up until every rank's
   child exited.
8. **A hung training thread** (it does not take an announced generation, see
   :attr:`baft.config.InprocessTimeouts.stuck_s`) is killed and replaced like a dead one.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import wait
from types import FrameType
from typing import Any

from baft.config import InprocessTimeouts
from baft.inprocess import messages as msg
from baft.inprocess.child import Target, child_main
from baft.inprocess.control import Control
from baft.inprocess.membership import Membership, NotInWorld
from baft.inprocess.policy import Elastic, Ledger, must_replace
from baft.inprocess.preload import forkserver_context
from baft.liveness.generation import Generation

log = logging.getLogger("baft")

GIVE_UP_EXIT = 75
"""A supervisor's status when in-process recovery gave up (torchrun restarts the group)."""
REFUSED_EXIT = 78
"""A supervisor's status when the training function refused (:class:`baft.errors.Refusal`):
the job ends, torchrun's agent stopped so that it does not restart it."""


@dataclass
class Options:
    max_failures: int = 3
    """More failures of one rank in a launch attempt than this: group restart."""
    timeouts: InprocessTimeouts = field(default_factory=InprocessTimeouts)
    """Every bound (``BAFT_INPROCESS_*``, see :class:`~baft.config.InprocessTimeouts`)."""
    poll_s: float = 0.02
    """How often the control store is read."""
    host_grace_s: float = 1.0
    """Rank 0: how long a host some of whose supervisors died is given for the rest of
    them to die (a lost host) before the verdict (see :class:`~.policy.LostPeers`)."""

    @classmethod
    def from_env(cls) -> Options:
        return cls(
            max_failures=int(os.environ.get("BAFT_INPROCESS_MAX_FAILURES", "3")),
            timeouts=InprocessTimeouts.from_env(),
        )


class Supervisor:
    """One rank's supervisor (see the module docstring)."""

    def __init__(self, target: Target, options: Options) -> None:
        self.target = target
        self.options = options
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.control = Control(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.rank,
            self.world_size, timeout_s=options.timeouts.store_s,
        )  # fmt: skip
        self.members = Membership(self.control, options.host_grace_s, options.timeouts)
        """Which peers are in the job; their heartbeats, leases, and a lost host's verdict."""
        self.agent = os.getppid()
        """The torchrun agent that started this supervisor: when it is gone (killed
        with SIGKILL, which leaves its workers behind), so is the job."""
        self.ledger = Ledger(options.max_failures)
        self.ctx = forkserver_context()
        self.child: Any = None
        self.conn: Any = None
        self.child_gen = 0
        """The newest generation the child was told of (or spawned in)."""
        self.entered_gen = 0
        """The newest generation the child entered (spawned in, or acknowledged): a death
        belongs to it. Told of a generation is not in it yet: a child killed with its
        whole node, an instant after a peer, dies in the old generation."""
        self.spawned_in = 0
        self.terminating = False
        self._told_at: float | None = None
        """When the child was told of a generation it has not entered yet (monotonic)."""
        self.ended = False
        """The child's training function returned after the job's agreed end: from then
        on its work is its own (no recovery; a failure is its exit status)."""

    # ------------------------------------------------------------------ child
    def _generation(self, g: int) -> Generation:
        """Generation ``g`` with its store port (waits for rank 0's supervisor to open it)."""
        limit = self.options.timeouts.store_s
        deadline = time.monotonic() + limit
        while True:
            port = self.control.host_generation(g) if self.rank == 0 else self.control.port(g)
            if port is not None:
                cause, at = self.control.describe(g)
                return Generation(g, port, cause, at, self.members.world_env(g))
            if time.monotonic() > deadline:
                raise RuntimeError(f"no store for generation {g} after {limit:.0f} s")
            time.sleep(self.options.poll_s)

    def _spawn(self, g: int) -> None:
        gen = self._generation(g)
        parent, child = self.ctx.Pipe()
        self.child = self.ctx.Process(
            target=child_main, args=(self.target, child, gen), name=f"baft-rank{self.rank}"
        )
        self.child.start()
        child.close()
        self.conn = parent
        self.child_gen = self.spawned_in = self.entered_gen = g
        self._told_at = None
        log.info(
            "baft supervisor %d: training process %d in generation %d", self.rank, self.child.pid, g
        )

    def _kill_child(self) -> None:
        if self.child is not None and self.child.exitcode is None:
            os.kill(self.child.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        # torchrun stops a worker with killpg(SIGTERM): the forkserver (and the resource
        # tracker) start with SIGTERM ignored, so that a preemption reaches the training
        # process (which flushes) without killing the process it was forked from
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        forkserver.ensure_running()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._spawn(0)
        try:
            code = self._loop()
        except (RuntimeError, OSError) as e:  # the control store is gone (rank 0's host)
            code = self._store_lost(e)
        except NotInWorld as e:  # its agent restarts it: a host joining grows the job
            code = self._stop(str(e))
        if self.rank == 0 and code == 0:  # the store outlives every peer's last call to it
            self.members.await_peers(self.options.poll_s)
        return code

    def _store_lost(self, error: BaseException) -> int:
        """The control store stopped answering (rank 0's host is gone): a child past the
        job's end finishes its own work; otherwise the group restarts."""
        if self.child is not None:
            self.child.join(None if self.ended else 5.0)
            if self.child.exitcode == 0:
                return 0
            if self.ended:
                return self.child.exitcode
        return self._stop(f"the control store is unreachable: {error}")

    def _loop(self) -> int:
        while True:
            waits = [self.child.sentinel] + ([self.conn] if self.conn is not None else [])
            wait(waits + self.members.waitables(), self.options.poll_s)
            self._read_messages()
            self.members.check_leases(idle=self.terminating or self.ended)
            if self.child.exitcode is not None:
                code = self._on_exit(self.child.exitcode)
                if code is not None:
                    return code
                continue
            if os.getppid() != self.agent:
                return self._stop("its torchrun agent is gone")
            if self.terminating or self.ended:
                continue
            reason = self.control.given_up()  # one store read per poll
            if reason is not None:
                return self._end(reason, "another rank gave up: ")
            self._follow(self.control.generation())
            self._check_unresponsive()
            why = self.members.on_silence(self.members.silent())
            if why is not None:
                self.control.give_up(why)

    def _read_messages(self) -> None:
        while self.conn is not None and self.conn.poll():
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.conn = None
                return
            self._on_message(message)

    def _on_message(self, message: msg.Up) -> None:
        match message:
            case msg.Progress(g):
                self.ledger.progress(g)
            case msg.Entered(g):
                self.entered_gen = max(self.entered_gen, g)
                if self.entered_gen >= self.child_gen:
                    self._told_at = None
            case msg.Stuck(g) if g == self.control.generation():
                self._replace_stuck(g)
            case msg.Ended():
                self.ended = True
                self.control.ended()
            case msg.Refused(_, reason):
                self.control.refuse(f"rank {self.rank}: {reason}")
            case msg.Failed(g, reason) if g >= self.control.generation():
                self._failure(g, f"rank {self.rank} raised: {reason}")
            case msg.Suspect(g, ranks, reason):  # the generation's ranks: launch ranks here
                kill = self.members.launch_ranks(ranks)
                self.control.begin(g, f"rank {self.rank}'s watchdog: {reason}", kill=kill)
            case Elastic():
                self.members.lost.elastic = message

    def _failure(self, g: int, cause: str) -> None:
        why = self.ledger.failure(g)
        if why is not None:
            self.control.give_up(f"rank {self.rank} {why}: {cause}")
            return
        now = self.control.begin(g, cause)
        log.warning("baft supervisor %d: %s -> generation %d", self.rank, cause, now)

    def _replace_stuck(self, g: int) -> None:
        """The child's training thread did not take generation ``g`` (hung off any
        socket): a failure of this rank; kill the child, whose exit respawns it in ``g``."""
        self._told_at = None  # one replacement per generation
        cause = f"rank {self.rank}'s training thread hung (it did not take generation {g})"
        why = self.ledger.failure(self.entered_gen)
        if why is not None:
            self.control.give_up(f"rank {self.rank} {why}: {cause}")
            return
        log.warning(
            "baft supervisor %d: %s: replacing process %d", self.rank, cause, self.child.pid
        )
        self._kill_child()

    def _on_exit(self, code: int) -> int | None:
        """The child exited: the supervisor's status, or None after a respawn."""
        if code == 0 or self.terminating or self.ended:
            self.control.finished()
            return code
        refused = self.control.refused()
        if refused is not None:
            return self._end_job(refused)
        if self.control.job_ended():  # died after the job's agreed end: nothing to rejoin
            log.error(
                "baft supervisor %d: rank %d's process failed (status %d) after the job "
                "ended: not recovered", self.rank, self.rank, code,
            )  # fmt: skip
            self.control.finished()
            return code if code > 0 else 128 - code
        current = self.control.generation()
        if current <= self.entered_gen:  # no recovery began since: this one starts it
            what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
            self._failure(self.entered_gen, f"rank {self.rank}'s process {self.child.pid} {what}")
        reason = self.control.given_up()
        if reason is not None:
            return self._end(reason)
        self._spawn(self.control.generation())
        return None

    def _follow(self, g: int) -> None:
        """Tell the child about a new generation, or replace it if it was named frozen."""
        if must_replace(self.rank, self.control.kill_list(g), self.spawned_in, g):
            if self.child.exitcode is None:
                log.warning(
                    "baft supervisor %d: replacing frozen process %d", self.rank, self.child.pid
                )
                self._kill_child()
            return
        if g > self.child_gen and self.conn is not None:
            gen = self._generation(g)
            try:
                self.conn.send(msg.Announce(gen))
            except (OSError, ValueError):
                pass
            self.child_gen = g
            self._told_at = time.monotonic()

    def _check_unresponsive(self) -> None:
        """A child told of a generation that neither entered it nor said it is stuck
        within ``stuck_s + unresponsive_s`` cannot answer at all (stopped: SIGSTOP, a hung
        kernel; its channel thread is frozen too): replace it like a stuck one. This
        closes the race where the peers' timed-out waits start a generation before any
        watchdog named the frozen rank, so no kill list names it."""
        told = self._told_at
        if told is None or self.entered_gen >= self.child_gen or self.child.exitcode is not None:
            return
        bound = self.options.timeouts.stuck_s + self.options.timeouts.unresponsive_s
        if time.monotonic() - told > bound:
            self._replace_stuck(self.child_gen)

    def _end(self, reason: str, prefix: str = "") -> int:
        """``giveup`` is set: end the job if it was a refusal, else stop for the group
        restart."""
        refused = self.control.refused()
        return self._end_job(refused) if refused is not None else self._stop(prefix + reason)

    def _stop(self, reason: str) -> int:
        log.error(
            "baft supervisor %d: in-process recovery gives up (%s): group restart",
            self.rank,
            reason,
        )
        self._kill_child()
        if self.child is not None:
            self.child.join(10.0)
        return GIVE_UP_EXIT

    def _end_job(self, reason: str) -> int:
        """A refusal: every attempt would refuse again, so the job ends now. torchrun has
        no exit status that means "do not restart", so the supervisor stops its agent
        the way a user would (SIGTERM: the agent stops its workers and exits non-zero
        without another attempt); every supervisor does so for its own agent."""
        log.error("baft supervisor %d: the job ends without a restart: %s", self.rank, reason)
        self._kill_child()
        if self.child is not None:
            self.child.join(10.0)
        if "TORCHELASTIC_RUN_ID" in os.environ and os.getppid() == self.agent > 1:
            self.terminating = True
            os.kill(self.agent, signal.SIGTERM)
        return REFUSED_EXIT

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.terminating = True
        if self.child is not None and self.child.exitcode is None:
            os.kill(self.child.pid, signal.SIGTERM)
