"""Per-replica small state (issue 41, part 2): every DP replica's ``state=`` objects and
RNG are in every replica's layout, the exchange makes the replicas' flat states the same
bytes again, and a restore assembled from the replicas' shares (as the planner splits
them) gives each replica back its own records. Replicas are threads on a LocalTransport."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from baft.engine.flat import FlatState
from baft.engine.local_transport import LocalTransport
from baft.errors import is_refusal
from baft.pipeline.replicas import ReplicaRecords, replicated_digest
from baft.pipeline.state import TrainingState
from baft.plan import names


class Loader:
    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "shard": [self.position] * 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def _replica(dp: int, position: int, seed: int) -> tuple[TrainingState, Loader]:
    torch.manual_seed(0)  # the model and optimizer are replicas
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loader = Loader(position)
    ts = TrainingState([model], opt, {"loader": loader}, install_step_hook=False)
    torch.manual_seed(seed)  # each replica its own RNG stream
    ts.capture()
    return ts, loader


def _flat_bytes(named: list[tuple[str, torch.Tensor]]) -> bytes:
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for _, t in named)


def _on_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def test_per_replica_names() -> None:
    assert names.replica("extra.state.sampler", 1) == "extra.state.dp1.sampler"
    assert names.replica("extra.rng.cpu", 0) == "extra.rng.dp0.cpu"
    assert names.replica("extra.state.a.b", 3) == "extra.state.dp3.a.b"
    assert names.is_per_replica("extra.state.x") and names.is_per_replica("extra.rng.cuda")
    for shared in ("extra.meta.AdamW", "extra.optim.created", "model.w", "buffer.bn.x"):
        assert not names.is_per_replica(shared)
        with pytest.raises(ValueError, match="no per-replica record"):
            names.replica(shared, 0)
    # a restore from another shard degree skips RNG records by their kind (recover/reshard)
    rest = names.with_coords(names.replica("extra.rng.cpu", 1), names.extra_prefix(0, 0))
    assert rest == "extra.pp0.tp0.rng.dp1.cpu"


def test_one_replica_changes_nothing() -> None:
    ts, _ = _replica(0, 5, 1)
    rr = ReplicaRecords(ts.tensors(), rank=3, replicas=(3,))
    assert [(n, t.data_ptr()) for n, t in rr.named()] == [
        (n, t.data_ptr()) for n, t in ts.tensors()
    ]
    assert replicated_digest("abc", 1) == "abc"
    saved = [(n, t.numel()) for n, t in ts.tensors()]
    assert rr.own_layout(saved) == saved


def test_layout_holds_every_replicas_records_in_dp_order() -> None:
    ts, _ = _replica(1, 5, 1)
    rr = ReplicaRecords(ts.tensors(), rank=7, replicas=(5, 7, 9))
    got = [n for n, _ in rr.named()]
    plain = [n for n, _ in ts.tensors()]
    assert got[: plain.index("extra.state.loader")] == plain[: plain.index("extra.state.loader")]
    extras = [n for n in got if names.is_extra(n)]
    assert extras == [
        "extra.meta.AdamW",
        "extra.state.dp0.loader",
        "extra.state.dp1.loader",
        "extra.state.dp2.loader",
        "extra.rng.dp0.cpu",
        "extra.rng.dp1.cpu",
        "extra.rng.dp2.cpu",
    ]
    held = dict(rr.named())
    live = dict(ts.tensors())
    # the own copy is the live record; the others are mirrors of the same size
    assert held["extra.state.dp1.loader"] is live["extra.state.loader"]
    assert held["extra.rng.dp1.cpu"] is live["extra.rng.cpu"]
    for d in (0, 2):
        m = held[f"extra.state.dp{d}.loader"]
        assert m is not live["extra.state.loader"] and m.numel() == 64 * 1024
    assert rr.own_names == {
        "extra.state.dp1.loader": "extra.state.loader",
        "extra.rng.dp1.cpu": "extra.rng.cpu",
    }
    digests = {replicated_digest(ts.layout_digest, n) for n in (1, 2, 3)}
    assert len(digests) == 3  # another number of replicas is another layout


def test_exchange_then_a_split_restore_gives_each_replica_its_own() -> None:
    world = 3
    made = [_replica(d, 10 * (d + 1), 100 + d) for d in range(world)]
    rngs = [dict(ts.tensors())["extra.rng.cpu"].clone() for ts, _ in made]
    assert len({hashlib.sha256(r.numpy().tobytes()).hexdigest() for r in rngs}) == world
    records = [ReplicaRecords(ts.tensors(), rank=d, replicas=range(world)) for d, (ts, _) in enumerate(made)]  # fmt: skip
    before = [_flat_bytes(rr.named()) for rr in records]
    assert len(set(before)) == world  # mirrors not filled yet: the replicas differ
    transports = LocalTransport.group(world, timeout_s=10.0)
    _on_threads([lambda d=d: records[d].exchange(transports[d]) for d in range(world)])
    after = [_flat_bytes(rr.named()) for rr in records]
    assert after[0] == after[1] == after[2]  # replicas again: the same bytes everywhere
    # a restore: fresh replicas (other positions, other RNG) get the flat state put
    # together from each replica's share, as the planner splits it among them
    flat = [FlatState(rr.named()) for rr in records]
    cuts = [0, flat[0].nbytes // 3, 2 * flat[0].nbytes // 3, flat[0].nbytes]
    whole = torch.empty(flat[0].nbytes, dtype=torch.uint8)
    for d in range(world):
        piece = torch.frombuffer(bytearray(after[d]), dtype=torch.uint8)[cuts[d] : cuts[d + 1]]
        whole[cuts[d] : cuts[d + 1]] = piece
    fresh = [_replica(d, 0, 7) for d in range(world)]
    for d, (ts, loader) in enumerate(fresh):
        target = ReplicaRecords(ts.tensors(), rank=d, replicas=range(world))
        FlatState(target.named()).write_from(0, whole)
        ts.apply()
        assert loader.position == 10 * (d + 1), d
        assert torch.equal(torch.get_rng_state(), rngs[d]), d


def test_a_saved_layout_without_every_replicas_records_is_refused() -> None:
    ts, _ = _replica(0, 5, 1)
    rr = ReplicaRecords(ts.tensors(), rank=1, replicas=(0, 1))
    layout = [(n, t.numel() * t.element_size()) for n, t in rr.named()]
    own = rr.own_layout(layout)
    assert own == [(n, t.numel() * t.element_size()) for n, t in ts.tensors()]
    ts.check_layout(own)  # the own projection is the TrainingState's layout
    old = [(n, t.numel() * t.element_size()) for n, t in ts.tensors()]  # one copy per stage
    with pytest.raises(ValueError, match="does not hold the own records of all 2 DP") as e:
        rr.own_layout(old)
    assert is_refusal(e.value)
    assert "differ in extra.state.dp0.loader, extra.state.dp1.loader, extra.rng.dp0.cpu" in str(
        e.value
    )
    resized = [(n, b + 1 if n == "extra.state.dp0.loader" else b) for n, b in layout]
    with pytest.raises(ValueError, match=r"resized extra.state.dp0.loader \(65537 -> 65536"):
        rr.own_layout(resized)
    three = ReplicaRecords(ts.tensors(), rank=0, replicas=(0, 1, 2))
    saved3 = [(n, t.numel() * t.element_size()) for n, t in three.named()]
    with pytest.raises(
        ValueError,
        match="of all 2 DP replicas .differ in extra.state.dp2.loader, extra.rng.dp2.cpu.: it was saved with another number",
    ):
        rr.own_layout(saved3)  # saved with 3 replicas, now 2
