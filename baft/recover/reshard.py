"""A DCP restore into another shard layout (a job restarted with another ``dp_shard`` or
TP degree, or another number of replicas' worth of ranks).

Memory cannot serve a changed layout: a stored shard is the bytes of one rank's pieces.
A persisted checkpoint can: its parameters and optimizer state are DTensors with their
global placements, so ``dcp.load`` into the live DTensors reshards them
(:func:`load_resharded`). :func:`layout_change` tells whether a checkpoint was written
by another layout (the ``pp<p>.tp<t>`` keys of its recorded layout digests differ from
the job's); the pipeline degree must stay (a stage's records and optimizer param groups
are per stage).

**Small per-rank state** (``extra.pp<p>.tp<t>.*``) cannot be resharded. The rule, checked
before a byte of the model is loaded:

- ``state=`` objects, SGD's created-momentum flags and the optimizer hyperparameters are
  per stage: each rank takes those of shard rank 0 of its stage (``extra.pp<p>.tp0.*``),
  and only when every saved shard rank of the stage recorded the same value; otherwise a
  ValueError names the records that differ (a per-rank data loader state, say): such
  state cannot be mapped onto another number of ranks.
- RNG states (``extra.pp<p>.tp<t>.rng.*``) are per-rank streams: they are not restored;
  every rank keeps the generator state it had when ``baft.protect`` returned (its own
  seeding), and the recovery record says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from baft.pipeline.encoding import encode_value
from baft.pipeline.state import check_param_group_hypers, decode_record, load_param_group_hypers
from baft.plan import names
from baft.recover.restorable import Restorable
from baft.store.disk import ShardLayout, load_version
from baft.store.keys import PersistKeys

__all__ = ["RNG_NOTE", "layout_change", "load_resharded"]

RNG_NOTE = "RNG states not restored (per-rank streams cannot be resharded)"
_KEY = re.compile(r"^pp(\d+)\.tp(\d+)$")


def _coords(layouts: Mapping[str, str]) -> dict[int, list[int]]:
    """pp -> sorted shard coordinates of recorded layout keys ``pp<p>.tp<t>``."""
    out: dict[int, list[int]] = {}
    for key in layouts:
        m = _KEY.match(key)
        if m is not None:
            out.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return {p: sorted(t) for p, t in out.items()}


def layout_change(saved: Mapping[str, str] | None, mine: Mapping[str, str]) -> str | None:
    """Why checkpoint layouts ``saved`` (``"pp<p>.tp<t>"`` -> digest) are another shard
    layout than the job's ``mine``, or None when they are the same one (then a restore is
    checked rank by rank, as from memory). ValueError when the pipeline degree changed."""
    if not saved or not mine or set(saved) == set(mine):
        return None
    was, now = _coords(saved), _coords(mine)
    if sorted(was) != sorted(now):
        raise ValueError(
            f"the checkpoint was written by {len(was)} pipeline stages, this job has "
            f"{len(now)}: baft restores another shard degree, not another pipeline split "
            "(load it with plain dcp.load, see docs/fsdp2-dcp.md)"
        )
    degrees = ", ".join(f"pp{p}: {len(was[p])} -> {len(now[p])}" for p in sorted(now))
    return (
        f"the job's shard layout changed (shard ranks per stage {degrees}): memory cannot "
        f"serve a changed layout, DCP reshards the checkpoint into the live DTensors; {RNG_NOTE}"
    )


def _record_plan(
    engine: Restorable, keys: PersistKeys, saved_shards: list[int]
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]], dict[str, torch.Tensor]]:
    """(every other tensor by DCP key, record rest -> the saved keys of every shard rank,
    scratch tensors for those saved records by key)."""
    c = engine.topology.coords(engine.rank)
    mine = names.extra_prefix(c.pp, c.tp)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, list[str]] = {}
    scratch: dict[str, torch.Tensor] = {}
    for n, t in zip(engine.flat.names, engine.flat.tensors, strict=True):
        if not n.startswith(mine):
            tensors[keys(n)] = t
            continue
        rest = n[len(mine) :]
        if rest.startswith("rng."):  # per-rank streams: not restored
            continue
        records[rest] = [names.extra_prefix(c.pp, tp) + rest for tp in saved_shards]
        for key in records[rest]:
            scratch[key] = torch.empty_like(t)
    return tensors, records, scratch


def _check_equal(records: Mapping[str, list[str]], scratch: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError naming the records whose value differs between saved shard ranks
    (the optimizer record by its hyperparameters, class and state keys: its layout
    digest is per rank by design)."""

    def value(key: str, rest: str) -> Any:
        if rest.startswith("meta."):
            meta = decode_record(scratch[key])
            return encode_value([meta["optimizer"], meta["state_keys"], meta["hypers"]])
        return scratch[key].numpy().tobytes()

    differ = []
    for rest, saved in records.items():
        first = value(saved[0], rest)
        differ += [k for k in saved[1:] if value(k, rest) != first]
    if differ:
        raise ValueError(
            f"per-rank state cannot be resharded: {', '.join(differ)} differ from shard "
            f"rank 0's record of the stage in the checkpoint (a state= object whose "
            "state_dict() depends on the rank?); nothing was loaded. Restore with the shard "
            "degree it was saved with, or load it with plain dcp.load (docs/fsdp2-dcp.md)"
        )


