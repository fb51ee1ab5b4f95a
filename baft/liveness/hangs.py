"""The job's hang records and attempts: what a watchdog leaves for the restore to read.

``RUN_DIR/hangs.jsonl`` holds one record per hang a watchdog detected; each carries the
attempt it happened in (torchrun's restart count, the in-process generation), so that a
recovery reports the hang that began its chain.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from baft.liveness import generation

HANGS_FILE = "hangs.jsonl"
"""Under the run directory: one record per hang a watchdog detected (read by restore)."""


def attempt_key() -> tuple[int, int]:
    """This process's attempt, in order: (torchrun's restart count, the in-process
    generation it runs in). Hang records and recovery reports carry both."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), generation.number()


def agreed_attempt() -> int:
    """The job's torchrun attempt as every rank sees it: the highest restart count of any
    rank. torchrun counts restarts per agent, so a replacement host's agent starts at 0
    while the others are past it; heartbeats keyed by each rank's own count would never
    meet, and a healthy rank would be named frozen. Collective over the world."""
    mine = attempt_key()[0]
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return mine
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine)
    return max(int(c) for c in counts)


def append_hang(run_dir: Path, record: dict[str, Any]) -> None:
    """Append one record to ``hangs.jsonl`` in one write on an O_APPEND fd."""
    path = Path(run_dir) / HANGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_hangs(run_dir: Path, attempt: int | None = None) -> list[dict[str, Any]]:
    """Hang records of the job (of one torchrun attempt if given), oldest detection first."""
    try:
        lines = (Path(run_dir) / HANGS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if attempt is None or rec.get("attempt") == attempt:
            out.append(rec)
    return sorted(out, key=lambda r: r["detected_at"])
