"""Helpers shared by the store and coordinator tests (no tests here).

``write_version`` plays the engine for one version on real stores: snapshot each shard,
move the redundancy inputs, encode, complete and commit. ``fake_inventories`` builds the
same picture as pure records for the coordinator.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from baft.store.coding import GroupLayout, Redundancy, group_layouts
from baft.store.manifest import (
    Manifest,
    RankInventory,
    RegionRecord,
    VersionInfo,
    chunk_records,
    region_records,
)
from baft.store.shm import SnapshotStore
from baft.topology import Topology

CHUNK = 64


@contextmanager
def shm_dir() -> Iterator[Path]:
    """A fresh directory on /dev/shm (tmpfs) when present, removed afterwards."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="baft-test-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def shard_sizes(topology: Topology, base: int = 1000) -> dict[int, int]:
    """Distinct, unaligned shard sizes."""
    return {r: base + 37 * r for r in range(topology.world_size)}


def random_shards(sizes: Mapping[int, int], seed: int) -> dict[int, bytes]:
    rng = np.random.default_rng(seed)
    return {r: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for r, n in sizes.items()}


def open_stores(
    root: Path, topology: Topology, red: Redundancy, sizes: Mapping[int, int], job: str = "job"
) -> tuple[dict[int, SnapshotStore], dict[int, GroupLayout]]:
    layouts = group_layouts(topology, red, sizes)
    stores = {}
    for r in range(topology.world_size):
        store = SnapshotStore(root, job, topology.node_of(r), r, 1 << 24)
        store.allocate(sizes[r], layouts[r].redundancy_nbytes(r))
        stores[r] = store
    return stores, layouts


def write_version(
    stores: Mapping[int, SnapshotStore],
    layouts: Mapping[int, GroupLayout],
    topology: Topology,
    version: int,
    shards: Mapping[int, bytes],
    commit: bool = True,
) -> dict[int, int]:
    """Run one checkpoint on real stores; returns rank -> slot."""
    slots = {r: s.begin(version) for r, s in stores.items()}
    for r, s in stores.items():
        s.data_view(slots[r])[:] = np.frombuffer(shards[r], np.uint8)
    for r, s in stores.items():
        layout = layouts[r]
        red = s.red_view(slots[r])
        for region in layout.regions(r):
            ins = [shards[g.rank][g.offset : g.offset + g.nbytes] for g in region.sources]
            layout.encode(
                region.region_id, ins, out=red[region.offset : region.offset + region.nbytes]
            )
    for r, s in stores.items():
        data = s.data_view(slots[r])
        manifest = Manifest.for_layout(
            topology=topology,
            layout=layouts[r],
            rank=r,
            version=version,
            iteration=version,
            owned_start=0,
            owned_stop=data.size,
            chunks=chunk_records(data, CHUNK),
            regions=region_records(s.red_view(slots[r]), layouts[r].regions(r)),
            meta={"rng": r * 1000 + version},
        )
        s.complete(slots[r], manifest)
    if commit:
        for s in stores.values():
            s.commit(version)
    return slots


def fake_info(
    layout: GroupLayout,
    topology: Topology,
    rank: int,
    version: int,
    slot: int,
    state: str = "complete",
    data_ok: bool = True,
    bad_regions: tuple[int, ...] = (),
) -> VersionInfo:
    n = layout.shard_nbytes[layout.members.index(rank)]
    manifest = Manifest.for_layout(
        topology=topology,
        layout=layout,
        rank=rank,
        version=version,
        iteration=version,
        owned_start=0,
        owned_stop=n,
        chunks=chunk_records(np.zeros(n, np.uint8), 1 << 20),
        regions=tuple(
            RegionRecord(g.region_id, g.offset, g.nbytes, 0) for g in layout.regions(rank)
        ),
    )
    complete = state == "complete"
    return VersionInfo(
        version=version,
        slot=slot,
        state=state,
        verified=complete,
        data_ok=complete and data_ok,
        bad_regions=bad_regions,
        problems=(),
        manifest=manifest if complete else None,
    )


def fake_inventories(
    topology: Topology,
    red: Redundancy,
    versions: tuple[int, ...],
    committed: int | None,
    lost_nodes: tuple[int, ...] = (),
    overrides: Mapping[tuple[int, int], dict] | None = None,
) -> dict[int, RankInventory | None]:
    """Every rank holds ``versions`` (slot = version % 2); ``overrides[(rank, version)]``
    passes keyword changes to ``fake_info`` (state, data_ok, bad_regions) or drops it
    with ``{"absent": True}``."""
    layouts = group_layouts(topology, red, shard_sizes(topology))
    overrides = overrides or {}
    out: dict[int, RankInventory | None] = {}
    for r in range(topology.world_size):
        if topology.node_of(r) in lost_nodes:
            out[r] = None
            continue
        infos = []
        for v in sorted(versions, reverse=True):
            extra = dict(overrides.get((r, v), {}))
            if extra.pop("absent", False):
                continue
            infos.append(fake_info(layouts[r], topology, r, v, v % 2, **extra))
        out[r] = RankInventory(r, topology.node_of(r), committed, tuple(infos))
    return out


def test_records_are_reparsed_exactly_when_their_file_was_replaced(tmp_path: Path) -> None:
    """The version log's parsed-record cache: a replaced record is read anew (new bytes,
    same size included), a removed one is gone, and a caller's edits stay its own."""
    from baft.store import versions

    path = tmp_path / "slot0.json"
    parsed = versions._Parsed()
    versions._write_json(path, {"format": versions.FORMAT, "state": "writing", "version": 3})
    first = parsed.load(path)
    assert first is not None and first["version"] == 3
    first["version"] = 99  # the caller's copy
    assert parsed.load(path) == {"format": versions.FORMAT, "state": "writing", "version": 3}
    versions._write_json(path, {"format": versions.FORMAT, "state": "writing", "version": 4})
    again = parsed.load(path)  # same size, another file (os.replace): read anew
    assert again is not None and again["version"] == 4
    path.unlink()
    assert parsed.load(path) is None
