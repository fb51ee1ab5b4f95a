"""A restore into a fake :class:`~baft.recover.restorable.Restorable`: no engine, no processes.

One rank (an in-process :class:`LocalTransport` group of one) with a real
:class:`SnapshotStore` in a temporary directory that holds committed versions, written
through the store API as the engine leaves them. :func:`recover_and_start` runs against
a fake that records what recovery does to it: the bytes it writes, the small state it
applies, the versions it forgets, how it starts. The restored bytes must be the newest
committed version's, bit for bit, in the fake's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from baft.engine.local_transport import LocalTransport
from baft.engine.transport import Transport
from baft.plan.types import TensorSpec
from baft.recover.differential import RestoreError
from baft.recover.identity import ShardIdentityError
from baft.recover.restorable import FaultHook, Restorable
from baft.recover.runtime import recover_and_start
from baft.store.coding import Redundancy, group_layouts
from baft.store.disk import PersistKeys, ShardLayout
from baft.store.manifest import Manifest, chunk_records, region_records
from baft.store.records import PlanInput
from baft.store.shm import SnapshotStore
from baft.topology import Topology

TOPO = Topology(num_dp=1, ranks_per_node=1)
RED = Redundancy.parse("none")
JOB = "job"
SHAPES = {"model.w": (37, torch.float32), "optim.w.step": (5, torch.int64)}
NBYTES = 37 * 4 + 5 * 8


def _bytes(version: int) -> np.ndarray:
    """The flat state of ``version`` (every tensor's bytes, end to end)."""
    return np.random.default_rng(version).integers(0, 256, NBYTES, dtype=np.uint8)


class FakeFlat:
    """Two live tensors as one byte range; records every write."""

    def __init__(self, events: list[Any]) -> None:
        self.names = list(SHAPES)
        self.tensors = [torch.zeros(n, dtype=d) for n, d in SHAPES.values()]
        self.nbytes = NBYTES
        self.events = events

    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(name=n, nbytes=t.numel() * t.element_size())
            for n, t in zip(self.names, self.tensors, strict=True)
        )

    def write_from(self, start: int, data: torch.Tensor) -> None:
        self.events.append(("write", start, data.numel()))
        pos = 0
        for t in self.tensors:
            raw = t.view(torch.uint8)
            lo, hi = max(start, pos), min(start + data.numel(), pos + raw.numel())
            if lo < hi:
                raw[lo - pos : hi - pos].copy_(data[lo - start : hi - start])
            pos += raw.numel()

    def content(self) -> bytes:
        return b"".join(bytes(t.view(torch.uint8).numpy()) for t in self.tensors)


class FakeState:
    """The live objects: only the layout check is called on a restore from memory."""

    def __init__(self, flat: FakeFlat, events: list[Any]) -> None:
        self.flat, self.events = flat, events
        self.param = torch.nn.Parameter(torch.zeros(2))
        self._optimizer = torch.optim.SGD([self.param], lr=0.1)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.flat.names, self.flat.tensors, strict=True))

    def named_params(self) -> dict[str, torch.Tensor]:
        return {"w": self.param}

    def apply(self) -> None:
        self.events.append("state.apply")

    def check_layout(self, saved: list[tuple[str, int]]) -> None:
        self.events.append(("check_layout", saved))


@dataclass
class FakeEngine:
    """Everything :class:`Restorable` names, recording what recovery does."""

    store: SnapshotStore
    transport: Transport
    run_dir: Path
    rank: int = 0
    topology: Topology = TOPO
    redundancy: Redundancy = RED
    location: str | None = "host-a"
    injector: FaultHook | None = None
    persist_dir: str | None = None
    persist_keys: PersistKeys = PersistKeys()
    persist_layouts: Mapping[str, ShardLayout] = field(default_factory=dict)
    allow_fresh_start: bool = False
    first_checkpoint_by: int = 0
    layout_digests: Mapping[str, str] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.flat = FakeFlat(self.events)
        self.state = FakeState(self.flat, self.events)

    def apply_small_state(self) -> None:
        self.events.append("apply_small_state")

    def forget_versions(self) -> None:
        self.events.append("forget_versions")
        self.store.clear_versions()

    def start(
        self,
        resume_iteration: int,
        restored_version: int | None = None,
        first_version: int | None = None,
        rotation_k: int | None = None,
    ) -> None:
        self.events.append(("start", resume_iteration, restored_version, first_version, rotation_k))


