"""Elastic replicas' pure and in-process pieces: the DP degree of a world, the config, the
protection while shrunk, and the virtual replicas' records (layout, exchange, swaps).
Ranks are threads on a LocalTransport."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from baft.config import CheckpointConfig, ElasticConfig
from baft.engine.local_transport import LocalTransport
from baft.pipeline.elastic import VirtualReplicas, dp_degree, protection
from baft.pipeline.replicas import ReplicaRecords
from baft.pipeline.state import TrainingState
from baft.topology import Topology
from tests.unit.test_replica_records import _on_threads


class Loader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def test_the_dp_degree_of_a_world() -> None:
    assert dp_degree(4, world_size=8, model_ranks=2) == 4
    assert dp_degree(4, world_size=4, model_ranks=2) == 2
    assert dp_degree(4, world_size=2, model_ranks=2) == 1
    assert dp_degree(4, world_size=6, model_ranks=2) is None  # 3 does not divide 4
    assert dp_degree(1, world_size=2, model_ranks=4) is None  # not a whole model
    assert dp_degree(2, world_size=3, model_ranks=2) is None


def test_the_config_refuses_what_cannot_run() -> None:
    assert list(ElasticConfig(num_replicas=4).hosted(2, 1)) == [2, 3]
    assert list(ElasticConfig().hosted(3, 2)) == [2]  # off: each rank its own replica
    with pytest.raises(ValueError, match="not a multiple of the job's 3 DP ranks"):
        ElasticConfig(num_replicas=4).validate(3)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        ElasticConfig(num_replicas=-1).validate(1)
    ck = CheckpointConfig.from_dict({"elastic": {"num_replicas": 2, "deterministic": False}})
    assert ck.elastic == ElasticConfig(num_replicas=2, deterministic=False)
    assert CheckpointConfig.from_dict(ck.to_dict()).elastic == ck.elastic


def test_protection_while_shrunk() -> None:
    two = Topology(num_pp=2, num_dp=2, ranks_per_node=2)
    assert protection("xor:2", 50, two) == ("xor:2", 50, "")
    one = Topology(num_pp=2, num_dp=1, ranks_per_node=2)
    red, every, why = protection("xor:2", 50, one)
    assert (red, every) == ("none", 1) and "cannot survive losing another host" in why
    three = Topology(num_pp=1, num_dp=3, ranks_per_node=1)
    assert protection("rs:2+2", 50, three)[:2] == ("replicate:2", 1)


def _rank(loader: Loader) -> tuple[TrainingState, nn.Linear]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ts = TrainingState([model], opt, {"loader": loader}, install_step_hook=False)
    return ts, model


def test_a_rank_hosting_two_replicas_keeps_their_records_apart() -> None:
    loader = Loader()
    ts, model = _rank(loader)
    rr = ReplicaRecords(ts.tensors(), rank=0, replicas=(0,), num_replicas=2)
    names_ = [n for n, _ in rr.named()]
    assert "extra.state.dp0.loader" in names_ and "extra.state.dp1.loader" in names_
    held = dict(rr.named())
    assert held["extra.state.dp0.loader"] is not dict(ts.tensors())["extra.state.loader"]
    vr = VirtualReplicas(
        ts, list(model.parameters()), hosted=[0, 1], num_replicas=2, deterministic=True,
        dp_group=None,
    )  # fmt: skip
    draws: dict[int, list[float]] = {0: [], 1: []}
    torch.manual_seed(5)  # both replicas start from this rank's stream
    vr.fresh_start()
    for _ in range(2):  # two iterations: each replica advances its own loader and RNG
        for r in vr.loop(lambda fn: fn()):
            loader.position += 10**r
            draws[r].append(float(torch.rand(1)))
            model(torch.ones(1, 3)).sum().backward()
    assert draws[0] == draws[1]  # the same stream, each from its own state
    assert loader.position == 20  # the live object is the last replica's
    assert vr.reduced and model.weight.grad is not None
    rr.fill_hosted(vr.record)
    vr._load(0)
    assert loader.position == 2  # replica 0 took two steps of 1


def test_each_hosted_replica_s_forward_starts_from_the_iteration_s_buffers() -> None:
    """BatchNorm's running statistics: replica 1's forward does not see replica 0's
    update, and the iteration ends with replica 0's (what DDP's broadcast_buffers gives a
    rank per replica)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ts = TrainingState([model], opt, {}, install_step_hook=False)
    vr = VirtualReplicas(
        ts, list(model.parameters()), hosted=[0, 1], num_replicas=2, deterministic=True,
        dp_group=None,
    )  # fmt: skip
    vr.fresh_start()
    start = {k: v.clone() for k, v in model[1].state_dict().items()}
    batches = {r: torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in (0, 1)}
    seen: dict[int, dict[str, torch.Tensor]] = {}
    for r in vr.loop(lambda fn: fn()):
        seen[r] = {k: v.clone() for k, v in model[1].state_dict().items()}
        model(batches[r]).sum().backward()
    alone = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    alone.load_state_dict(model.state_dict())
    alone[1].load_state_dict(start)
    alone(batches[0])  # replica 0's forward from the iteration's statistics
    for k in start:
        assert torch.equal(seen[0][k], start[k]) and torch.equal(seen[1][k], start[k]), k
        assert torch.equal(model[1].state_dict()[k], alone[1].state_dict()[k]), k
    assert model[1].num_batches_tracked.item() == 1


