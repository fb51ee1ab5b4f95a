"""A recovery's report and the run directory's records it reads: progress and hangs.

- :class:`RecoveryReport`: timing and provenance of one recovery (``recoveries.jsonl``).
- The progress record (``RUN_DIR/progress/rank<r>``): the last iteration each rank
  finished; a recovery counts the iterations it loses against it, and a start over is
  refused or allowed by it (``recover/runtime.py``).
- Hang attribution: which watchdog record (``hangs.jsonl``) ended the attempts since the
  last recovery, with detection apart from restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from baft.liveness.watchdog import read_hangs

log = logging.getLogger("baft")


class RecoveryReport:
    """Timing and provenance of one recovery, written by rank 0."""

    def __init__(self, run_dir: Path, attempt: int) -> None:
        self.run_dir = run_dir
        self.record: dict[str, Any] = {"attempt": attempt, "seconds": {}}
        self._t_start_first = 0.0

    def phase(self, name: str, seconds: float) -> None:
        self.record["seconds"][name] = round(seconds, 6)

    def first_iteration_started(self) -> None:
        self._t_start_first = time.time()

    def first_iteration_done(self, is_main: bool) -> None:
        self.phase("first_iteration", time.time() - self._t_start_first)
        self.record["resumed_at"] = time.time()
        if is_main:
            with open(self.run_dir / "recoveries.jsonl", "a") as f:
                f.write(json.dumps(self.record) + "\n")
            r = self.record
            secs = ", ".join(f"{k} {v:.3f}s" for k, v in r["seconds"].items())
            what = (
                f"recovered v{r['restored_version']} from {r['source']}"
                if r["restored_version"] is not None
                else "started over from iteration 0 (no version to restore)"
            )
            log.info("%s (lost %s iteration(s)): %s", what, r["lost_iterations"], secs)


PROGRESS_DIR = "progress"
"""The run's one progress record: per rank, the last iteration whose step it finished
(``baft.protect`` writes it after every step). The job finished an iteration when every
rank did; a recovery counts the iterations it loses against that."""


def write_progress(run_dir: Path, rank: int, iteration: int) -> None:
    """Record that this rank finished ``iteration`` (atomic: a crash keeps the old record)."""
    d = run_dir / PROGRESS_DIR
    d.mkdir(exist_ok=True)
    tmp = d / f".rank{rank}.tmp"
    tmp.write_text(str(iteration))
    tmp.replace(d / f"rank{rank}")


def completed_iterations(run_dir: Path, world_size: int) -> int:
    """Iterations every rank finished before this start (0 for a new run)."""
    done = []
    for r in range(world_size):
        try:
            done.append(int((run_dir / PROGRESS_DIR / f"rank{r}").read_text()))
        except (OSError, ValueError):
            done.append(-1)
    return min(done, default=-1) + 1


def progress_seen(run_dir: Path) -> int:
    """1 + the newest iteration any rank recorded as finished (0: no progress recorded)."""
    newest = -1
    for f in (run_dir / PROGRESS_DIR).glob("rank*"):
        try:
            newest = max(newest, int(f.read_text()))
        except (OSError, ValueError):
            continue
    return newest + 1


def _key(h: dict[str, Any]) -> tuple[int, int]:
    return int(h["attempt"]), int(h.get("generation", 0))


def unattributed_hangs(run_dir: Path, attempt: tuple[int, int]) -> list[dict[str, Any]]:
    """The hang records that ended an earlier attempt since the last recovery resumed.

    Not only the previous attempt's: on a loaded machine the first restart after a hang
    can itself fail (a restore wait timing out while the frozen process is still being
    torn down), and the attempt that finally recovers must still say who hung. Records
    from before the last recovery belong to that recovery. ``attempt``: (torchrun's
    restart count, the in-process generation), compared in that order.
    """
    if attempt <= (0, 0):
        return []
    since = 0.0
    try:
        for line in (run_dir / "recoveries.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError):
                since = max(since, float(json.loads(line).get("resumed_at", 0.0)))
    except FileNotFoundError:
        pass
    hangs = [
        h
        for h in read_hangs(run_dir)
        if "attempt" in h and _key(h) < attempt and float(h["detected_at"]) > since
    ]
    if not hangs:
        return []
    first = min(_key(h) for h in hangs)
    return [h for h in hangs if _key(h) == first]


def report_hang(
    report: RecoveryReport, run_dir: Path, attempt: tuple[int, int], t_launch: float
) -> None:
    """If a watchdog ended the previous attempt: who hung, and detection apart from restart.

    ``detect`` runs from the suspect's last heartbeat (the freeze, to within one beat
    period) to the first rank that noticed; ``restart`` from there to this process's start.
    """
    hangs = unattributed_hangs(run_dir, attempt)
    if not hangs:
        return
    first = hangs[0]
    report.record["hang"] = {
        k: first.get(k) for k in ("kind", "suspect", "section", "detected_by", "reason")
    }
    report.record["detected_at"] = first["detected_at"]
    report.phase("detect", first["detected_at"] - first["last_seen_at"])
    report.phase("restart", t_launch - first["detected_at"])
