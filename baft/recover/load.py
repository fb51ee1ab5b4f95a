"""Loading a restored version into a :class:`~baft.recover.restorable.Restorable`.

- :func:`load_from_shards`: a full snapshot from memory: this rank's rebuilt shard and
  its DP replicas' shards, exchanged point to point, written into the live tensors.
- :func:`load_window`: a differential version: every payload of its window rebuilt and
  assembled, then the newest slices loaded and the gradient records replayed
  (:func:`baft.recover.differential.rebuild_from_payloads`).
- :func:`load_from_disk`: a DCP checkpoint of the disk tier (:mod:`baft.store.disk`),
  resharded when the job's shard layout changed (:mod:`baft.recover.reshard`).

Each ends by applying the small state (RNG, hyperparameters, ``state=`` objects), which
travels inside the flat state; the data position is the version itself.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from baft.plan.payload import PayloadLayout
from baft.recover.coordinator import RecoveryPlan
from baft.recover.differential import DeferredState, RestoreError, rebuild_from_payloads
from baft.recover.inventory import HostStores
from baft.recover.reshard import load_resharded
from baft.recover.resize import Resize
from baft.recover.restorable import Restorable
from baft.recover.transfer import (
    assemble_resized,
    exchange_replicas,
    rebuild_shard,
    rebuild_shards,
)
from baft.recover.window import Window
from baft.store.disk import load_version, read_metadata, version_dir
from baft.store.keys import loading_keys


def load_from_shards(engine: Restorable, plan: RecoveryPlan, shard: np.ndarray) -> None:
    """Assemble the full flat state from the DP replicas' shards and load it. Collective."""
    replicas = engine.topology.replicas(engine.rank)
    _check_total(engine, plan, [plan.shard_nbytes[r] for r in replicas], engine.flat.nbytes)
    with torch.no_grad():  # straight into the live tensors
        exchange_replicas(
            engine.transport, engine.topology, engine.rank, plan, shard, engine.flat.write_from
        )
    engine.apply_small_state()


def load_resized(
    engine: Restorable, stores: HostStores, resize: Resize, plan: RecoveryPlan
) -> None:
    """After a resize (:mod:`baft.recover.resize`): rebuild the shards of the logical ranks
    this rank plays, assemble its stage's flat state from its stage's logical shards and
    load it. Collective."""
    shards = _played_shards(engine, stores, resize, plan)
    lgs = resize.stage_shards(engine.topology, engine.rank)
    _check_total(engine, plan, [plan.shard_nbytes[lg] for lg in lgs], engine.flat.nbytes)
    with torch.no_grad():
        assemble_resized(
            engine.transport, engine.topology, resize, engine.rank, plan, shards,
            engine.flat.write_from,
        )  # fmt: skip
    engine.apply_small_state()


def _played_shards(
    engine: Restorable, stores: HostStores, resize: Resize, plan: RecoveryPlan
) -> dict[int, np.ndarray]:
    played = resize.played_by(engine.rank)
    return rebuild_shards(stores, engine.transport, played, plan, resize.to_physical)


def _check_total(engine: Restorable, plan: RecoveryPlan, sizes: list[int], nbytes: int) -> None:
    if sum(sizes) != nbytes:
        raise RestoreError(
            f"rank {engine.rank}: shards of v{plan.version} cover {sum(sizes)} bytes, "
            f"state has {nbytes}"
        )


def rebuild_payload(
    engine: Restorable, stores: HostStores, plan: RecoveryPlan, resize: Resize | None = None
) -> torch.Tensor:
    """The whole stage's payload of ``plan.version``: this rank's shard (local, replica or
    decoded) and the DP replicas' shares, assembled (after a resize: the shards of the
    old job's ranks of this stage). Collective.

    A rank that is its stage's only replica holds the whole payload in its shard: that
    is returned as it is (for a local shard, a view of the store's read mapping, which is
    private: nothing written into it reaches the store), not copied into a new buffer."""

    def write(pos: int, piece: torch.Tensor) -> None:
        out[pos : pos + piece.numel()].copy_(piece)

    if resize is not None:
        shards = _played_shards(engine, stores, resize, plan)
        lgs = resize.stage_shards(engine.topology, engine.rank)
        out = torch.empty(sum(plan.shard_nbytes[lg] for lg in lgs), dtype=torch.uint8)
        assemble_resized(
            engine.transport, engine.topology, resize, engine.rank, plan, shards, write
        )
        return out
    shard = rebuild_shard(stores, engine.transport, engine.rank, plan)
    replicas = engine.topology.replicas(engine.rank)
    if replicas == (engine.rank,):
        if shard.size != plan.shard_nbytes[engine.rank]:
            raise RestoreError(
                f"rank {engine.rank}: shard of v{plan.version} has {shard.size} bytes, "
                f"the plan says {plan.shard_nbytes[engine.rank]}"
            )
        return torch.from_numpy(shard)
    total = sum(plan.shard_nbytes[r] for r in replicas)
    out = torch.empty(total, dtype=torch.uint8)
    exchange_replicas(engine.transport, engine.topology, engine.rank, plan, shard, write)
    return out


def load_window(
    engine: Restorable, window: Window, payloads: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """Newest slices + replayed records into the live state, then the small state;
    returns what was done (bases, steps replayed, seconds)."""
    layout = PayloadLayout.of(engine.flat.specs(), window.k)
    v = window.plans[-1].version
    assert v is not None
    t0 = time.time()
    state = engine.state
    done = rebuild_from_payloads(
        layout, payloads, v, window.first_version, dict(state.named_tensors()),
        state.optimizer, state.named_params(),
        deferred=state if isinstance(state, DeferredState) else None,
    )  # fmt: skip
    engine.apply_small_state()
    done["seconds"] = round(time.time() - t0, 6)
    return done


def load_from_disk(
    engine: Restorable, plan: RecoveryPlan, directory: str, resharded: bool = False
) -> None:
    """Load DCP checkpoint ``plan.version`` of ``directory`` into the live tensors (its
    key scheme checked first); ``resharded``: it was written by another shard layout
    (:mod:`baft.recover.reshard`). Collective over the transport's process group."""
    assert plan.version is not None
    where = version_dir(directory, plan.version)
    meta = read_metadata(directory, plan.version)
    key = loading_keys(meta, engine.persist_keys, str(where))
    group = getattr(engine.transport, "group", None)  # a torch transport's process group
    own = engine.persist_keys
    layouts = {  # by the keys read (an older scheme names optimizer state otherwise)
        key(n): engine.persist_layouts[own(n)]
        for n in engine.flat.names
        if own(n) in engine.persist_layouts
    }
    if resharded:
        load_resharded(
            engine, directory, plan.version, saved=meta.get("layouts") or {}, keys=key,
            layouts=layouts, group=group,
        )  # fmt: skip
        return
    flat = engine.flat
    state = {key(n): t for n, t in zip(flat.names, flat.tensors, strict=True)}
    with torch.no_grad():
        load_version(directory, plan.version, state, process_group=group, layouts=layouts)
    engine.apply_small_state()