def _open(root: Path) -> SnapshotStore:
    return SnapshotStore(root, JOB, 0, 0, 1 << 22)


def _write(store: SnapshotStore, version: int, *, finish: bool = True, meta: Any = None) -> None:
    """What the engine leaves in the store for one version (no redundancy: one rank)."""
    layout = group_layouts(TOPO, RED, {0: NBYTES})[0]
    slot = store.begin(version)
    store.data_view(slot)[:NBYTES] = _bytes(version)
    if not finish:
        return
    manifest = Manifest.for_layout(
        topology=TOPO, layout=layout, rank=0, version=version, iteration=version,
        owned_start=0, owned_stop=NBYTES,
        chunks=chunk_records(store.data_view(slot)[:NBYTES], 64),
        regions=region_records(store.red_view(slot), layout.regions(0)),
        meta=meta,
    )  # fmt: skip
    store.complete(slot, manifest)
    store.commit(version)


def _engine(
    tmp_path: Path, versions: Sequence[int], meta: dict[str, Any] | None = None, **kw: Any
) -> FakeEngine:
    """A fake over a store holding committed ``versions`` (the newest with ``meta``) and
    the next one in flight."""
    store = _open(tmp_path / "shm")
    store.allocate(NBYTES, 0)
    for v in versions:
        _write(store, v, meta=meta if v == versions[-1] else None)
    _write(store, versions[-1] + 1 if versions else 0, finish=False)  # in flight at the crash
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (transport,) = LocalTransport.group(1)
    return FakeEngine(store=store, transport=transport, run_dir=run_dir, **kw)


def _recover(engine: Restorable) -> tuple[int, Any]:
    return recover_and_start(engine, engine.run_dir, t_launch=0.0, t_rdzv=0.0)


def test_a_committed_version_is_restored_bit_exactly_into_the_fake(tmp_path: Path) -> None:
    engine = _engine(tmp_path, [3, 4])
    layout = {"tensors": [[n, s.nbytes] for n, s in zip(SHAPES, engine.flat.specs(), strict=True)]}
    PlanInput(ranks=[{"bubbles": {}, "layout": layout}], cost={}).save(engine.run_dir)
    assert engine.flat.content() != _bytes(4).tobytes()

    resume, report = _recover(engine)

    assert resume == 4
    assert engine.flat.content() == _bytes(4).tobytes()
    assert engine.events == [
        ("check_layout", [("model.w", 148), ("optim.w.step", 40)]),
        ("write", 0, NBYTES),
        "apply_small_state",
        ("start", 4, 4, None, None),
    ]
    assert report is not None
    assert (report.record["source"], report.record["restored_version"]) == ("memory", 4)
    assert report.record["sources"] == {"0": "local"}
    assert report.record["hosts"] == {"0": "host-a"}


def test_a_fresh_job_only_starts(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    (transport,) = LocalTransport.group(1)
    (tmp_path / "run").mkdir()
    engine = FakeEngine(store=_open(root), transport=transport, run_dir=tmp_path / "run")
    assert _recover(engine) == (0, None)
    assert engine.events == [("start", 0, None, None, None)]


def test_nothing_restorable_forgets_the_stores_versions_when_allowed(tmp_path: Path) -> None:
    """Only a version in flight (never committed): starting over is allowed here, and the
    store forgets it before the engine starts at iteration 0."""
    engine = _engine(tmp_path, [], allow_fresh_start=True)
    resume, report = _recover(engine)
    assert resume == 0 and report is not None and report.record["source"] == "fresh"
    assert engine.events == ["forget_versions", ("start", 0, None, None, None)]
    assert engine.store.inventory(verify=False).versions == ()
    engine.allow_fresh_start = False
    _write(engine.store, 7, finish=False)
    (engine.run_dir / "progress").mkdir()
    (engine.run_dir / "progress" / "rank0").write_text("7")
    with pytest.raises(RestoreError, match="refusing to start over silently"):
        _recover(engine)


def test_shards_of_other_tensors_are_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    engine = _engine(
        tmp_path, [3], meta={"layouts": {"pp0.tp0": "a" * 64}}, layout_digests={"pp0.tp0": "b" * 64}
    )
    with pytest.raises(ShardIdentityError, match="saved from other tensors"):
        _recover(engine)
    assert not [e for e in engine.events if e[0] in ("write", "start")]
    assert engine.flat.content() == bytes(NBYTES)
