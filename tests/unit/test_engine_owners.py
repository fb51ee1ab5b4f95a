"""The engine's owners on their own: the rotation's layouts and windows, the persist
cadence. No processes, no threads, no store."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from baft.config import CheckpointConfig
from baft.engine.differential import RecordCapture
from baft.engine.flat import FlatState
from baft.engine.persisting import Persisting
from baft.engine.rotation import Rotation
from baft.plan.inputs import bmap_to_json, layout_to_json
from baft.plan.types import BubbleMap, Slot, StateLayout
from baft.store.coding import Redundancy
from baft.store.disk import PersistKeys
from baft.store.records import PlanInput
from baft.topology import Topology


def _persisting(every: int, interval: int = 1) -> Persisting:
    flat = FlatState([("model.w", torch.zeros(4))])
    return Persisting(
        object(),  # type: ignore[arg-type]  # a persister: only its presence matters here
        every=every, interval=interval, keys=PersistKeys(), topology=Topology(1, 1, 1),
        rank=0, flat=flat, device=torch.device("cpu"), layout_digests={},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("every", "interval", "due"),
    [(3, 1, [0, 3, 6, 9]), (2, 2, [0, 4, 8]), (1, 3, [0, 3, 6, 9]), (0, 1, [])],
)
def test_persist_cadence_counts_checkpoints_from_version_zero(
    every: int, interval: int, due: list[int]
) -> None:
    """One rule for full snapshots, the differential live copy and a restarted process:
    the ``persist_every``-th checkpoint counted from version 0, so a job restarted at
    v7 persists the same versions as one that never failed."""
    assert [v for v in range(11) if _persisting(every, interval).due(v)] == due
    restarted = _persisting(every, interval)
    assert [v for v in range(7, 11) if restarted.due(v)] == [v for v in due if v >= 7]


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)


def _rotation(full_every: int) -> tuple[Rotation, PlanInput]:
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    named: list[tuple[str, Any]] = [(f"model.{n}", p.data) for n, p in model.named_parameters()]
    named += [(f"optim.{n}.exp_avg", torch.zeros_like(p)) for n, p in model.named_parameters()]
    ck = CheckpointConfig.parse(f"redundancy=none,persist=0,full_every={full_every}")
    topo = Topology(1, 1, 1)
    flat = FlatState(named)
    rot = Rotation(
        ck, rank=0, topology=topo, redundancy=Redundancy.parse("none"), flat=flat, named=named
    )
    slots = (Slot("w0", 0.05), Slot("pre_step", 0.001, kind="pre_step"))
    layout = StateLayout(rank=0, tensors=flat.specs(), replicas=(0,))
    plan_input = PlanInput(
        ranks=[
            {"bubbles": bmap_to_json(BubbleMap(0, slots, 0.2)), "layout": layout_to_json(layout)}
        ],
        cost={"copy_Bps": 2e9, "net_Bps": 1e9, "encode_Bps": 2e9, "persist_Bps": 1e9},
        world_size=1,
    )
    params = dict(model.named_parameters())
    rot.begin(5, None, None, RecordCapture(opt, params) if full_every > 1 else None)
    return rot, plan_input


def test_rotation_hands_out_one_layout_and_windows() -> None:
    rot, plan_input = _rotation(3)
    assert rot.plan_iteration == 5 + rot.ck.profile_iters
    assert rot.adopt(plan_input) is False  # the first plan: no rotation to end
    lay = rot.layout
    assert lay is not None and lay.k == 3 and lay.payload is not None
    assert lay.sizes == (lay.schedule.nbytes, 0, 4) and rot.plan_iteration == -1
    with pytest.raises(AttributeError):
        lay.k = 2  # type: ignore[misc]  # immutable: a new plan is a new layout
    assert list(rot.open_version(8)) == [] and rot.first_version == 8
    assert list(rot.open_version(9)) == [8] and list(rot.open_version(12)) == [9, 10, 11]
    meta = rot.diff_meta(12, has_record=True)
    assert meta is not None and (meta.k, meta.slice, meta.first_version) == (3, 0, 8)
    assert meta.window(12) == range(10, 13) and meta.window(9) is None
    # a re-plan keeps k (and the rotation); the input records that it ran
    assert rot.adopt(plan_input) is False and rot.layout is not lay and rot.k == 3
    assert rot.first_version == 8


def test_full_snapshots_keep_no_record_and_no_window() -> None:
    rot, plan_input = _rotation(1)
    rot.adopt(plan_input)
    assert rot.k == 1 and rot.records is None and rot.layout is not None
    assert rot.layout.payload is None and rot.layout.num_slots == 2
    assert list(rot.open_version(4)) == [] and rot.diff_meta(4, has_record=False) is None
    source, schedule, has_record = rot.source(4)
    assert source is rot.flat and schedule is rot.layout.schedule and not has_record


def test_replan_is_marked_done_on_every_outcome() -> None:
    rot, plan_input = _rotation(1)
    rot.adopt(plan_input)
    assert not [rot.checkpoint_written() for _ in range(2)][-1]
    assert rot.checkpoint_written()  # the third checkpoint: due
    assert rot.replan_input([2.1e9]) is None  # within 25% of the assumed rate: kept
    assert rot.plan_input is not None and rot.plan_input.replanned
    assert not rot.checkpoint_written()  # once per job
    rot2, plan_input2 = _rotation(1)
    rot2.adopt(plan_input2)
    got = rot2.replan_input([0.5e9, None])
    assert got is not None
    trial, reason = got
    assert trial.cost["copy_Bps"] == 0.5e9 and trial.replanned and "0.50 GB/s" in reason
    assert plan_input2.cost["copy_Bps"] == 2e9  # the adopted input is not changed under it


def test_sigterm_grace_follows_the_iteration() -> None:
    """Three iterations (profiled or timed, the longer), at least 5 s, at most the flush's
    bound: a crashed peer's restart never waits longer than the flush could take."""
    from baft.liveness.termination import Termination

    t = Termination(max_grace_s=20.0)
    t.pace(0.1, profiled=True)
    assert t.grace_s == 5.0
    t.pace(2.0, profiled=True)
    assert t.grace_s == 7.0
    t.pace(0.5)  # a timed iteration shorter than the profiled one: the profiled counts
    assert t.grace_s == 7.0
    t.pace(10.0)
    assert t.grace_s == 20.0


