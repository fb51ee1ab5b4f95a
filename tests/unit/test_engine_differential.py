"""Differential checkpoints through the engine, in process: payloads of gradient records
and rotating slices land in a ring of store slots, and rebuilding the newest committed
version from them (newest slices + replayed records) gives that version's state
bit-exactly, for every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from baft.config import CheckpointConfig
from baft.engine.device import HostCopy, ThreadCopy
from baft.engine.differential import PayloadViews, RecordCapture
from baft.engine.engine import CheckpointEngine, EngineParts
from baft.engine.flat import FlatState, byte_view
from baft.engine.local_transport import LocalTransport
from baft.engine.planning import store_bytes
from baft.engine.worker import ProtectWorker
from baft.pipeline import IterationTimeline
from baft.pipeline.state import TrainingState
from baft.plan.inputs import bmap_to_json, layout_to_json
from baft.plan.payload import PayloadLayout
from baft.plan.types import BubbleMap, Slot, StateLayout
from baft.recover.differential import RestoreError, rebuild_from_payloads
from baft.store.records import PlanInput, window_of
from baft.store.shm import SnapshotStore
from baft.topology import Topology
from tests.unit.test_engine_inprocess import _on_ranks

WORLD = 2


class _Model:
    """A LiveState over a tiny model and its AdamW (state created up front)."""

    def __init__(self, seed: int, odd_bytes: int = 0) -> None:
        torch.manual_seed(seed)
        # an always-tensor of odd size (like extra.optim.created, a byte per deferred
        # optimizer state) shifts every gradient record to an unaligned payload offset
        self.odd = torch.full((odd_bytes,), seed % 251, dtype=torch.uint8)
        self.module = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(8, 4))
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-2, foreach=False)
        for p in self.module.parameters():
            st = self.opt.state[p]
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        self.rng = torch.get_rng_state().clone()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = [
            (f"model.{n}", p.data) for n, p in self.module.named_parameters()
        ]
        for n, p in self.module.named_parameters():
            st = self.opt.state[p]
            out += [(f"optim.{n}.{key}", st[key]) for key in sorted(st)]
        odd = [("extra.odd", self.odd)] if self.odd.numel() else []
        return [*out, *odd, ("extra.rng", self.rng)]

    def capture(self) -> None:
        pass

    def apply(self) -> None:
        pass

    def named_params(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.opt

    def step(self, rank: int, it: int) -> None:
        g = torch.Generator().manual_seed(1000 * rank + it)
        for p in self.module.parameters():
            p.grad = torch.randn(p.shape, generator=g)  # a new tensor, like set_to_none
        self.rng.add_(1)  # small state changes every version
        self.odd.add_(1)
        self.opt.step()

    def flat_bytes(self) -> bytes:
        return b"".join(
            t.reshape(-1).view(torch.uint8).numpy().tobytes() for _, t in self.named_tensors()
        )


def _build(
    tmp: Path,
    full_every: int | str,
    *,
    idle_s: float = 0.05,
    budget: int = 1 << 30,
    odd_bytes: int = 0,
) -> tuple[list[CheckpointEngine], list[_Model]]:
    topo = Topology(num_pp=WORLD, num_dp=1, num_tp=1, ranks_per_node=1)
    ck = CheckpointConfig.parse(f"redundancy=replicate:1,persist=0,full_every={full_every}")
    ck.store.root, ck.store.job_id, ck.timeouts.collective_s, ck.profile_iters = (
        str(tmp / "shm"),
        "job",
        5.0,
        1,
    )
    ck.store.budget_bytes = budget
    transports = LocalTransport.group(WORLD, timeout_s=5.0)
    models = [_Model(r, odd_bytes) for r in range(WORLD)]
    engines = [
        CheckpointEngine(
            ck,
            tmp / "run",
            topology=topo,
            rank=r,
            device=torch.device("cpu"),
            state=models[r],
            parts=EngineParts(
                store=SnapshotStore(tmp / "shm", "job", r, r, budget),
                transport=transports[r],
                copier=HostCopy(),
                spill_copier=ThreadCopy(),
                worker=ProtectWorker(gated=False),
                peers={},
                persister=None,
            ),
        )  # fmt: skip
        for r in range(WORLD)
    ]
    (tmp / "run").mkdir(parents=True)
    slots = (Slot("w0", idle_s), Slot("pre_step", min(idle_s, 0.001), kind="pre_step"))
    PlanInput.from_json(
        {
            "ranks": [
                {
                    "bubbles": bmap_to_json(BubbleMap(r, slots, 0.2)),
                    "layout": layout_to_json(
                        StateLayout(rank=r, tensors=e.flat.specs(), replicas=(r,))
                    ),
                }
                for r, e in enumerate(engines)
            ],
            "cost": {"copy_Bps": 2e9, "net_Bps": 1e9, "encode_Bps": 2e9, "persist_Bps": 1e9},
            "world_size": WORLD,
        },
    ).save(tmp / "run")
    return engines, models


def _train(engines: list[CheckpointEngine], models: list[_Model], n: int) -> list[list[bytes]]:
    def rank(r: int) -> list[bytes]:
        e, m, states = engines[r], models[r], []
        e.start(0)
        for it in range(n):
            tl = IterationTimeline(it, r)
            e.before_iteration(it, tl)
            for slot, kind in (("w0", "p2p"), ("pre_step", "pre_step")):
                e.on_slot(slot, kind, tl)
                e.after_slot(slot)
            states.append(m.flat_bytes())  # version it: the state before step it
            m.step(r, it)  # grads first: the engine records what the step consumes
            e.before_optimizer_step(it, tl)  # (the runner's order: hook, then step)
            e.after_step(it, tl)
        e.close()
        return states

    return _on_ranks(rank)


@pytest.mark.parametrize(("k", "odd_bytes"), [(2, 0), (3, 0), (3, 7)])
def test_newest_version_rebuilds_bit_exactly_from_slices_and_records(
    tmp_path: Path, k: int, odd_bytes: int
) -> None:
    """``odd_bytes``: records at offsets not divisible by 4 are read through a copy (a
    view raised 'storage_offset() must be divisible by 4')."""
    engines, models = _build(tmp_path, k, odd_bytes=odd_bytes)
    states = _train(engines, models, 8)
    for r, e in enumerate(engines):
        assert e.k == k
        store = SnapshotStore(tmp_path / "shm", "job", r, r, 1 << 30)
        inv = store.inventory(verify=True)
        assert inv.committed == 7 and store.num_slots == k + 1
        found = {x.version: x for x in inv.versions if x.usable}
        win = window_of(7, k, first_version=0)
        assert win is not None and set(win) <= set(found)
        payloads = {u: torch.from_numpy(store.read(found[u].slot, "data").copy()) for u in win}
        meta = found[7].manifest.meta["diff"]  # type: ignore[union-attr]
        assert (meta["k"], meta["slice"], meta["has_record"]) == (k, 7 % k, True)
        if odd_bytes:
            grad0 = e.rotation.layout.payload.layout.order(7 % k)  # type: ignore[union-attr]
            head = [s.name for s in grad0].index(e.rotation.layout.payload.layout.grads[0].name)  # type: ignore[union-attr]
            assert sum(s.nbytes for s in grad0[:head]) % 4 != 0
        fresh = _Model(
            seed=99, odd_bytes=odd_bytes
        )  # other weights: everything must come from the payloads
        assert fresh.flat_bytes() != states[r][7]
        done = rebuild_from_payloads(
            e.rotation.layout.payload.layout, payloads, 7, 0, dict(fresh.named_tensors()),  # type: ignore[union-attr]
            fresh.optimizer, fresh.named_params(),
        )  # fmt: skip
        assert done["replayed_steps"] == k - 1
        assert fresh.flat_bytes() == states[r][7]
        # a payload missing from the window: unrecoverable, never wrong
        with pytest.raises(RestoreError, match="missing"):
            rebuild_from_payloads(
                e.rotation.layout.payload.layout, {u: p for u, p in payloads.items() if u != 7 - k + 1}, 7, 0,  # type: ignore[union-attr]
                dict(fresh.named_tensors()), fresh.optimizer, fresh.named_params(),
            )  # fmt: skip
        store.close()


def test_auto_choosing_full_snapshots_holds_no_gradient_record(tmp_path: Path) -> None:
    """When the bubbles hold the whole state, full_every=auto picks 1: no payload carries
    a record, so the engine must not keep the last step's gradients alive (a second
    gradient set, device memory on an accelerator) or encode hyperparameters per step."""
    engines, models = _build(tmp_path, "auto")
    states = _train(engines, models, 3)
    for r, e in enumerate(engines):
        assert e.rotation.layout.k_reason.startswith(
            "auto, rank"
        )  # chosen by the bubbles, not configured
        assert e.k == 1 and e.rotation.layout.payload is None and e.rotation.records is None
        store = SnapshotStore(tmp_path / "shm", "job", r, r, 1 << 30)
        inv = store.inventory(verify=True)
        assert inv.committed == 2
        newest = next(x for x in inv.versions if x.version == 2)
        assert store.read(newest.slot, "data").tobytes() == states[r][2]  # a full snapshot
        store.close()


def test_auto_steps_full_every_down_to_fit_the_memory_budget(tmp_path: Path) -> None:
    """Bubbles too small for anything: auto wants the largest k (fewest bytes per
    iteration), whose k+1 payload slots each carry a gradient record. With a budget that
    holds only k-1's store, auto takes k-1 (says why) and the store allocates inside it."""
    free, _ = _build(tmp_path / "free", "auto", idle_s=1e-7)
    _train(free, [_Model(r) for r in range(WORLD)], 1)
    wanted = free[0].k
    assert wanted > 1 and all(e.k == wanted for e in free)
    assert free[0].rotation.plan_input is not None
    plan_input = free[0].rotation.plan_input.to_json()
    e = free[0]
    need = {
        k: store_bytes(plan_input, k, e.policy, e.topology, e.redundancy)
        for k in (wanted - 1, wanted)
    }
    assert need[wanted - 1] < need[wanted]  # more slots, each with a record
    engines, models = _build(tmp_path / "tight", "auto", idle_s=1e-7, budget=need[wanted - 1])
    states = _train(engines, models, 4)
    for r, e in enumerate(engines):
        assert e.k == wanted - 1
        assert f"lowered to full_every={wanted - 1}" in e.rotation.layout.k_reason, (
            e.rotation.layout.k_reason
        )
        store = SnapshotStore(tmp_path / "tight" / "shm", "job", r, r, 1 << 30)
        assert store.num_slots == wanted and store.inventory(verify=True).committed == 3
        store.close()
    assert all(len(s) == 4 for s in states)


