"""DCP keys are unique across pipeline stages: plain FQNs when the stages' FQNs are
distinct (the reference GPT), ``pp<i>.<fqn>`` when they repeat (a fresh ``nn.Sequential``
per stage), in every write path, and plain ``dcp.load`` reads each stage back (in process,
no processes or groups)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from baft.engine.device import HostCopy
from baft.engine.flat import FlatState
from baft.engine.persisting import LiveCopy, slot_views
from baft.model.gpt import GPTStage
from baft.pipeline.state import TrainingState
from baft.store.disk import PersistKeys, check_persist_keys, choose_persist_keys
from baft.store.keys import loading_keys
from tests.dist.runs import TINY_MODEL


def _sequential(stage: int) -> nn.Sequential:
    torch.manual_seed(stage)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4) if stage == 0 else nn.GELU())


def _flat_names(module: nn.Module, pp: int) -> list[tuple[str, torch.Tensor]]:
    """A stage's flat state as the engine names it (``extra.*`` with its coordinates)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    state = TrainingState([module], opt, install_step_hook=False)
    return [
        (f"extra.pp{pp}.tp0.{n.removeprefix('extra.')}" if n.startswith("extra.") else n, t)
        for n, t in state.tensors()
    ]


def test_repeated_fqns_across_stages_get_stage_keys() -> None:
    stages = {pp: _flat_names(_sequential(pp), pp) for pp in (0, 1)}
    scheme, reason = choose_persist_keys([(pp, [n for n, _ in s]) for pp, s in stages.items()])
    assert (scheme, reason) == (
        "pp",
        "DCP keys carry the pipeline stage (pp<i>.<fqn>): '0.weight' is on pp0 and pp1",
    )
    keys = [PersistKeys(scheme=scheme, pp=pp) for pp in (0, 1)]
    assert [keys[1](n) for n, _ in stages[1]] == [
        "pp1.0.weight",
        "pp1.0.bias",
        "pp1.optim.0.weight.momentum_buffer",
        "pp1.optim.0.bias.momentum_buffer",
        "extra.pp1.tp0.meta.SGD",
        "extra.pp1.tp0.optim.created",
        "extra.pp1.tp0.rng.cpu",
    ]
    assert keys[0]("buffer.1.running_mean") == "pp0.1.running_mean"
    written = [keys[pp](n) for pp, s in stages.items() for n, _ in s]
    assert len(set(written)) == len(written)


def test_distinct_fqns_keep_plain_keys() -> None:
    cfg = TINY_MODEL
    first = GPTStage(cfg, 0, 2, has_embed=True, has_head=False)
    last = GPTStage(cfg, 2, 4, has_embed=False, has_head=True)
    names = [(0, [f"model.{n}" for n, _ in first.named_parameters()])]
    names.append((1, [f"model.{n}" for n, _ in last.named_parameters()]))
    # TP peers of one stage send the same names: no clash
    names.append((1, names[1][1]))
    scheme, reason = choose_persist_keys(names)
    assert (scheme, reason) == (
        "torch",
        "DCP keys are the plain FQNs, optimizer state as torch's flattened optimizer "
        "state dict under 'optimizer.' (unique across pipeline stages)",
    )
    key = PersistKeys(scheme=scheme, pp=1)
    assert key("model.layers.2.attn.qkv.weight") == "layers.2.attn.qkv.weight"
    assert key("buffer.layers.2.attn.mask") == "layers.2.attn.mask"
    assert key("optim.layers.2.attn.qkv.weight.exp_avg") == (
        "optimizer.state.layers.2.attn.qkv.weight.exp_avg"
    )
    assert key("extra.pp1.tp0.rng.cpu") == "extra.pp1.tp0.rng.cpu"
    hypers = [{"lr": 0.5, "betas": (0.9, 0.95), "params": [0, 1]}, {"lr": 0.1}]
    assert key.param_groups([["a.w", "a.b"], ["c.w"]], hypers) == {
        "optimizer.param_groups.a.w.lr": 0.5,
        "optimizer.param_groups.a.w.betas": (0.9, 0.95),
        "optimizer.param_groups.a.b.lr": 0.5,
        "optimizer.param_groups.a.b.betas": (0.9, 0.95),
        "optimizer.param_groups.c.w.lr": 0.1,
    }
    # the older schemes carry no param groups, and keep their optimizer names
    assert PersistKeys(scheme="fqn").param_groups([["a.w"]], hypers[:1]) == {}
    assert PersistKeys(scheme="fqn")("optim.a.w.exp_avg") == "optim.a.w.exp_avg"


