"""When a supervisor recovers in-process and when it gives up (pure, no I/O).

In-process recovery helps when one process failed and the rest of the job can go on
around its replacement. It cannot help, and the supervisor hands the failure to
torchrun's group restart (every process restarts, the restore runs as after any crash),
when:

- the same rank fails again in a generation that has not completed an iteration yet: a
  failure during a recovery (a replacement that crashes while restoring, a second fault
  before the first is repaired), where a clean start of every process is the safer bet;
- a rank failed more than ``max_failures`` times in this launch attempt (a rank that
  keeps failing: a bad host, a bug that fires on every attempt);
- a peer supervisor went silent: its host is gone (node loss), and no replacement
  process can join until torchrun's rendezvous brings in a new node.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ledger:
    """One rank's failures in this launch attempt, kept by its supervisor."""

    max_failures: int = 3
    failures: int = 0
    progressed: set[int] = field(default_factory=set)
    """Generations in which this rank completed an iteration."""

    def progress(self, generation: int) -> None:
        self.progressed.add(generation)

    def failure(self, generation: int) -> str | None:
        """Count a failure of this rank in ``generation``; why to give up, or None."""
        self.failures += 1
        if generation > 0 and generation not in self.progressed:
            return (
                f"failed in generation {generation} before its first iteration "
                "(a failure during a recovery)"
            )
        if self.failures > self.max_failures:
            return f"{self.failures} failures of this rank (limit {self.max_failures})"
        return None


def must_replace(rank: int, kill: set[int], spawned_in: int, generation: int) -> bool:
    """Whether ``rank``'s child must be killed and replaced: the supervisors named it in
    ``generation``'s kill list (a frozen rank) and it was spawned before that generation
    (never the replacement itself)."""
    return rank in kill and spawned_in < generation


def silent_peers(now: float, last_change: dict[int, float], limit_s: float) -> list[int]:
    """Peers whose supervisor heartbeat has not changed for more than ``limit_s``."""
    return sorted(r for r, at in last_change.items() if now - at > limit_s)