def _check_optimizer(
    records: Mapping[str, list[str]],
    scratch: Mapping[str, torch.Tensor],
    live: Mapping[str, torch.Tensor],
    mine: str,
) -> None:
    """Raise ValueError unless the saved optimizer record names this job's optimizer class
    and ``state=`` keys (the rest of it is per rank)."""
    for rest, keys in records.items():
        if rest.startswith("meta."):
            was, now = decode_record(scratch[keys[0]]), decode_record(live[mine + rest])
            for field in ("optimizer", "state_keys"):
                if was[field] != now[field]:
                    raise ValueError(
                        f"the checkpoint's {field} is {was[field]!r}, this job's "
                        f"{now[field]!r}; nothing was loaded"
                    )


def load_resharded(
    engine: Restorable,
    directory: str,
    version: int,
    *,
    saved: Mapping[str, str],
    keys: PersistKeys,
    layouts: Mapping[str, ShardLayout],
    group: Any,
) -> None:
    """Load checkpoint ``version`` (recorded layouts ``saved``, DCP ``keys``) into
    ``engine``'s live state under another shard layout (``layouts``: the DTensor of
    every sharded key): records checked first (see the
    module docstring), then DCP reshards parameters and optimizer state into the live
    DTensors, then the small state is applied. Collective over ``group`` (two
    ``dcp.load`` calls)."""
    c = engine.topology.coords(engine.rank)
    mine = names.extra_prefix(c.pp, c.tp)
    live = dict(zip(engine.flat.names, engine.flat.tensors, strict=True))
    tensors, records, scratch = _record_plan(engine, keys, _coords(saved).get(c.pp, [0]))
    with torch.no_grad():
        load_version(directory, version, scratch, process_group=group)
        _check_equal(records, scratch)
        _check_optimizer(records, scratch, live, mine)
        load_version(directory, version, tensors, process_group=group, layouts=layouts)
        for rest, saved_keys in records.items():
            if not rest.startswith("meta."):  # the live record keeps this job's layout digest
                live[mine + rest].copy_(scratch[saved_keys[0]])
    engine.apply_small_state()
    meta_rest = [r for r in records if r.startswith("meta.")]
    if meta_rest:
        hypers = decode_record(scratch[records[meta_rest[0]][0]])["hypers"]
        optimizer = engine.state.optimizer
        check_param_group_hypers(optimizer, hypers)
        load_param_group_hypers(optimizer, hypers)
