"""The generation a process runs in: the one seam between the library and in-process recovery.

Under ``python -m baft.inprocess`` (:mod:`baft.inprocess`) every rank's training function
runs in a child of a small supervisor; a failure anywhere moves the job to its next
*generation* of process groups, and the survivors re-enter the function. The library
(api, engine, recover, watchdog) never talks to the supervisor itself: it reads this
module, which :mod:`baft.inprocess` fills in.

- :class:`Generation`: one generation as the supervisors announced it.
- :class:`Link`: what the library may tell the supervisor (an iteration completed, frozen
  peers, the job's agreed end) and ask of it (a newer generation announced, a SIGTERM
  held between generations). :func:`current` is None without a supervisor, and then
  nothing here changes anything.
- :func:`join` / :func:`members`: what belongs to the current generation (each
  ``baft.protect`` result) and is abandoned, without a collective, when it is aborted.

This module holds the process's two pieces of in-process state (the installed link and
the members); nothing else outside :mod:`baft.inprocess` keeps any.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

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
    env: tuple[tuple[str, str], ...] = ()
    """torchrun's variables as they are in this generation where they differ from the
    launch's: ``RANK``, ``WORLD_SIZE`` and the host numbering of a job that shrank
    in-process onto the hosts left (empty: as launched)."""


class GenerationAborted(RuntimeError):
    """The supervisors announced a new generation: a wait of the old one gives up."""


class Link(Protocol):
    """The training process's line to its supervisor, as the library uses it
    (implemented by :class:`baft.inprocess.channel.Channel`)."""

    @property
    def generation(self) -> Generation:
        """The generation this process runs in."""
        ...

    @property
    def spawned_in(self) -> int:
        """The generation this process started in (> 0: it replaced a failed one)."""
        ...

    @property
    def entered_at(self) -> float:
        """Wall time this process (re-)entered the training function."""
        ...

    def progress(self) -> None:
        """An iteration completed in this generation."""

    def suspect(self, ranks: list[int], reason: str) -> None:
        """This rank's watchdog found ``ranks`` frozen: their supervisors replace them."""

    def elastic(self, num_replicas: int, model_ranks: int) -> None:
        """The job has ``num_replicas`` elastic replicas and ``model_ranks`` ranks per copy
        of the model: the supervisors may shrink it onto the hosts left when one is lost."""

    def closed(self, agreed: bool) -> None:
        """``ft.close()`` ran; ``agreed``: every rank ended the job with it."""

    def pending(self) -> Generation | None:
        """A newer generation announced and not entered yet, or None."""
        ...

    def take_held_sigterm(self) -> bool:
        """An engine takes over a SIGTERM held between generations; whether one was."""
        ...

    def hold_sigterm_again(self) -> None:
        """An engine that had a SIGTERM ends unflushed: hold it for the next one."""


class Member(Protocol):
    """What belongs to a generation and ends with it (a :class:`baft.api.Protected`)."""

    def abandon(self) -> None:
        """Stop without a collective: the generation's groups are broken."""


_link: Link | None = None
_members: list[Member] = []
"""Strong references: a generation's members must outlive the training function's frames
(when it raised, nothing else may hold them any more, and an unreachable member's threads,
its watchdog's beat, would run on into the next generation)."""


def install(link: Link | None) -> None:
    """Make ``link`` this process's line to its supervisor (None: no supervisor)."""
    global _link
    _link = link


def current() -> Link | None:
    """This process's line to its supervisor, or None (not under ``baft.inprocess``)."""
    return _link


def number() -> int:
    """The generation this process runs in (0 without a supervisor)."""
    return int(os.environ.get(GENERATION_ENV, "0"))


def join(member: Member) -> None:
    """``member`` belongs to the current generation: it is abandoned when that ends.
    Without a supervisor nothing is kept (no generation ends)."""
    if _link is not None and not any(m is member for m in _members):
        _members.append(member)


def leave(member: Member) -> None:
    """``member`` ended on its own (closed) or was abandoned."""
    _members[:] = [m for m in _members if m is not member]


def members() -> list[Member]:
    """What the current generation holds (abandoned by an in-process recovery)."""
    return list(_members)


def check_aborted() -> None:
    """Raise :class:`GenerationAborted` when a new generation was announced to this
    process: for baft's waits that are not on a socket (same-host shared memory polls),
    which the abort's socket shutdown cannot interrupt. Cheap; a no-op without a
    supervisor."""
    link = _link
    pending = link.pending() if link is not None else None
    if link is not None and pending is not None:
        raise GenerationAborted(
            f"generation {pending.number} began ({pending.cause}): this wait of "
            f"generation {link.generation.number} gives up"
        )


def recovery_phases(fault_at: float | None, t_launch: float) -> dict[str, float]:
    """The in-process recovery's phases up to this process's (re-)entry, when this
    generation is a recovery: ``detect`` (the fault to the supervisor that saw it; when
    the fault's time is known) and ``abort`` (a survivor: from there to re-entering the
    training function) or ``replace`` (a replacement: to its start)."""
    link = _link
    if link is None or link.generation.number == 0 or not link.generation.began_at:
        return {}
    began = link.generation.began_at
    out = {"detect": began - fault_at} if fault_at is not None else {}
    out["replace" if link.spawned_in == link.generation.number else "abort"] = t_launch - began
    return out


def describe() -> dict[str, object]:
    """This process's generation for a recovery record (empty without a supervisor)."""
    link = _link
    if link is None:
        return {}
    g = link.generation
    return {"generation": g.number, "cause": g.cause, "replacement": link.spawned_in == g.number}
