"""Whether a job that can restore nothing may start over from iteration 0.

A job that made progress never starts over silently: that is an error unless nothing
could ever have been restored (the job ended before its first checkpoint, or inside its
first differential rotation before any committed version was a whole window old), or
the user allowed it. Pure reads of what the agreement located; no collectives.
"""

from __future__ import annotations

import logging
from pathlib import Path

from baft.errors import refusal
from baft.recover.coordinator import Located, RecoveryPlan
from baft.recover.differential import RestoreError
from baft.recover.report import progress_seen
from baft.recover.window import diff_metas
from baft.store.records import read_closed

log = logging.getLogger("baft")


def young_first_rotation(located: Located, began_by: int) -> tuple[int, int, int] | None:
    """``(first_version, newest, k)`` when the stores hold only the differential rotation
    the job began with (first version before ``began_by``: profiling plus one interval)
    and no committed version of it is a whole window old: no version was ever
    rebuildable, so starting over loses only the iterations since the job began. A newer
    version written but never committed (the crash came during its exchange) does not
    count: it was never restorable. None otherwise."""
    meta = diff_metas(located)
    if not meta:
        return None
    newest = max(meta)
    rotation = meta[newest]
    k, first = rotation.k, rotation.first_version
    told = [x.inventory.committed for x in located.stores if x.inventory.committed is not None]
    committed = max(told) if told else None  # the newest any rank was told was committed
    if first >= began_by:
        return None
    if committed is not None and committed >= first and rotation.window(committed) is not None:
        return None
    return first, newest, k


def _never_restorable(located: Located, shards: bool, done: int, began_by: int, rank: int) -> bool:
    """Whether nothing could ever have been restored, so starting over loses only the
    iterations since the job began (logged on rank 0): the job ended before its first
    checkpoint, or inside its first differential rotation (:func:`young_first_rotation`)."""
    if not shards and done <= began_by:
        if rank == 0:
            log.warning(
                "starting over from iteration 0, losing %d iteration(s): the job ended "
                "before its first checkpoint",
                done,
            )
        return True
    young = young_first_rotation(located, began_by) if shards else None
    if young is None or done > young[1] + 2:
        return False
    first, newest, k = young
    if rank == 0:
        log.warning(
            "starting over from iteration 0, losing %d iteration(s): the job's "
            "differential checkpoints began at v%d and no committed version up to v%d "
            "is a whole window of %d payloads old, so no version was rebuildable",
            done,
            first,
            newest,
            k,
        )
    return True


def never_silently_fresh(
    plan: RecoveryPlan,
    reason: str,
    located: Located,
    run_dir: Path,
    allow_fresh_start: bool,
    rank: int,
    *,
    began_by: int = 0,
) -> None:
    """A job that made progress never starts over without saying so: falling back to DCP
    while stores hold snapshots is logged loudly (with why each memory version failed), and
    a fresh start after progress raises unless ``allow_fresh_start``, or unless nothing
    could have been rebuildable yet: the job ended before its first checkpoint (progress
    within ``began_by`` iterations: profiling plus one interval, and no snapshot), or its
    only snapshots are the first differential rotation, not a whole window old (see
    :func:`young_first_rotation`). Then it starts over, logged, losing only the
    iterations since the job began. Same outcome on every rank (all see the same plan and
    run directory)."""
    shards = located.holds_shards()
    if plan.source == "disk" and shards and rank == 0:
        log.warning("snapshots in memory cannot be restored, falling back to DCP: %s", reason)
    if plan.source != "fresh":
        return
    done = progress_seen(run_dir)
    if not shards and not done:
        return
    seen = []
    if done:
        seen.append(f"{run_dir} records progress up to iteration {done - 1}")
    if shards:
        where = sorted({str(loc.store) for loc in located.stores if loc.inventory.versions})
        seen.append(f"stores hold snapshots of the job ({', '.join(where)})")
    if _never_restorable(located, shards, done, began_by, rank):
        return
    closed = None if shards else read_closed(run_dir)
    if closed and closed.get("freed") and done <= int(closed.get("committed") or 0) + 1:
        seen = [
            f"the job ended cleanly at iteration {done - 1} and close() freed its stores "
            f"(v{closed.get('committed')} was not persisted to DCP; "
            "CheckpointConfig.store.keep_on_close was False)"
        ]
        reason = "no DCP checkpoint of the newest version"
    if allow_fresh_start:
        if rank == 0:
            log.warning(
                "starting over from iteration 0 as allowed (allow_fresh_start): %s; %s",
                " and ".join(seen),
                reason,
            )
        return
    keep = (
        ", keep_stores_on_close=True to continue a finished job from memory,"
        if closed and closed.get("freed")
        else ""
    )
    raise refusal(
        RestoreError(
            f"refusing to start over silently: {' and '.join(seen)}, but nothing can be "
            f"restored ({reason}). Keep DCP checkpoints (persist_every) to fall back on{keep} or "
            "set CheckpointConfig.allow_fresh_start=True to start from iteration 0."
        )
    )