class _SgdStage:
    """A stage as ``baft.protect`` holds it: TrainingState over SGD-nesterov, whose
    momentum buffers the first step creates (deferred); the second Linear gets no
    gradient before step ``late`` (its buffers are created later, inside a window)."""

    def __init__(self, seed: int, late: int) -> None:
        torch.manual_seed(seed)
        self.module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        self.ts = TrainingState([self.module], self.opt)
        self.late = late

    def step(self, it: int) -> None:
        g = torch.Generator().manual_seed(it)
        for i, p in enumerate(self.module.parameters()):
            grad = torch.randn(p.shape, generator=g)
            p.grad = grad if i < 2 or it >= self.late else None
        self.opt.step()  # TrainingState's post-hook adopts the buffers a first step made

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.ts.tensors())


def test_sgd_momentum_replays_in_a_fresh_process() -> None:
    """A restarted process has no momentum buffers yet (SGD creates them at its first
    step): the replay must step each group's restored buffer, and create it (a clone of
    the gradient) only where the group's base version had none. Before, the replay ran
    with no buffers (every replayed step cloned the gradient) and apply() then put the
    base's buffers back: params and momentum of the replayed groups wrong, rc=0 (found
    by the tests/e2e matrix, case user-unique-pp2-1f1b-3-rs-off-one-kill)."""
    k, v, late = 3, 7, 5  # window v5..v7; the second Linear's buffers appear at step 5
    live = _SgdStage(0, late)
    names = live.ts.tensors()
    layout = PayloadLayout.of(FlatState(names).specs(), k)
    views = PayloadViews(layout, names)
    capture = RecordCapture(live.opt, dict(live.module.named_parameters()))
    payloads: dict[int, torch.Tensor] = {}
    for it in range(v + 1):
        live.ts.capture()
        flat = views.flat(it, capture.for_version(it))
        payloads[it] = torch.cat([byte_view(t).clone() for t in flat.tensors])
        if it == v:
            break
        live.step(it)
        capture.take(it)  # the record holds the grads by reference, as the engine's does
    bases = {
        g: max(u for u in range(v - k + 1, v + 1) if u % k == j) for g, j in layout.slice_of.items()
    }
    # replayed: 0.* from buffers that existed at their base, 1.bias from none (created by
    # the replay's step 5); 1.weight is its base
    assert bases == {"0.weight": 6, "0.bias": 5, "1.weight": 7, "1.bias": 5}
    fresh = _SgdStage(99, late)  # a restarted process: other weights, no buffers yet
    assert not any(fresh.opt.state.values())
    same = [n for n, t in fresh.tensors().items() if torch.equal(t, live.tensors()[n])]
    assert [n for n in same if n.startswith(("model.", "optim."))] == []
    done = rebuild_from_payloads(
        layout, {u: payloads[u] for u in range(v - k + 1, v + 1)}, v, 0,
        fresh.tensors(), fresh.opt, dict(fresh.module.named_parameters()), deferred=fresh.ts,
    )  # fmt: skip
    fresh.ts.apply()
    assert done["replayed_steps"] == 2
    wrong = [n for n, t in fresh.tensors().items() if not torch.equal(t, live.tensors()[n])]
    assert wrong == []
    for p in fresh.module.parameters():  # the layout's tensors are the live state
        held = fresh.opt.state[p]["momentum_buffer"]
        assert any(held is t for t in fresh.tensors().values())
