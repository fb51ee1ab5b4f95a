"""Differential restores: the newest version whose whole rotation window is rebuildable.

Under differential checkpoints (``full_every = k > 1``) a version is rebuilt from the
payloads of its window (:func:`baft.store.records.window_of`, the rule of
:mod:`baft.plan.rotation`), each payload obtained as a full snapshot's shard would be
(one :class:`RecoveryPlan` per payload). What each version's manifest says of its
rotation is a typed :class:`~baft.store.records.DiffMeta`. Versions of full snapshots
pass through unchanged.
"""

from __future__ import annotations

import dataclasses

from baft.engine.transport import Transport
from baft.recover.coordinator import Located, LocatedInventory, RecoveryPlan, coordinate_located
from baft.recover.inventory import HostStores, playing, reinventory, resized, verify_reads
from baft.store.coding import Redundancy
from baft.store.records import DiffMeta
from baft.topology import Topology


@dataclasses.dataclass(frozen=True)
class Window:
    """A differential restore: the payload versions of one rotation window and how to
    obtain each (one RecoveryPlan per version, all from memory)."""

    k: int
    first_version: int
    plans: tuple[RecoveryPlan, ...]


def diff_metas(located: Located) -> dict[int, DiffMeta]:
    """Version -> its differential record (k, slice, first_version, ...) from any manifest."""
    out: dict[int, DiffMeta] = {}
    for loc in located.stores:
        for x in loc.inventory.versions:
            d = DiffMeta.of_meta(x.manifest.meta) if x.manifest is not None else None
            if d is not None:
                out.setdefault(x.version, d)
    return out


def _only(located: Located, version: int) -> list[LocatedInventory]:
    return [
        dataclasses.replace(
            loc,
            inventory=dataclasses.replace(
                loc.inventory,
                versions=tuple(x for x in loc.inventory.versions if x.version == version),
            ),
        )
        for loc in located.stores
    ]


def window_plans(
    topology: Topology, redundancy: Redundancy, located: Located, newest: int
) -> tuple[Window | None, list[str]]:
    """The newest version ``<= newest`` whose whole rotation window every rank can
    rebuild, with a plan per payload; or None and why each candidate failed."""
    meta = diff_metas(located)
    why: list[str] = []
    for v in sorted((u for u in meta if u <= newest), reverse=True):
        d = meta[v]
        win = d.window(v)
        if win is None:
            why.append(f"v={v}: rotation from v{d.first_version} not a whole window of {d.k} old")
            continue
        plans = []
        for u in win:
            other = meta.get(u)
            if not d.same_rotation(other):
                why.append(
                    f"v={v}: payload v{u} is not of the same rotation "
                    f"(k={other.k if other else None}, first_version="
                    f"{other.first_version if other else None}; v{v}: k={d.k}, "
                    f"first_version={d.first_version})"
                )
                break
            p, reason = coordinate_located(topology, redundancy, _only(located, u), located.hosts)
            if p.source != "memory" or p.version != u:
                why.append(f"v={v}: payload v{u} cannot be rebuilt ({reason})")
                break
            plans.append(p)
        else:
            return Window(d.k, d.first_version, tuple(plans)), why
    return None, why


def agree_window(
    stores: HostStores,
    transport: Transport,
    topology: Topology,
    redundancy: Redundancy,
    located: Located,
    plan: RecoveryPlan,
    reason: str,
    persisted: tuple[int, ...],
) -> tuple[RecoveryPlan, str, Window | None]:
    """For differential payloads: the newest version whose whole window is rebuildable
    (verifying the bytes each payload's plan reads; a problem anywhere re-inventories
    with every checksum, as :func:`~baft.recover.inventory.agree` does), else DCP or a
    fresh start. Versions of full snapshots pass through unchanged (window None).
    Collective."""
    if plan.version is None or not diff_metas(located):
        return plan, reason, None
    window, why = window_plans(topology, redundancy, located, plan.version)
    if window is not None:
        ranks = playing(located, transport.rank)
        problems = [m for p in window.plans for r in ranks for m in verify_reads(stores, r, p)]
        if any(transport.all_gather_object(problems)):
            resize = located.resize
            if resize is None:
                located = reinventory(stores, transport, located)
            else:  # inventoried by the current ranks, planned for the logical ones
                phys = reinventory(stores, transport, Located(dict(resize.physical_hosts), []))
                located = resized(phys, resize.new, resize.num_replicas, transport.rank)
            window, why = window_plans(topology, redundancy, located, plan.version)
    if window is not None:
        v = window.plans[-1]
        bases = f"payloads v{window.plans[0].version}..v{v.version} (full_every={window.k})"
        return v, f"v={v.version} from memory, differential: {bases}", window
    detail = "; ".join(why) or "no differential payloads"
    if persisted:
        version = max(persisted)
        return (
            RecoveryPlan(version=version, source="disk"),
            (
                f"v={version} from disk (newest persisted): no rotation window rebuildable "
                f"from memory ({detail})"
            ),
            None,
        )
    return (
        RecoveryPlan(version=None, source="fresh"),
        f"fresh start: no rotation window rebuildable from memory ({detail})",
        None,
    )
