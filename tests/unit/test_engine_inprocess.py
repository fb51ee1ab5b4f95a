"""The engine's protect/commit cycle in process: ranks are threads, the transport is
:class:`LocalTransport`, the stores are real. Each rank's committed slot must hold the
exact bytes of its state at that version, its redundancy the exact bytes of its peer's
shard, and a peer that dies mid-exchange must fail the holder's version, never hang it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from baft.config import CheckpointConfig
from baft.engine.device import HostCopy, ThreadCopy
from baft.engine.engine import CheckpointEngine, EngineParts
from baft.engine.local_transport import LocalTransport, PeerFailed
from baft.engine.scheduling import AllAtStart, BubbleAware
from baft.engine.worker import ProtectWorker
from baft.pipeline import IterationTimeline
from baft.plan.inputs import bmap_to_json, layout_to_json
from baft.plan.types import BubbleMap, Slot, StateLayout
from baft.store.records import PlanInput
from baft.store.shm import SnapshotStore
from baft.topology import Topology

WORLD = 2


class _State:
    """A few tensors per rank (a LiveState); ``capture``/``apply`` count their calls."""

    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        self.tensors = [
            ("model.w", torch.randn(300, 70, generator=g)),
            ("model.b", torch.randn(70, generator=g)),
            ("optim.w.exp_avg", torch.randn(300, 70, generator=g)),
        ]
        self.captured = 0

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.tensors)

    def capture(self) -> None:
        self.captured += 1

    def apply(self) -> None:
        pass

    def step(self) -> None:
        for _, t in self.tensors:
            t.mul_(1.5).add_(0.25)

    def flat_bytes(self) -> bytes:
        return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for _, t in self.tensors)


class _OffThreadCopy(ThreadCopy):
    """A copier the engine issues from its own thread, as it does CudaCopy's: records
    the ``mark`` calls and the threads ``start`` ran on."""

    issues_off_thread = True

    def __init__(self) -> None:
        super().__init__()
        self.marks = 0
        self.threads: set[str] = set()

    def mark(self) -> None:
        self.marks += 1

    def start(self, pairs):  # type: ignore[no-untyped-def]
        self.threads.add(threading.current_thread().name)
        return super().start(pairs)


def _engines(
    tmp: Path,
    redundancy: str,
    *,
    spill: Callable[[], ThreadCopy] = ThreadCopy,
    copy_Bps=2e9,
    scheduling: Callable[[], Any] = BubbleAware,
) -> tuple[list[CheckpointEngine], list[_State], list[Any]]:
    topo = Topology(num_pp=WORLD, num_dp=1, num_tp=1, ranks_per_node=1)
    ck = CheckpointConfig.parse(f"redundancy={redundancy},persist=0,full_every=1")
    ck.store.root, ck.store.job_id, ck.timeouts.collective_s, ck.profile_iters = (
        str(tmp / "shm"),
        "job",
        5.0,
        1,
    )
    transports = LocalTransport.group(WORLD, timeout_s=5.0)
    states = [_State(r) for r in range(WORLD)]
    engines = []
    for r in range(WORLD):
        parts = EngineParts(
            store=SnapshotStore(tmp / "shm", "job", topo.node_of(r), r, 1 << 30),
            transport=transports[r],
            copier=HostCopy(),
            spill_copier=spill(),
            worker=ProtectWorker(gated=False),
            peers={},
            persister=None,
            scheduling=scheduling(),
        )
        engines.append(
            CheckpointEngine(
                ck,
                tmp / "run",
                topology=topo,
                rank=r,
                device=torch.device("cpu"),
                state=states[r],
                parts=parts,
            )  # fmt: skip
        )
    (tmp / "run").mkdir()
    bubbles = BubbleMap(r, (Slot("w0", 0.05), Slot("pre_step", 0.001, kind="pre_step")), 0.2)
    plan_input = {
        "ranks": [
            {
                "bubbles": bmap_to_json(BubbleMap(r, bubbles.slots, bubbles.iteration_s)),
                "layout": layout_to_json(
                    StateLayout(rank=r, tensors=e.flat.specs(), replicas=(r,))
                ),
            }
            for r, e in enumerate(engines)
        ],
        "cost": {"copy_Bps": copy_Bps, "net_Bps": 1e9, "encode_Bps": 2e9, "persist_Bps": 1e9},
        "world_size": WORLD,
    }
    PlanInput.from_json(plan_input).save(tmp / "run")
    return engines, states, transports


def _on_ranks(fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(rank)`` on one thread per rank; re-raise the first error."""
    out: list[Any] = [None] * WORLD
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def _iteration(engine: CheckpointEngine, state: _State, it: int) -> bytes:
    """One iteration's hooks around a fake optimizer step; returns version ``it``'s bytes."""
    tl = IterationTimeline(it, engine.rank)
    engine.before_iteration(it, tl)
    for slot, kind in (("w0", "p2p"), ("pre_step", "pre_step")):
        engine.on_slot(slot, kind, tl)
        engine.after_slot(slot)
    engine.before_optimizer_step(it, tl)
    before = state.flat_bytes()
    state.step()
    engine.after_step(it, tl)
    return before


def _four_iterations(engines: list[CheckpointEngine], states: list[_State]) -> list[list[bytes]]:
    """Start every rank's engine, run four iterations, close; each rank's version bytes."""

    def run(r: int) -> list[bytes]:
        e = engines[r]
        e.start(0)
        expected = [_iteration(e, states[r], it) for it in range(4)]
        e.close()
        return expected

    return _on_ranks(run)


