"""The end of a job: free its snapshot stores, or keep them, and say which.

A job that ended cleanly (``ft.close()`` between iterations on every rank, agreed in one
tiny MIN all-reduce) no longer needs host memory for a restart: its stores are freed
unless ``CheckpointConfig.store.keep_on_close`` asks to keep them (the log says whether
the newest committed version is persisted to DCP, i.e. whether freeing lost anything). A job that
did not end (a crash, SIGTERM, a kill, an exception in flight at ``close()``) keeps them
for its restart. Rank 0 records the outcome in the run directory (:data:`~baft.store.records.CLOSED_FILE`),
so that a relaunch that finds no stores can say why (see ``baft.recover.startover``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baft.engine.transport import Transport
from baft.store.disk import latest_version
from baft.store.paths import job_path
from baft.store.records import CLOSED_FILE

log = logging.getLogger("baft")


class JobNotEnded(RuntimeError):
    """``ft.close()`` ran on this rank between iterations, but not every rank ended the job
    with it (a peer died in its last iteration or in ``close()``, or raised). Under
    torchrun's group restart a rank that exits 0 here would leave its peers' agents
    waiting in a rendezvous it never joins, so ``close()`` raises: every agent restarts,
    the job restores its newest committed version and closes again, cleanly."""

    @classmethod
    def because(cls, why_not: str) -> JobNotEnded:
        return cls(
            f"baft: ft.close() found no agreement that the job ended: {why_not}. This rank "
            "exits with an error so that torchrun restarts every rank: the restart restores "
            "the newest committed version and closes again"
        )


def decide(
    finished: bool, committed: int | None, persisted: int | None, keep: bool
) -> tuple[bool, str]:
    """``(free, reason)``: whether a job's stores go at ``close()``. Pure.

    ``finished``: every rank closed between iterations; ``committed``: the newest
    committed version; ``persisted``: the newest complete DCP version (None: none)."""
    if not finished:
        return False, "the job did not end cleanly on every rank (a restart resumes from them)"
    if committed is None:
        return True, "no version was committed"
    saved = persisted is not None and persisted >= committed
    if keep:
        where = "also persisted to DCP" if saved else "not persisted to DCP"
        return False, (
            f"they hold v{committed}, the newest version, {where} (keep_stores_on_close=True)"
        )
    if saved:
        return True, f"v{committed} is persisted"
    return True, (
        f"v{committed}, the newest version, is not persisted to DCP; set "
        "CheckpointConfig.store.keep_on_close=True to keep it in memory"
    )


def agree_finished(transport: Transport, finished: bool, committed: int | None) -> tuple[bool, str]:
    """``(agreed, why not)``: whether every rank closed between iterations with the same
    committed version. Collective over the checkpoint transport; a peer that does not
    answer (gone) is a no."""
    v = -1 if committed is None else committed
    try:
        low, neg_high, ok = transport.all_min_async([v, -v, int(finished)]).wait()
    except (RuntimeError, TimeoutError) as e:
        why = f"a rank did not answer ({e})"
        log.warning("close: no agreement on a clean end: %s: keeping the stores", why)
        return False, why
    if not ok:
        return False, "a rank closed with an exception in flight or inside an iteration"
    if low != -neg_high:
        return False, f"the ranks closed at different committed versions (v{low}..v{-neg_high})"
    return True, ""


def used_bytes(path: Path) -> int:
    """Host memory the files under ``path`` occupy (their allocated blocks)."""
    total = 0
    for f in Path(path).rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_blocks * 512
        except OSError:
            continue
    return total


def end_of_job(
    *,
    transport: Transport,
    finished: bool,
    committed: int | None,
    store_root: str,
    job_id: str,
    persist_dir: str,
    keep: bool,
    run_dir: Path,
    rank: int,
    flush_final: Callable[[], None] | None = None,
) -> tuple[bool, str]:
    """Agree on a clean end, then free this host's stores of the job or keep them;
    rank 0 logs which (with the bytes of its host) and records it in ``run_dir``.
    Collective; call after the last commit, with every store mapping closed. Returns
    whether every rank agreed that the job ended (its stores then freed or kept) and, if
    not, why. ``flush_final`` runs on every rank once they agreed (collective): the
    engine persists the final state there when the cadence owed a version."""
    where = job_path(Path(store_root), job_id)
    size = used_bytes(where) if rank == 0 else 0
    everywhere, why_not = agree_finished(transport, finished, committed)
    if everywhere and flush_final is not None:
        flush_final()
    persisted = latest_version(persist_dir) if persist_dir else None
    free, why = decide(everywhere, committed, persisted, keep)
    # every rank is past its last read of any store (the agreement is the barrier)
    if free:
        shutil.rmtree(where, ignore_errors=True)
    if rank != 0:
        return everywhere, why_not
    mib = size / (1 << 20)
    if free:
        to = f" to {persist_dir}" if persisted is not None and why.endswith("persisted") else ""
        log.info("freed %.1f MiB of stores in %s: %s%s", mib, where, why, to)
    else:
        log.info("kept stores: %.1f MiB in %s: %s", mib, where, why)
    if everywhere:
        record: dict[str, Any] = {
            "committed": committed,
            "freed": free,
            "persisted": persisted,
            "persist_dir": persist_dir,
        }
        path = Path(run_dir) / CLOSED_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)
    return everywhere, why_not