class _Handle:
    """A save in flight that finishes when the test says so."""

    def __init__(self, version: int, state: dict[str, Any] | None = None) -> None:
        self.version = version
        self.state = state or {}
        """What the save was handed."""
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> None:
        assert self.finished, "the training thread waited for the disk"


class _Disk:
    native_id = None  # no writer thread to raise while waiting

    def __init__(self) -> None:
        self.saves: list[_Handle] = []

    def save_async(self, version: int, state: dict[str, Any], meta: dict[str, Any]) -> _Handle:
        self.saves.append(_Handle(version, state))
        return self.saves[-1]


def _on_disk(every: int) -> tuple[_Disk, Persisting]:
    """A one-rank :class:`Persisting` of one tensor over a fake disk whose saves finish
    only when told."""
    disk = _Disk()
    flat = FlatState([("model.w", torch.arange(4.0))])
    p = Persisting(
        disk,  # type: ignore[arg-type]
        every=every, interval=1, keys=PersistKeys(), topology=Topology(1, 1, 1), rank=0,
        flat=flat, device=torch.device("cpu"), layout_digests={},
    )  # fmt: skip
    return disk, p


def test_a_due_version_is_passed_over_not_waited_for_while_a_save_still_writes() -> None:
    """persist_every=2, differential: v0 is saved; at v2 the save of v0 still writes, so
    the rank takes no copy and votes not ready; v2 is not persisted and v3 is owed (the
    next checkpoint, off the cadence) and saved once the disk is free; the cadence then
    resumes at v4. The training thread never waits (the handle asserts it)."""
    from baft.engine.device import HostCopy

    disk, p = _on_disk(every=2)

    def version(v: int, agreed_by_peers: bool = True) -> bool:
        p.version_opened(v, differential=True, copier=HostCopy())
        ready = p.ready(v, differential=True)
        p.committed(v, differential=True, slot_data=lambda: (torch.zeros(0), 0, 0),
                    agreed=ready and agreed_by_peers)  # fmt: skip
        return ready

    assert version(0) and [h.version for h in disk.saves] == [0]
    assert not version(1)  # not due
    assert not version(2)  # due, but v0's save still writes: passed over, not waited for
    assert p.owed and p.skipped == 1 and p.saved == 1
    disk.saves[0].finished = True
    assert version(3)  # owed: persisted off the cadence
    assert [h.version for h in disk.saves] == [0, 3] and not p.owed
    disk.saves[1].finished = True
    assert version(4, agreed_by_peers=False)  # this rank was ready, a peer was not
    assert [h.version for h in disk.saves] == [0, 3] and p.owed and p.skipped == 2
    assert version(5) and [h.version for h in disk.saves] == [0, 3, 5]
    disk.saves[2].finished = True
    assert version(6) and [h.version for h in disk.saves] == [0, 3, 5, 6]