def test_the_exchange_fills_the_other_ranks_replicas() -> None:
    world = 2
    made = []
    for d in range(world):
        loader = Loader()
        loader.position = 100 * (d + 1)
        ts, _ = _rank(loader)
        ts.capture()
        made.append(ReplicaRecords(ts.tensors(), rank=d, replicas=(0, 1), num_replicas=4))
    assert [rr.hosted for rr in made] == [[0, 1], [2, 3]]
    for rr in made:
        rr.fill_hosted(lambda r, live: live)  # each hosted replica: this rank's record
    transports = LocalTransport.group(world, timeout_s=10.0)
    _on_threads([lambda d=d: made[d].exchange(transports[d]) for d in range(world)])
    a, b = (dict(rr.named()) for rr in made)
    for r in range(4):
        n = f"extra.state.dp{r}.loader"
        assert torch.equal(a[n], b[n]), n
    assert not torch.equal(a["extra.state.dp0.loader"], a["extra.state.dp2.loader"])


def test_a_job_back_at_a_size_it_ran_at_finds_that_size_s_plan_input(tmp_path) -> None:
    from baft.store.records import PlanInput

    four = PlanInput(ranks=[{"w": 4}] * 4, cost={"copy_Bps": 4.0}, world_size=4)
    two = PlanInput(ranks=[{"w": 2}] * 2, cost={"copy_Bps": 2.0}, world_size=2)
    four.save(tmp_path)
    two.save(tmp_path)  # shrank: the newest inputs are the 2-rank job's
    assert PlanInput.load(tmp_path) == two
    assert PlanInput.load_for(tmp_path, 2) == two
    assert PlanInput.load_for(tmp_path, 4) == four  # grew back: re-plans at once
    assert PlanInput.load_for(tmp_path, 8) is None  # never ran with 8: profiles


def test_the_deterministic_tree_is_the_same_however_the_replicas_are_split() -> None:
    from baft.pipeline.elastic import blocks_are_subtrees, is_subtree_split, tree_sum

    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(1000, generator=g) * 10 ** (i % 5) for i in range(6)]

    def fresh(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in ts]

    four = tree_sum(fresh(leaves[:4]))
    assert torch.equal(four, (leaves[0] + leaves[1]) + (leaves[2] + leaves[3]))
    halves = [tree_sum(fresh(leaves[:2])), tree_sum(fresh(leaves[2:4]))]
    assert torch.equal(halves[1].clone().add_(halves[0]), four)  # an all-reduce of two
    assert torch.equal(tree_sum(halves, sizes=[2, 2]), four)  # two ranks of two
    three = tree_sum(fresh(leaves[:3]))
    assert torch.equal(three, (leaves[0] + leaves[1]) + leaves[2])
    assert is_subtree_split(2, 1, 2) and is_subtree_split(4, 2, 2)
    assert not is_subtree_split(4, 1, 4) and not is_subtree_split(6, 3, 2)
    assert blocks_are_subtrees(8, 2) and blocks_are_subtrees(6, 2) and blocks_are_subtrees(4, 1)
    assert not blocks_are_subtrees(6, 3)
    with pytest.raises(ValueError, match="no subtrees"):
        tree_sum(fresh(leaves[:2]), sizes=[3, 3])


def test_a_new_job_in_the_run_directory_forgets_every_size_s_plan_input(tmp_path) -> None:
    from baft.store.records import PlanInput
    from baft.train.config import TrainConfig
    from baft.train.launch import prepare_run_dir

    cfg = TrainConfig(out_dir=str(tmp_path / "run"), checkpoint=CheckpointConfig())
    cfg.checkpoint.store.root = str(tmp_path / "shm")
    prepare_run_dir(cfg)
    PlanInput(ranks=[{"w": 4}] * 4, cost={}, world_size=4).save(cfg.out_dir)
    PlanInput(ranks=[{"w": 2}] * 2, cost={}, world_size=2).save(cfg.out_dir)
    prepare_run_dir(cfg, resume=True)  # the same job goes on: its inputs stay
    assert PlanInput.load_for(cfg.out_dir, 4) is not None
    prepare_run_dir(cfg)  # a new job: a stale plan of another job is never adopted
    assert PlanInput.load_for(cfg.out_dir, 4) is None
    assert PlanInput.load_for(cfg.out_dir, 2) is None
