"""Timeline records written by the trainer: dataclasses and a tolerant reader.

A run directory holds ``timeline/rank{r}.jsonl`` with one JSON object per line and
iteration: the iteration number, the rank, ``t0`` (wall-clock epoch seconds of the
iteration start), ``iter_s`` and a list of events whose ``start``/``end`` are seconds
relative to ``t0``. Unknown keys are ignored so the trainer can add fields freely.

A killed process may leave a truncated last line; it is skipped. A malformed line in
the middle of a file is a real error and raises ``ValueError`` naming file and line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CATEGORIES: tuple[str, ...] = ("compute", "wait", "ckpt")
"""The event categories the trainer writes, in display order."""

_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


@dataclass(frozen=True, slots=True)
class Event:
    """One timed span of one iteration on one rank (seconds relative to ``t0``)."""

    name: str
    """What ran: "F", "B", "optimizer", "wait", "snapshot", "send", ..."""
    cat: str
    """Category: "compute" | "wait" | "ckpt"."""
    start: float
    """Start, seconds after the iteration's ``t0``."""
    end: float
    """End, seconds after the iteration's ``t0``."""
    stage: int | None = None
    """Pipeline stage of a compute event, if any."""
    mb: int | None = None
    """Microbatch index of a compute event, if any."""
    slot: str | None = None
    """Slot id of a wait or checkpoint task ("w0", "dp_allreduce", "pre_step", ...)."""
    kind: str | None = None
    """Wait kind: "p2p" | "collective" (waits only)."""
    nbytes: int | None = None
    """Bytes moved by a checkpoint task (the ``bytes`` key)."""
    exposed: bool | None = None
    """Checkpoint tasks only: True when the task ran outside any bubble."""

    @property
    def duration(self) -> float:
        """Length of the span in seconds (never negative)."""
        return max(0.0, self.end - self.start)


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """All events of one iteration on one rank."""

    iteration: int
    """Iteration (optimizer step) number."""
    rank: int
    """Global rank that recorded it."""
    t0: float
    """Wall-clock epoch seconds of the iteration start; comparable across ranks."""
    iter_s: float
    """Duration of the iteration in seconds."""
    events: tuple[Event, ...]
    """Events in the order the trainer wrote them."""


def _opt_int(obj: Mapping[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return None if value is None else int(value)


def _opt_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    return None if value is None else str(value)


def parse_event(obj: Mapping[str, Any]) -> Event:
    """Build an ``Event`` from one decoded JSON object; unknown keys are ignored."""
    exposed = obj.get("exposed")
    return Event(
        name=str(obj["name"]),
        cat=str(obj["cat"]),
        start=float(obj["start"]),
        end=float(obj["end"]),
        stage=_opt_int(obj, "stage"),
        mb=_opt_int(obj, "mb"),
        slot=_opt_str(obj, "slot"),
        kind=_opt_str(obj, "kind"),
        nbytes=_opt_int(obj, "bytes"),
        exposed=None if exposed is None else bool(exposed),
    )


def parse_record(obj: Mapping[str, Any], *, default_rank: int | None = None) -> IterationRecord:
    """Build an ``IterationRecord`` from one decoded JSON line.

    ``default_rank`` is used when the line has no ``rank`` key (e.g. the file name's rank).
    """
    rank = obj.get("rank", default_rank)
    if rank is None:
        raise KeyError("rank")
    return IterationRecord(
        iteration=int(obj["iteration"]),
        rank=int(rank),
        t0=float(obj["t0"]),
        iter_s=float(obj["iter_s"]),
        events=tuple(parse_event(e) for e in obj.get("events", ())),
    )


def parse_lines(
    lines: Iterable[str], *, source: str = "<lines>", default_rank: int | None = None
) -> list[IterationRecord]:
    """Parse JSONL text into records, skipping blank lines and a truncated last line.

    Raises ``ValueError`` naming ``source`` and the line number for a bad line that is
    not the last one (a file that was damaged, not merely cut short).
    """
    records: list[IterationRecord] = []
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    for pos, (lineno, line) in enumerate(numbered):
        try:
            records.append(parse_record(json.loads(line), default_rank=default_rank))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if pos == len(numbered) - 1:
                break  # a killed writer leaves a partial last line: ignore it
            raise ValueError(
                f"{source}:{lineno}: malformed timeline record ({exc!r}); fix or delete that line"
            ) from exc
    return records


def timeline_files(run_dir: str | Path) -> dict[int, Path]:
    """Map rank -> ``RUN_DIR/timeline/rank{r}.jsonl`` for every timeline file present."""
    directory = Path(run_dir) / "timeline"
    if not directory.is_dir():
        return {}
    found: dict[int, Path] = {}
    for path in directory.iterdir():
        match = _RANK_FILE.match(path.name)
        if match and path.is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def read_timelines(run_dir: str | Path) -> dict[int, list[IterationRecord]]:
    """Read every rank's timeline of a run: rank -> records sorted by iteration.

    Raises ``FileNotFoundError`` when ``RUN_DIR/timeline/rank*.jsonl`` does not exist.
    Ranks whose file holds no complete record are left out.
    """
    files = timeline_files(run_dir)
    if not files:
        raise FileNotFoundError(
            f"no timelines in {run_dir}: expected {Path(run_dir) / 'timeline'}/rank<r>.jsonl; "
            "pass the directory of a run made by `baft train`"
        )
    out: dict[int, list[IterationRecord]] = {}
    for rank, path in files.items():
        text = path.read_text(encoding="utf-8", errors="replace")
        for rec in parse_lines(text.splitlines(), source=str(path), default_rank=rank):
            out.setdefault(rec.rank, []).append(rec)
    for recs in out.values():
        recs.sort(key=lambda r: r.iteration)
    return dict(sorted(out.items()))


def event_to_json(event: Event) -> dict[str, Any]:
    """The JSON object of an event in the trainer's format (None fields left out)."""
    out: dict[str, Any] = {
        "name": event.name,
        "cat": event.cat,
        "start": event.start,
        "end": event.end,
    }
    optional = {
        "stage": event.stage,
        "mb": event.mb,
        "slot": event.slot,
        "kind": event.kind,
        "bytes": event.nbytes,
        "exposed": event.exposed,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def record_to_json(record: IterationRecord) -> dict[str, Any]:
    """The JSON object of one timeline line; ``parse_record`` inverts it."""
    return {
        "iteration": record.iteration,
        "rank": record.rank,
        "t0": record.t0,
        "iter_s": record.iter_s,
        "events": [event_to_json(e) for e in record.events],
    }


def write_timelines(
    run_dir: str | Path, records: Mapping[int, Iterable[IterationRecord]]
) -> dict[int, Path]:
    """Write ``RUN_DIR/timeline/rank{r}.jsonl`` for each rank (tests, simulators, tools)."""
    directory = Path(run_dir) / "timeline"
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[int, Path] = {}
    for rank, recs in records.items():
        path = directory / f"rank{rank}.jsonl"
        lines = [json.dumps(record_to_json(r)) + "\n" for r in recs]
        path.write_text("".join(lines), encoding="utf-8")
        paths[rank] = path
    return paths