@pytest.mark.parametrize("differential", [True, False])
def test_a_replan_waits_for_a_save_only_if_it_reads_the_store(differential: bool) -> None:
    """Before the store's mappings are replaced (a re-plan), a save reading the committed
    slot (full snapshots) must finish; a differential save reads its own live copy and
    goes on (the first one waits behind a writer process's start: seconds of training)."""
    from baft.engine.device import HostCopy

    disk, p = _on_disk(every=1)
    p.version_opened(0, differential=differential, copier=HostCopy())
    slot = torch.arange(4.0).view(torch.uint8)
    p.committed(0, differential=differential, slot_data=lambda: (slot, 0, slot.numel()))
    assert [h.version for h in disk.saves] == [0]
    if differential:
        p.join_store_reads()  # returns at once: the handle asserts nobody waited
        assert not disk.saves[0].finished
    else:
        with pytest.raises(AssertionError, match="waited for the disk"):
            p.join_store_reads()
        disk.saves[0].finished = True
        p.join_store_reads()
    assert p.busy() is (not disk.saves[0].finished)


def test_the_live_copy_s_buffer_is_made_and_touched_when_a_plan_is_adopted() -> None:
    """A differential job that persists gets its live copy's buffer at the adoption, its
    pages written (a fresh mapping's faults are not the first due version's, inside its
    step deadline); the due version copies into that same buffer. Full snapshots and a
    job that does not persist get none."""
    from baft.engine.device import HostCopy

    made: list[torch.Tensor] = []

    class _Buffers(_Disk):
        def host_buffer(self, nbytes: int) -> torch.Tensor:
            made.append(torch.full((nbytes,), 7, dtype=torch.uint8))  # not zeroed: garbage
            return made[-1]

    def persisting(every: int) -> Persisting:
        return Persisting(
            _Buffers(),  # type: ignore[arg-type]
            every=every, interval=1, keys=PersistKeys(), topology=Topology(1, 1, 1), rank=0,
            flat=FlatState([("model.w", torch.arange(4.0))]), device=torch.device("cpu"),
            layout_digests={},
        )  # fmt: skip

    persisting(1).adopted(differential=False)
    persisting(0).adopted(differential=True)
    assert made == []
    p = persisting(1)
    p.adopted(differential=True)
    assert len(made) == 1 and made[0].numel() == 16 and not made[0].any()  # touched
    p.adopted(differential=True)  # a re-plan: the same share, the same buffer
    p.version_opened(0, differential=True, copier=HostCopy())
    p.committed(0, differential=True, slot_data=lambda: (torch.zeros(0), 0, 0))
    assert len(made) == 1
    saved = p.persister.saves[0].state  # type: ignore[union-attr]
    (t,) = saved.values()
    assert torch.equal(t, torch.arange(4.0))
    assert t.untyped_storage().data_ptr() == made[0].untyped_storage().data_ptr()