def test_versions_commit_with_exact_bytes_and_replicas(tmp_path: Path) -> None:
    engines, states, _ = _engines(tmp_path, "replicate:1")
    expected = _four_iterations(engines, states)
    for r, e in enumerate(engines):
        assert states[r].captured == 4
        store = SnapshotStore(tmp_path / "shm", "job", r, r, 1 << 30)
        inv = store.inventory(verify=True)
        assert inv.committed == 3
        newest = inv.get(3)
        assert newest is not None and newest.usable
        slot = newest.slot
        assert bytes(store.read(slot, "data")) == expected[r][3]  # the state before step 3
        peer = 1 - r  # replicate:1 across two nodes: each rank holds the other's shard
        assert bytes(store.read(slot, "red", 0, len(expected[peer][3]))) == expected[peer][3]
        assert e.last_metrics["bytes"]["snapshot"] == len(expected[r][3])
        assert e.last_metrics["bytes"]["recv"] == len(expected[peer][3])
        store.close()


def test_all_at_start_scheduling_commits_the_same_bytes(tmp_path: Path) -> None:
    """The naive-async baseline is a scheduling strategy: every task starts on the worker
    at the iteration's start, none at a slot, the training thread joins them before the
    step; the committed versions hold exactly what bubble-aware scheduling writes."""
    engines, states, _ = _engines(tmp_path, "replicate:1", scheduling=AllAtStart)
    threads: set[str] = set()
    for e in engines:
        snapshot = e.writer.snapshot

        def record(*args: Any, _snapshot: Any = snapshot, **kwargs: Any) -> None:
            threads.add(threading.current_thread().name)
            _snapshot(*args, **kwargs)

        e.writer.snapshot = record  # type: ignore[method-assign]
    expected = _four_iterations(engines, states)
    assert threads == {"baft-protect"}  # every task on the worker, none at a slot
    for r, e in enumerate(engines):
        store = SnapshotStore(tmp_path / "shm", "job", r, r, 1 << 30)
        inv = store.inventory(verify=True)
        newest = inv.get(3)
        assert inv.committed == 3 and newest is not None and newest.usable
        assert bytes(store.read(newest.slot, "data")) == expected[r][3]
        peer = 1 - r
        assert bytes(store.read(newest.slot, "red", 0, len(expected[peer][3]))) == expected[peer][3]
        assert e.last_metrics["bytes"]["snapshot"] == len(expected[r][3])
        store.close()


def test_copies_issued_off_the_training_thread_commit_exact_bytes(tmp_path: Path) -> None:
    """CUDA's path, with a thread copier standing in: the iteration-start copies (what
    fits no bubble: copies at 1 MB/s leave w0 room for a fraction) are issued by the
    engine's issuer thread after one ``mark`` per iteration, the slot copies by the
    rank's own thread, and every committed version holds exactly the state before its step."""
    engines, states, _ = _engines(tmp_path, "replicate:1", spill=_OffThreadCopy, copy_Bps=1e6)
    expected = _four_iterations(engines, states)
    for r, e in enumerate(engines):
        copier = e.writer.spill_copier
        assert isinstance(copier, _OffThreadCopy)
        assert copier.marks == 3  # versions 1..3 (iteration 0 profiles)
        assert any(n.startswith("baft-issue") for n in copier.threads)
        assert e.writer.schedule.by_slot.get("w0")  # some chunks did fit the bubble
        store = SnapshotStore(tmp_path / "shm", "job", r, r, 1 << 30)
        inv = store.inventory(verify=True)
        assert inv.committed == 3
        newest = inv.get(3)
        assert newest is not None and newest.usable
        assert bytes(store.read(newest.slot, "data")) == expected[r][3]
        store.close()


def test_a_peer_failing_mid_exchange_fails_the_version(tmp_path: Path) -> None:
    engines, states, transports = _engines(tmp_path, "replicate:1")
    _on_ranks(lambda r: engines[r].start(0))
    _on_ranks(lambda r: _iteration(engines[r], states[r], 0))  # version 0 goes through

    def die_or_wait(r: int) -> None:
        if r == 1:
            transports[1].fail()  # rank 1 dies before it sends version 1
            return
        _iteration(engines[0], states[0], 1)

    with pytest.raises(PeerFailed):
        _on_ranks(die_or_wait)
    for e in engines:
        e.writer.worker.shutdown()
        e.store.close()


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_iteration(tmp_path: Path) -> None:
    """The stop request rides on the commit vote: rank 1 alone saw SIGTERM during
    iteration 1, and both ranks leave at the start of iteration 2 (after the vote), no
    rank trains on alone."""
    from baft.liveness.termination import Termination

    engines, states, _ = _engines(tmp_path, "replicate:1")
    flags = [Termination() for _ in engines]  # not installed: the test raises the flag
    for e, f in zip(engines, flags, strict=True):
        e.termination = f
    _on_ranks(lambda r: engines[r].start(0))
    _on_ranks(lambda r: _iteration(engines[r], states[r], 0))
    flags[1].requested = True
    _on_ranks(lambda r: _iteration(engines[r], states[r], 1))
    stopped_at: list[int | None] = [None] * WORLD

    def run(r: int) -> None:
        try:
            _iteration(engines[r], states[r], 2)
        except SystemExit as e:
            assert e.code == 0
            stopped_at[r] = 2

    _on_ranks(run)
    assert stopped_at == [2, 2]
    assert all(e.committed == 1 for e in engines)  # v1 committed by the same vote
    for e in engines:
        e.writer.worker.shutdown()
        e.store.close()
