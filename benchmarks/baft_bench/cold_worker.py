"""The training worker with a cold page cache for its checkpoint files.

``python -m baft_bench.cold_worker CONFIG_JSON`` (launched by the recovery bench in
place of ``baft.train.worker``, see :mod:`baft_bench.recovery`): before this process
imports torch or joins the group, it drops every file of the run's DCP checkpoint
directory from the page cache (``posix_fadvise(DONTNEED)``), then runs the training
worker as usual. A process that torchrun restarts after a power loss therefore loads its
checkpoint from the disk, not from pages the previous attempt just wrote: the eviction
of every rank is done before any rank reads, since the restore comes after the
rendezvous all ranks join.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def evict_page_cache(directory: Path) -> int:
    """Drop the clean pages of every file under ``directory`` from the page cache;
    returns the number of files (0 when the directory does not exist yet)."""
    count = 0
    for f in sorted(directory.rglob("*")) if directory.is_dir() else []:
        if not f.is_file():
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


def persist_dir(config_json: Path) -> Path | None:
    """The DCP checkpoint directory of the run whose worker config is ``config_json``
    (``launch`` writes it there; None when the run does not persist)."""
    from baft.train.config import TrainConfig

    ck = TrainConfig.from_dict(json.loads(config_json.read_text())).checkpoint
    return Path(ck.persist.dir) if ck is not None and ck.persist.dir else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    where = persist_dir(Path(argv[0]))
    if where is not None:
        evict_page_cache(where)
    from baft.train.worker import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
