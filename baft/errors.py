"""What no restart can cure: baft's refusals.

A :class:`Refusal` is raised when baft declines to go on for a reason that holds on every
attempt: nothing restorable while the run records progress, a checkpoint of another
model, topology or layout. Restarting the process (in-process or torchrun's group
restart) would refuse again, so :func:`baft.run` ends the job once with the message
instead of re-entering the training function (see :mod:`baft.inprocess`)."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)

_MARK = "baft_refusal"


class Refusal(Exception):  # noqa: N818 - a marker mixed into the concrete error types
    """Mixed into an error type: raising it ends the job, never restarts it."""


def refusal(error: E) -> E:
    """Mark ``error`` as a refusal, its type unchanged (``raise refusal(ValueError(...))``:
    callers still catch the ValueError they know)."""
    setattr(error, _MARK, True)
    return error


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is a refusal: a :class:`Refusal` or
    an error marked by :func:`refusal`."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, Refusal) or getattr(e, _MARK, False):
            return True
        seen.add(id(e))
        e = e.__cause__
    return False