def test_torch_keys_are_what_torch_flattens_an_optimizer_into() -> None:
    """The keys of a "torch" checkpoint are ``"optimizer." +`` the keys of torch's own
    flattened optimizer state dict, so a user's ``{"optimizer": osd}`` loads them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    osd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state = TrainingState([model], opt, install_step_hook=False)
    key = PersistKeys(scheme="torch")
    fqns = [n for n, _ in model.named_parameters()]
    ours = {key(n) for n, _ in state.tensors() if n.startswith("optim.")}
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    ours |= set(key.param_groups([fqns], hypers))
    assert ours == {f"optimizer.{k}" for k in osd}


def test_a_fqn_checkpoint_restores_into_a_torch_job() -> None:
    assert loading_keys({}, PersistKeys(pp=1), "ck") == PersistKeys(scheme="fqn", pp=1)
    assert loading_keys({"dcp_keys": "torch"}, PersistKeys(), "ck") == PersistKeys()


def test_every_write_path_keys_by_stage_and_plain_dcp_loads_each_stage(tmp_path: Path) -> None:
    """Full snapshots (slot_views) and differential copies (LiveCopy) of two stages into
    one checkpoint; a user maps ``pp<i>.`` back onto stage i's fresh module."""
    modules = [_sequential(0), _sequential(1)]
    for m in modules:  # non-trivial values, distinct per stage
        for p in m.parameters():
            p.data.add_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape))
        for t in m.buffers():  # BatchNorm statistics that training moved
            t.add_(torch.arange(1, t.numel() + 1, dtype=t.dtype).view(t.shape))
    written: dict[str, torch.Tensor] = {}
    for pp, m in enumerate(modules):
        key = PersistKeys(scheme="pp", pp=pp)
        named = [(f"model.{n}", p.detach()) for n, p in m.named_parameters()]
        named += [(f"buffer.{n}", b) for n, b in m.named_buffers()]  # BatchNorm's
        flat = FlatState(named)
        data = torch.empty(flat.nbytes, dtype=torch.uint8)  # a committed slot's bytes
        for dst, src in flat.pairs(flat.pieces(0, flat.nbytes), data):
            dst.copy_(src)
        views = slot_views(flat, data, 0, flat.nbytes, key)
        live = LiveCopy(torch.device("cpu"), key)
        copier = HostCopy()
        live.start(3, named, copier)
        copier.synchronize()
        copied = live.take(3)
        assert copied is not None
        assert sorted(views) == sorted(copied) == sorted(f"pp{pp}.{n}" for n in m.state_dict())
        assert f"pp{pp}.0.weight" in views
        for k in views:
            assert torch.equal(views[k], copied[k]), k
        assert not set(views) & set(written)
        written.update(views)
    dcp.save(written, checkpoint_id=str(tmp_path), no_dist=True)
    for pp, m in enumerate(modules):
        fresh = _sequential(pp)
        want = {n: t.clone() for n, t in m.state_dict().items()}
        # the user's mapping: stage i's own state_dict() keys behind pp<i>.
        target = {f"pp{pp}.{n}": t for n, t in fresh.state_dict().items()}
        dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
        assert sorted(fresh.state_dict()) == sorted(want)
        for n, t in fresh.state_dict().items():
            assert torch.equal(t, want[n]), (pp, n)


def test_a_restore_refuses_a_checkpoint_of_another_scheme() -> None:
    check_persist_keys({"dcp_keys": "pp"}, PersistKeys(scheme="pp", pp=1), "ck/v00000004")
    check_persist_keys({}, PersistKeys(), "ck/v00000004")  # written before the scheme
    check_persist_keys({"dcp_keys": "fqn"}, PersistKeys(), "ck/v00000004")
    with pytest.raises(ValueError) as e:
        check_persist_keys({}, PersistKeys(scheme="pp", pp=1), "ck/v00000004")
    assert str(e.value) == (
        "ck/v00000004 keys tensors by their plain FQNs, but this job's pipeline stages share "
        "FQNs: its stages overwrote each other's tensors in it, so it cannot be restored "
        "(written by a baft without stage-unique keys). Delete it, or pick another "
        "CheckpointConfig.persist.dir, and start over (allow_fresh_start=True)"
    )
    with pytest.raises(ValueError) as e:
        check_persist_keys({"dcp_keys": "pp"}, PersistKeys(), "ck/v00000004")
    assert str(e.value) == (
        "ck/v00000004 keys tensors as 'pp' (pp<i>.<fqn>: its stages shared FQNs), but "
        "this job's FQNs are unique across stages, so its model differs from the saved "
        "one; restore it with the model it was written with"
    )


def test_write_paths_read_tensors_at_unaligned_offsets() -> None:
    """Flat states have no padding: a float tensor after 3 bytes sits at an offset torch
    cannot view as float32. Both write paths read it through a copy (a view raised
    'storage_offset() must be divisible by 4')."""
    named = [
        ("extra.created", torch.tensor([1, 0, 1], dtype=torch.uint8)),
        ("model.w", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("model.h", torch.arange(5, dtype=torch.float16)),
        ("model.d", torch.arange(3, dtype=torch.float64)),
    ]
    flat = FlatState(named)
    data = torch.empty(flat.nbytes, dtype=torch.uint8)
    for dst, src in flat.pairs(flat.pieces(0, flat.nbytes), data):
        dst.copy_(src)
    views = slot_views(flat, data, 0, flat.nbytes, PersistKeys())
    live = LiveCopy(torch.device("cpu"), PersistKeys())
    copier = HostCopy()
    live.start(5, named, copier)
    copier.synchronize()
    copied = live.take(5)
    assert copied is not None
    for got in (views, copied):
        assert sorted(got) == ["d", "extra.created", "h", "w"]
        for name, t in named:
            key = name.removeprefix("model.")
            assert got[key].dtype == t.dtype and torch.equal(got[key], t), key


def test_replicas_share_whole_tensors_and_buffers_come_from_the_first() -> None:
    """A version's buffers are captured before the loop syncs them from the first replica
    (BatchNorm statistics): only replica 0 persists them."""
    import torch

    from baft.engine.persisting import replica_share

    t = torch.zeros(1)
    named = [(n, t) for n in ("model.a", "buffer.bn.running_mean", "model.b", "buffer.bn.running_var", "model.c")]  # fmt: skip
    first = [n for n, _ in replica_share(named, 0, 2)]
    second = [n for n, _ in replica_share(named, 1, 2)]
    assert first == ["model.a", "model.c", "buffer.bn.running_mean", "buffer.bn.running_var"]
    assert second == ["model.b"]
    assert sorted(first + second) == sorted(n for n, _ in named)
