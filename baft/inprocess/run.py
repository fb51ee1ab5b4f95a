"""The training process's side of in-process recovery: re-enter the training function.

:func:`run` (``baft.run``) runs the user's training function; under a supervisor it
re-enters it in the job's next generation of process groups after any rank's failure,
abandoning what the aborted generation built (:func:`abandon_generation`).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from baft.errors import is_refusal
from baft.inprocess.channel import Channel
from baft.liveness import generation

log = logging.getLogger("baft")
T = TypeVar("T")


def run(main: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run the training function ``main(*args, **kwargs)`` and return its result.

    Under ``torchrun ... -m baft.inprocess script.py`` (see :mod:`baft.inprocess`), when
    any rank fails, every surviving process re-enters ``main`` in the same process, in the
    job's next generation of process groups (``MASTER_PORT`` then names its store), and
    the failed process is replaced; ``ft.restore()`` inside ``main`` brings the newest
    committed version back from memory, each survivor from its own store. Everything built
    inside ``main`` is built again (it holds the old generation's groups); what lives
    outside it (a dataset, a tokenizer, imports) stays. TCP connections opened inside
    ``main`` are shut down when a peer fails (that is how a blocked gloo collective is
    aborted). Without the supervisor this is just ``main(*args, **kwargs)``."""
    ch = generation.current()
    if not isinstance(ch, Channel):
        return main(*args, **kwargs)
    ch.keep_connections()  # what the script opened so far (module level) is not aborted
    ch.hold_sigterm()  # a preemption during a recovery is flushed by the next generation
    rng = RandomState.take()  # every entry starts from it, as a fresh process would
    # What exists now (torch, the script's imports and globals) lives for the process:
    # out of the collector's sight, the collection after an abort scans only what the
    # failed generation built (0.45-0.6 s per full collection of an unfrozen heap, here)
    gc.freeze()
    wait_s = ch.timeouts.abort_wait_s
    while True:
        try:
            result = main(*args, **kwargs)
        except Exception as e:  # SystemExit (a SIGTERM flush) and KeyboardInterrupt pass
            what = f"{type(e).__name__}: {e}"
            if is_refusal(e) and ch.pending() is None:
                log.error("baft: the training function refused: %s", what)
                ch.refused(what)
                raise
            # a timed-out wait: a peer is hung and no supervisor saw a failure, so none
            # will announce a recovery; any other error may be a peer's death: wait for it
            if not ch.wait_for_generation(0.0 if timed_out(e) else wait_s):
                log.error("baft: the training function raised: %s", what)
                ch.failed(what)
                ch.wait_for_generation(None)  # the supervisor announces one, or ends us
        else:
            if ch.close_agreed is not False and ch.pending() is None:
                ch.ended()  # the job's end: what follows is this rank's own work
                return result
            # close() found no agreement (a peer failed in the last iteration): the
            # supervisors recover it, and this rank re-enters with the others
            if not ch.wait_for_generation(wait_s):
                ch.failed("ft.close() found no agreement on the job's end (a peer is gone)")
                ch.wait_for_generation(None)
        abandon_generation(ch)
        rng.put()
        gen = ch.enter()
        log.warning(
            "baft: in-process recovery, generation %d (%s): re-entering the training "
            "function in process %d", gen.number, gen.cause, os.getpid(),
        )  # fmt: skip


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a bounded wait that ran out (gloo's, the c10d store's, or a
    TimeoutError), not a connection a peer's death broke. gloo and the store raise their
    timeouts as plain RuntimeErrors (or DistError subclasses shared with broken
    connections), so the message is the only thing that tells them apart."""
    text = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in text or "wait timeout" in text


class RandomState:
    """The process's global random generators as ``baft.run`` found them (torch's CPU and
    CUDA ones, Python's ``random``, NumPy's legacy one): a survivor re-enters the
    training function with them as the replacement, a fresh process, has them, whatever
    the failed generation drew (a fresh start from iteration 0, or a script seeding
    only at module level, stays bit-identical)."""

    def __init__(self, cpu: torch.Tensor, cuda: list[torch.Tensor] | None, py: Any, np_: Any):
        self.cpu, self.cuda, self.py, self.np = cpu, cuda, py, np_

    @classmethod
    def take(cls) -> RandomState:
        import random

        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        np_state = None
        if "numpy" in sys.modules:
            np_state = sys.modules["numpy"].random.get_state()
        return cls(torch.get_rng_state(), cuda, random.getstate(), np_state)

    def put(self) -> None:
        import random

        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.py)
        if self.np is not None:
            sys.modules["numpy"].random.set_state(self.np)


def abandon_generation(ch: Channel) -> None:
    """Everything of the aborted generation goes: what joined it (each ``baft.protect``
    result: its engine and watchdog, without a collective), the sockets opened since,
    every process group; then the garbage (old model, optimizer, groups) before the
    function builds them again."""
    for member in generation.members():
        try:
            member.abandon()
        except Exception as e:  # noqa: BLE001 - keep going: the next generation needs the rest
            log.warning("baft: abandoning the old generation: %s", e)
        generation.leave(member)
    ch.abort_again()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            log.debug("destroy_process_group after an abort: %s", e)
    gc.collect()
