"""What a supervisor and its training process tell each other over their pipe.

One frozen dataclass per message, pickled by the ``multiprocessing`` Connection; each
names the generation it belongs to, so a message of an older generation is told apart.

- **down** (supervisor -> training process): :class:`Announce`.
- **up** (training process -> supervisor): every other class here, and
  :class:`baft.inprocess.policy.Elastic` (the job's elastic replicas: it may shrink).
"""

from __future__ import annotations

from dataclasses import dataclass

from baft.inprocess.policy import Elastic
from baft.liveness.generation import Generation


@dataclass(frozen=True, slots=True)
class Announce:
    """The job moved to ``generation``: abort the old one's communication, re-enter."""

    generation: Generation


@dataclass(frozen=True, slots=True)
class Progress:
    """The first iteration completed in generation ``g`` (a recovery that finished)."""

    g: int


@dataclass(frozen=True, slots=True)
class Entered:
    """The training function (re-)entered generation ``g``: a death from now on belongs
    to it (a node lost at once is one failure, not a failure during its recovery)."""

    g: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The training function raised and no new generation came: a failure of this rank
    (the supervisor starts a recovery or gives up)."""

    g: int
    reason: str


@dataclass(frozen=True, slots=True)
class Suspect:
    """This rank's watchdog found ``ranks`` frozen: their supervisors replace them."""

    g: int
    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Stuck:
    """The training thread has not taken the announced generation ``g`` within the
    stuck bound: its supervisor replaces this process."""

    g: int


@dataclass(frozen=True, slots=True)
class Ended:
    """The training function returned after every rank agreed the job ended
    (``ft.close()``): from then on this rank's work is its own, not recovered."""

    g: int


@dataclass(frozen=True, slots=True)
class Refused:
    """The training function raised a :class:`baft.errors.Refusal`: every attempt would
    refuse again, so the supervisors end the job once, with no restart."""

    g: int
    reason: str


Up = Progress | Entered | Failed | Suspect | Stuck | Ended | Refused | Elastic
"""Every message a training process sends its supervisor."""
