"""Shard identity before a restore writes a byte (pure).

Every shard a store holds (its manifest's ``meta["layouts"]``) and every persisted DCP
checkpoint (``baft_meta.json``'s ``layouts``) records the layout digest of every
``(pp, tp)`` of the job that wrote it: a sha256 over each tensor's name, dtype, global
and local shape, placements and local offset
(:attr:`~baft.pipeline.state.TrainingState.layout_digest`). A restore compares the
digest recorded for its own ``(pp, tp)`` with its live state's before it loads anything
(:func:`check_identity`), so bytes never land in a tensor that is not the one they were
saved from (a changed model, other placements, another TP split). Records written before
digests were kept carry none and are not checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from baft.errors import Refusal

__all__ = ["ShardIdentityError", "check_identity", "layout_key", "shard_records"]


class ShardIdentityError(ValueError, Refusal):
    """Restored bytes were saved from tensors other than the live ones."""


def layout_key(pp: int, tp: int) -> str:
    """The key of a ``(pp, tp)``'s digest in the recorded maps."""
    return f"pp{pp}.tp{tp}"


def shard_records(
    stores: Iterable[Any], versions: Iterable[int]
) -> list[tuple[str, Mapping[str, str] | None]]:
    """``(where, layouts)`` of every complete manifest of ``versions`` in ``stores``
    (:class:`~baft.recover.coordinator.LocatedInventory`)."""
    wanted = set(versions)
    out = []
    for loc in stores:
        for v in loc.inventory.versions:
            m = v.manifest
            if v.version in wanted and m is not None:
                where = f"the v{v.version} shard of rank {m.rank} (store {loc.store})"
                out.append((where, m.meta.get("layouts")))
    return out


def check_identity(
    records: Iterable[tuple[str, Mapping[str, str] | None]], key: str, digest: str
) -> None:
    """Raise :class:`ShardIdentityError` unless every record's digest for ``key`` is
    ``digest`` (records without digests pass: written before they were kept)."""
    for where, layouts in records:
        if not layouts:
            continue
        saved = layouts.get(key)
        if saved == digest:
            continue
        what = (
            f"records no layout for {key} (saved by a job with another mesh)"
            if saved is None
            else f"was saved from other tensors than {key}'s live state (layout digest "
            f"{saved[:12]}, now {digest[:12]})"
        )
        raise ShardIdentityError(
            f"{where} {what}: names, dtypes, global or local shapes, placements or "
            "offsets differ; nothing was restored. Restore with the model, optimizer and "
            "device_mesh the checkpoint was saved with, or start a new run (another "
            "run_dir / job_id)"
        )
