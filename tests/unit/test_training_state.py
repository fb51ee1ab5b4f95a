"""TrainingState: the fixed tensor list of all training state, its exact optimizer-state
creation, the safe small-state encoding, capture/apply round trips and mismatch errors."""

from __future__ import annotations

import collections
import copy
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler as lrs

from baft.engine.flat import FlatState, byte_view
from baft.pipeline.encoding import decode_blob, encode_blob
from baft.pipeline.optim_state import (
    check_optimizer,
    decode_hypers,
    encode_hypers,
    init_optimizer_state,
    load_param_group_hypers,
    param_group_hypers,
)
from baft.pipeline.small_state import decode_record
from baft.pipeline.state import TrainingState

# ---------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core machine: intra-op threads only add waiting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Net(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(hidden, 2)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("cache", torch.arange(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x))))) * self.scale


class Sampler:
    """A stateful sampler: its own generator and a position (what a data loader saves)."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.pos = 0
        self.seen: list[int] = []

    def next(self) -> torch.Tensor:
        self.pos += 1
        idx = torch.randint(0, 64, (6,), generator=self.gen)
        self.seen.append(int(idx[0]))
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state(), "pos": self.pos, "seen": tuple(self.seen)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["gen"])
        self.pos = sd["pos"]
        self.seen = list(sd["seen"])


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.fail = False

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.fail:
            raise KeyError("counter refuses")
        self.n = sd["n"]


DATA_X = torch.linspace(-1, 1, 64 * 4).reshape(64, 4)
DATA_Y = torch.sin(DATA_X[:, :2] * 3)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "bn" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "bn" not in n)]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.1),
    "sgd_momentum": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
    "sgd_dampening": lambda g: torch.optim.SGD(
        g, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01
    ),
    "sgd_nesterov_foreach": lambda g: torch.optim.SGD(
        g, lr=0.1, momentum=0.9, nesterov=True, foreach=True
    ),
    "sgd_fused": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda g: torch.optim.Adam(g, lr=0.01),
    "adam_amsgrad_foreach": lambda g: torch.optim.Adam(g, lr=0.01, amsgrad=True, foreach=True),
    "adam_fused": lambda g: torch.optim.Adam(g, lr=0.01, fused=True),
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1),
    "adamw_tensor_lr": lambda g: torch.optim.AdamW(g, lr=torch.tensor(0.01), foreach=False),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.1, initial_accumulator_value=0.1),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=0.01),
    "rmsprop_momentum_centered": lambda g: torch.optim.RMSprop(
        g, lr=0.01, momentum=0.5, centered=True
    ),
}
STATE_KEYS = {
    "sgd": [],
    "sgd_momentum": ["momentum_buffer"],
    "sgd_dampening": ["momentum_buffer"],
    "sgd_nesterov_foreach": ["momentum_buffer"],
    "sgd_fused": ["momentum_buffer"],
    "adam": ["exp_avg", "exp_avg_sq", "step"],
    "adam_amsgrad_foreach": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"],
    "adam_fused": ["exp_avg", "exp_avg_sq", "step"],
    "adamw": ["exp_avg", "exp_avg_sq", "step"],
    "adamw_tensor_lr": ["exp_avg", "exp_avg_sq", "step"],
    "adagrad": ["step", "sum"],
    "rmsprop": ["square_avg", "step"],
    "rmsprop_momentum_centered": ["grad_avg", "momentum_buffer", "square_avg", "step"],
}


class Run:
    """One training loop as a user writes it: warmup scheduler, clipping, a sampler."""

    def __init__(self, opt: str, seed: int = 0, hidden: int = 8, protect: bool = True) -> None:
        torch.manual_seed(seed)
        self.model = Net(hidden)
        self.opt = OPTIMIZERS[opt](groups(self.model))
        warmup = lrs.LinearLR(self.opt, start_factor=0.1, total_iters=2)
        lam = lrs.LambdaLR(self.opt, lambda i: 0.9**i)
        self.sched = lrs.SequentialLR(self.opt, [warmup, lam], milestones=[2])
        self.sampler = Sampler(seed)
        self.counter = Counter()
        self.ts = (
            TrainingState(
                [self.model],
                self.opt,
                {"lr_scheduler": self.sched, "sampler": self.sampler, "counter": self.counter},
            )
            if protect
            else None
        )

        self.rng = torch.get_rng_state()
        """This run's global RNG stream (dropout), so that runs can interleave."""

    def train(self, steps: int) -> None:
        torch.set_rng_state(self.rng)
        for _ in range(steps):
            if self.ts is not None:
                self.ts.capture()
            idx = self.sampler.next()
            self.opt.zero_grad()
            loss = F.mse_loss(self.model(DATA_X[idx]), DATA_Y[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
            self.opt.step()
            self.sched.step()
            self.counter.n += 1
        self.rng = torch.get_rng_state()

    def capture(self) -> None:
        """The engine at a version's start."""
        assert self.ts is not None
        torch.set_rng_state(self.rng)
        self.ts.capture()

    def restore_from(self, other: Run, only: Callable[[str], bool] = lambda n: True) -> None:
        """The engine's restore: saved bytes into the live tensors, then apply."""
        assert self.ts is not None and other.ts is not None
        copy_bytes(other.ts, self.ts, only)
        torch.set_rng_state(self.rng)
        try:
            self.ts.apply()
        finally:
            self.rng = torch.get_rng_state()


def same(a: Any, b: Any) -> bool:
    """Deep equality that also compares types and exact float bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and bytes(byte_view(a.contiguous()).numpy()) == bytes(byte_view(b.contiguous()).numpy())
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(a == b)


def sched_state(s: lrs.LRScheduler) -> dict[str, Any]:
    sd = s.state_dict()
    sd["_schedulers"] = [x.state_dict() for x in s._schedulers]  # type: ignore[attr-defined]
    return sd


def assert_same_run(a: Run, b: Run) -> None:
    assert same(a.model.state_dict(), b.model.state_dict())
    assert same(a.opt.state_dict(), b.opt.state_dict())
    assert same(sched_state(a.sched), sched_state(b.sched))
    assert same(a.sampler.state_dict(), b.sampler.state_dict())
    assert a.counter.n == b.counter.n


def copy_bytes(
    src: TrainingState, dst: TrainingState, only: Callable[[str], bool] = lambda n: True
) -> None:
    """What the engine does on restore: write the saved bytes into the live tensors."""
    for (n1, t1), (n2, t2) in zip(src.tensors(), dst.tensors(), strict=True):
        assert n1 == n2
        if only(n1):
            byte_view(t2).copy_(byte_view(t1))


def small_state(r: Run) -> tuple[Any, ...]:
    return (
        param_group_hypers(r.opt),
        sched_state(r.sched),
        r.sampler.state_dict(),
        r.counter.n,
        torch.get_rng_state(),
    )


# ---------------------------------------------------------------------- layout


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_layout_is_fixed_from_iteration_zero(opt: str) -> None:
    r = Run(opt)
    assert r.ts is not None
    before = r.ts.layout()
    r.train(3)
    assert r.ts.layout() == before
    r.ts.check_live()
    # A TrainingState built after training has the same layout (what a restart builds).
    assert TrainingState([r.model], r.opt, r.ts.stateful).layout() == before
    names = [i.name for i in before]
    params = [f for f, _ in r.model.named_parameters()]
    expected = (
        [f"model.{f}" for f in params]
        + ["buffer.scale", "buffer.bn.running_mean", "buffer.bn.running_var"]
        + ["buffer.bn.num_batches_tracked"]
        + [f"optim.{f}.{k}" for f in params for k in STATE_KEYS[opt]]
        + [f"extra.meta.{type(r.opt).__name__}"]
        + ["extra.state.counter", "extra.state.lr_scheduler", "extra.state.sampler"]
        + (["extra.optim.created"] if opt.startswith("sgd_") else [])
        + ["extra.rng.cpu"]
    )
    assert names == expected  # non-persistent buffer "cache" is not saved
    sizes = {i.name: i.nbytes for i in before}
    assert sizes["model.fc1.weight"] == 4 * 8 * 4
    assert sizes["buffer.bn.num_batches_tracked"] == 8
    assert sizes["extra.rng.cpu"] == torch.get_rng_state().numel()
    assert sizes["extra.state.sampler"] == 64 * 1024
    # The tensors are the live ones: optimizers update their state in place.
    live = {id(local) for st in r.opt.state.values() for local in st.values()}
    assert all(id(t) in live for n, t in r.ts.tensors() if n.startswith("optim."))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_precreated_state_gives_the_same_trajectory(opt: str) -> None:
    plain, protected = Run(opt, protect=False), Run(opt)
    for _ in range(2):
        plain.train(3)
        protected.train(3)
        assert_same_run(plain, protected)
    # The state this module created has exactly the dtype/device/shape a first step makes.
    for sa, sb in zip(plain.opt.state.values(), protected.opt.state.values(), strict=True):
        assert {k: (v.dtype, v.device, v.shape) for k, v in sa.items()} == {
            k: (v.dtype, v.device, v.shape) for k, v in sb.items()
        }


def test_buffers_are_copied_at_capture_not_read_live() -> None:
    r = Run("adam")
    assert r.ts is not None
    r.capture()
    snap = dict(r.ts.tensors())["buffer.bn.running_mean"]
    before = snap.clone()
    r.model(DATA_X[:6])  # a forward pass in train mode moves BatchNorm's statistics
    assert not torch.equal(r.model.bn.running_mean, before)
    assert torch.equal(snap, before)  # what the engine copies in bubbles stays version v
    r.capture()
    assert torch.equal(snap, r.model.bn.running_mean)
    r.model.bn.running_mean = torch.zeros(3)  # reassigned with another shape
    with pytest.raises(ValueError, match="buffer 'running_mean' of BatchNorm1d .*changed shape"):
        r.capture()


def test_sgd_momentum_from_zeros_would_not_be_exact() -> None:
    """Why SGD's momentum buffer is deferred: zeros + the step's mul_/add_ is not clone(grad)."""
    plain, zeros = Run("sgd_dampening", protect=False), Run("sgd_dampening", protect=False)
    for g in zeros.opt.param_groups:
        for p in g["params"]:
            zeros.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    plain.train(2)
    zeros.train(2)
    assert not same(plain.model.state_dict(), zeros.model.state_dict())


def test_sgd_momentum_buffer_is_created_by_the_first_step_then_adopted() -> None:
    r = Run("sgd_momentum")
    assert r.ts is not None
    p = r.model.fc1.weight
    holder = dict(r.ts.tensors())["optim.fc1.weight.momentum_buffer"]
    assert "momentum_buffer" not in r.opt.state.get(p, {})
    assert dict(r.ts.tensors())["extra.optim.created"].tolist() == [0, 0, 0, 0, 0, 0]
    r.train(1)
    assert r.opt.state[p]["momentum_buffer"] is holder
    assert dict(r.ts.tensors())["extra.optim.created"].tolist() == [1, 1, 1, 1, 1, 1]


def test_adagrad_state_comes_from_its_constructor() -> None:
    opt = torch.optim.Adagrad([nn.Parameter(torch.ones(3))], initial_accumulator_value=0.5)
    before = {k: v for st in opt.state.values() for k, v in st.items()}
    init_optimizer_state(opt)
    after = {k: v for st in opt.state.values() for k, v in st.items()}
    assert after.keys() == {"step", "sum"} and all(after[k] is before[k] for k in after)
    assert torch.equal(after["sum"], torch.full((3,), 0.5))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.LBFGS(ps),
        lambda ps: torch.optim.SparseAdam(ps),
        lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps),
        lambda ps: torch.optim.Adam(ps, differentiable=True),
    ],
)
def test_unsupported_optimizers_are_named(make: Callable[[Any], Any]) -> None:
    opt = make([nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="SGD, Adam, AdamW, Adagrad, RMSprop|differentiable"):
        check_optimizer(opt)
    with pytest.raises(ValueError):
        TrainingState([], opt)


def test_optimizer_params_outside_the_modules_are_refused() -> None:
    model = Net()
    opt = torch.optim.Adam([*model.parameters(), nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="1 parameters that are in none of the stage modules"):
        TrainingState([model], opt)


# ---------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    ("opt", "steps"),
    [
        ("adamw", 3),
        ("adamw_tensor_lr", 3),
        ("sgd_dampening", 0),
        ("sgd_dampening", 3),
        ("rmsprop_momentum_centered", 2),
    ],
)
def test_capture_copy_apply_restores_everything(opt: str, steps: int) -> None:
    a = Run(opt)
    a.train(steps)
    a.capture()  # the version's start
    assert a.ts is not None
    b = Run(opt, seed=7)  # a fresh process: different init, nothing trained
    assert b.ts is not None
    b.ts.check_layout(a.ts.layout())
    b.ts.check_restored(dict(a.ts.tensors()).__getitem__)
    b.restore_from(a)
    assert_same_run(a, b)
    assert b.ts.digests() == a.ts.digests()
    assert same(b.rng, a.rng)
    # Both continue bit-identically (dropout draws, batches, BatchNorm statistics).
    a.train(3)
    b.train(3)
    assert_same_run(a, b)
    assert a.sampler.seen == b.sampler.seen and len(b.sampler.seen) == steps + 3


def test_engine_flat_state_round_trip() -> None:
    """Through the engine's FlatState: one byte range out of a, written into b."""
    a, b = Run("sgd_nesterov_foreach"), Run("sgd_nesterov_foreach", seed=9)
    assert a.ts is not None and b.ts is not None
    a.train(2)
    a.capture()
    flat_a, flat_b = FlatState(a.ts.tensors()), FlatState(b.ts.tensors())
    assert flat_a.specs() == flat_b.specs()
    saved = torch.cat([byte_view(t).clone() for t in flat_a.tensors])
    assert saved.numel() == flat_a.nbytes
    b.ts.check_layout([(sp.name, sp.nbytes) for sp in flat_a.specs()])
    flat_b.write_from(0, saved)
    torch.set_rng_state(b.rng)
    b.ts.apply()
    b.rng = torch.get_rng_state()
    assert_same_run(a, b)
    a.train(2)
    b.train(2)
    assert_same_run(a, b)


def test_apply_restores_the_rng_state() -> None:
    a = Run("adam")
    assert a.ts is not None
    torch.manual_seed(123)
    a.ts.capture()
    expected = torch.rand(4)
    b = Run("adam", seed=5)
    assert b.ts is not None
    copy_bytes(a.ts, b.ts)
    torch.manual_seed(999)
    b.ts.apply()
    assert torch.equal(torch.rand(4), expected)


def test_restore_at_version_zero_drops_uncreated_momentum() -> None:
    a = Run("sgd_momentum")
    b = Run("sgd_momentum", seed=3)
    assert a.ts is not None and b.ts is not None
    b.train(2)  # b's live optimizer has momentum buffers; a's version 0 has none
    a.capture()
    b.restore_from(a)
    assert all("momentum_buffer" not in st for st in b.opt.state.values())
    assert dict(b.ts.tensors())["extra.optim.created"].tolist() == [0] * 6
    a.train(2)
    b.train(2)
    assert_same_run(a, b)


# ---------------------------------------------------------------------- mismatches


def assert_small_state_unchanged(r: Run, before: tuple[Any, ...]) -> None:
    assert same(small_state(r), before)


def test_changed_model_is_named() -> None:
    a, b = Run("adam"), Run("adam", hidden=9)
    assert a.ts is not None and b.ts is not None
    with pytest.raises(ValueError, match=r"resized: .*model\.bn\.bias \(32 -> 36 bytes\)"):
        b.ts.check_layout(a.ts.layout())
    copy_bytes(a.ts, b.ts, only=lambda n: n.startswith("extra."))
    before = small_state(b)
    with pytest.raises(ValueError, match="param groups differ"):
        b.ts.apply()
    assert_small_state_unchanged(b, before)


def test_different_optimizer_class_is_named() -> None:
    a, b = Run("adam"), Run("adamw")
    assert a.ts is not None and b.ts is not None
    a.train(1)
    a.ts.capture()
    # same tensors: the layout check (before any byte is written) names the optimizers
    with pytest.raises(ValueError) as err:
        b.ts.check_layout(a.ts.layout())
    assert str(err.value) == "the state was saved with optimizer Adam, this run uses AdamW"
    # and the meta record itself, should the bytes be written anyway
    for (_, t), (_, u) in zip(a.ts.tensors(), b.ts.tensors(), strict=True):
        byte_view(u).copy_(byte_view(t))
    before = small_state(b)
    with pytest.raises(
        ValueError, match=r"optimizer torch\.optim\.adam\.Adam, this run uses .*AdamW"
    ):
        b.ts.apply()
    assert_small_state_unchanged(b, before)


def test_missing_state_key_is_named() -> None:
    a = Run("adam")
    assert a.ts is not None
    torch.manual_seed(1)
    model = Net()
    opt = OPTIMIZERS["adam"](groups(model))
    sched = lrs.SequentialLR(
        opt, [lrs.LinearLR(opt, 0.1, total_iters=2), lrs.LambdaLR(opt, lambda i: 0.9**i)], [2]
    )
    b = TrainingState([model], opt, {"lr_scheduler": sched, "counter": Counter()})
    with pytest.raises(ValueError, match=r"saved but absent now: extra\.state\.sampler"):
        b.check_layout(a.ts.layout())
    for n, t in b.tensors():
        if n.startswith("extra."):
            byte_view(t).copy_(byte_view(dict(a.ts.tensors())[n]))
    sd = sched.state_dict()
    with pytest.raises(ValueError, match=r"state= keys differ.*missing \['sampler'\]"):
        b.apply()
    assert same(sched.state_dict(), sd)


def test_changed_state_object_class_is_named() -> None:
    a = Run("adam")
    b = Run("adam")
    assert a.ts is not None
    b.ts = TrainingState(
        [b.model], b.opt, {"lr_scheduler": b.sched, "sampler": Counter(), "counter": b.counter}
    )
    copy_bytes(a.ts, b.ts)
    with pytest.raises(
        ValueError,
        match=r"state\['sampler'\] was saved from a .*Sampler, this run registers a .*Counter",
    ):
        b.ts.apply()


def test_failing_load_rolls_back_the_others() -> None:
    a, b = Run("adamw"), Run("adamw", seed=4)
    assert a.ts is not None and b.ts is not None
    a.train(3)
    a.ts.capture()
    b.train(1)
    copy_bytes(a.ts, b.ts)
    b.counter.fail = True  # "counter" loads after "lr_scheduler" and "sampler"
    b.ts.stateful = {"lr_scheduler": b.sched, "sampler": b.sampler, "counter": b.counter}
    before = small_state(b)
    with pytest.raises(
        ValueError, match=r"state\['counter'\]\.load_state_dict failed.*counter refuses"
    ):
        b.ts.apply()
    assert_small_state_unchanged(b, before)


def test_malformed_or_foreign_records_are_value_errors() -> None:
    r = Run("adam")
    assert r.ts is not None
    meta = dict(r.ts.tensors())["extra.meta.Adam"]
    assert decode_record(meta)["optimizer"] == "torch.optim.adam.Adam"
    before = small_state(r)
    payload = b'{"d":[["format",1]]}'  # a valid record without the fields
    meta[:8].copy_(
        torch.frombuffer(bytearray(b"BFTS" + len(payload).to_bytes(4, "little")), dtype=torch.uint8)
    )
    meta[8 : 8 + len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    with pytest.raises(ValueError, match="malformed"):
        r.ts.apply()
    meta.zero_()
    with pytest.raises(ValueError, match="not a baft state record"):
        r.ts.apply()
    assert_small_state_unchanged(r, before)
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_blob(b"[" * 100000)


def test_capacity_exceeded_names_object_and_setting() -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    big = Counter()
    big.n = 10**600
    with pytest.raises(
        ValueError, match=r"state\['big'\].*capacity; raise extra_capacity_bytes \(key 'big'\)"
    ):
        TrainingState([model], opt, {"big": big}, extra_capacity_bytes={"big": 256})
    small = Counter()
    ts = TrainingState([model], opt, {"c": small}, extra_capacity_bytes=256)
    assert dict(ts.tensors())["extra.state.c"].numel() == 256
    assert dict(ts.tensors())["extra.meta.Adam"].numel() == 4096 + 2048  # floor: one param group
    small.n = 10**600  # grows later: the layout stays, capture says what to raise
    with pytest.raises(ValueError, match=r"state\['c'\].*extra_capacity_bytes"):
        ts.capture()


def test_replaced_live_tensor_is_detected() -> None:
    r = Run("adam")
    assert r.ts is not None
    r.train(1)
    r.opt.load_state_dict(copy.deepcopy(r.opt.state_dict()))  # new state tensors
    with pytest.raises(RuntimeError, match=r"optim\..* is no longer the live tensor"):
        r.ts.check_live()


def test_lr_scheduler_keys_and_partial_capture() -> None:
    r = Run("adam")
    assert r.ts is not None
    assert r.ts.lr_scheduler_keys() == ["lr_scheduler"]
    digests = r.ts.digests()
    r.counter.n += 1
    r.sampler.next()
    r.ts.capture(buffers=False, rng=False, optimizer=False, state=["counter"])
    changed = {n for n, d in r.ts.digests().items() if d != digests[n]}
    assert changed == {"extra.state.counter"}


def test_bad_state_key_and_non_stateful_are_refused() -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="state key 'a b'"):
        TrainingState([model], opt, {"a b": Counter()})
    with pytest.raises(ValueError, match=r"state\['x'\].*has no state_dict"):
        TrainingState([model], opt, {"x": object()})  # type: ignore[dict-item]


# ---------------------------------------------------------------------- encoding


def zoo() -> dict[Any, Any]:
    return {
        "floats": [0.1, -0.0, math.inf, -math.inf, 1e-310, 2.0**60],
        "nan": float("nan"),
        "int": 10**30,
        "bools": (True, False, None),
        1: "int key",
        (2, "t"): "tuple key",
        "nested": OrderedDict([("a", [1, (2, [3.5])]), ("b", {})]),
        "tensors": [
            torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            torch.empty(0, 2),
            torch.tensor(True),
        ],
        "bytes": b"\x00\xff",
        "numpy": (np.arange(4, dtype=np.int16).reshape(2, 2), np.float32(1.5), np.int64(-3)),
        "size": torch.Size([2, 3]),
        "counter": collections.Counter({2: 1, "x": 3}),
        "dtype": torch.float16,
    }


def test_encoding_round_trips_types_and_bits() -> None:
    value = zoo()
    back = decode_blob(encode_blob(value, "zoo"))
    assert same(value, back)
    assert type(back["nan"]) is float and math.isnan(back["nan"])
    assert type(back["numpy"][1]) is np.float32 and back["numpy"][1] == np.float32(1.5)
    assert back["dtype"] is torch.float16


def test_encoding_refuses_what_it_cannot_save_and_names_where() -> None:
    class Thing:
        pass

    with pytest.raises(ValueError, match=r"x\['a'\]\[1\]: values of type .*Thing cannot be saved"):
        encode_blob({"a": [1, Thing()]}, "x")
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_blob(b"\x80abc")
    with pytest.raises(ValueError, match="unknown state record tag"):
        decode_blob(b'{"pickle":"x"}')
    with pytest.raises(ValueError, match="does not hold"):
        decode_blob(b'{"T":["float32",[4],"AAAA","cpu"]}')


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda o: lrs.StepLR(o, 2),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, [2, 2, 4]),
    "ConstantLR": lambda o: lrs.ConstantLR(o),
    "LinearLR": lambda o: lrs.LinearLR(o, 0.1, total_iters=3),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, 0.9),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, 10),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, 3),
    "CyclicLR": lambda o: lrs.CyclicLR(o, 0.01, 0.1),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, 0.1, total_steps=20),
    "ReduceLROnPlateau": lambda o: lrs.ReduceLROnPlateau(o, patience=0),
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda i: 0.9**i),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda i: 0.9),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler(
        [lrs.ConstantLR(o), lrs.ExponentialLR(o, 0.9)]
    ),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o, [lrs.LinearLR(o, 0.1), lrs.ExponentialLR(o, 0.9)], [2]
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_scheduler_round_trips(name: str) -> None:
    def make() -> tuple[torch.optim.Optimizer, Any]:
        o = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
        return o, SCHEDULERS[name](o)

    def step(o: torch.optim.Optimizer, s: Any) -> None:
        o.step()
        s.step(1.0) if name == "ReduceLROnPlateau" else s.step()

    (o1, s1), (o2, s2) = make(), make()
    for _ in range(4):
        step(o1, s1)
    sd = s1.state_dict()
    back = decode_blob(encode_blob(sd, name))
    assert same(back, sd)
    s2.load_state_dict(back)
    load_param_group_hypers(o2, decode_hypers(encode_hypers(param_group_hypers(o1))))
    for _ in range(3):
        step(o1, s1)
        step(o2, s2)
    assert same(s1.state_dict(), s2.state_dict())
    assert same(param_group_hypers(o1), param_group_hypers(o2))


def test_hypers_round_trip_exactly_and_load_in_place() -> None:
    model = Net()
    opt = torch.optim.AdamW(groups(model), lr=torch.tensor(0.01), foreach=False)
    lrs.LinearLR(opt, start_factor=0.1, total_iters=4)  # adds initial_lr, scales lr
    hypers = param_group_hypers(opt)
    assert isinstance(hypers[0]["lr"], torch.Tensor) and hypers[0]["betas"] == (0.9, 0.999)
    back = decode_hypers(encode_hypers(hypers))
    assert same(back, hypers)
    lr_tensor = opt.param_groups[0]["lr"]
    lr_tensor.fill_(5.0)
    opt.param_groups[1]["eps"] = 0.5
    load_param_group_hypers(opt, back)
    assert opt.param_groups[0]["lr"] is lr_tensor and same(lr_tensor, hypers[0]["lr"])
    assert same(param_group_hypers(opt), hypers)
    wrong = [dict(h) for h in back]
    del wrong[1]["eps"]
    with pytest.raises(ValueError, match=r"param group 1: .*missing \['eps'\]"):
        load_param_group_hypers(opt, wrong)
    with pytest.raises(ValueError, match="saved state has 1 param groups, the optimizer has 2"):
        load_param_group_hypers(opt, back[:1])


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_digests_cover_buffers_and_small_state() -> None:
    a, b = Run("adam"), Run("adam")
    assert a.ts is not None and b.ts is not None
    da = a.ts.digests()
    assert list(da) == [n for n, _ in a.ts.tensors()]
    assert da == b.ts.digests()
    a.model.bn.running_mean.add_(1)
    a.sched.step()
    a.ts.capture()
    changed = {n for n in da if a.ts.digests()[n] != da[n]}
    assert changed == {"buffer.bn.running_mean", "extra.meta.Adam", "extra.state.lr_scheduler"}


def test_a_version_takes_its_buffers_at_its_start_after_the_loops_replica_sync() -> None:
    """With DP replicas a loop syncs BatchNorm's statistics from the first replica after
    ``optimizer.step()`` (as DDP does). The copy taken right after the step holds this
    replica's own statistics; the version's start (its first ``schedule.step``) must take
    them again, or a replica owning the buffers' bytes in a memory checkpoint restores
    its own statistics and the run leaves the trajectory."""
    from baft.pipeline.step import StepRunner

    r = Run("adam")
    assert r.ts is not None
    runner = SimpleNamespace(state=r.ts)
    r.model(DATA_X[:6])  # this replica's statistics
    StepRunner.capture_after_step(runner)  # type: ignore[arg-type]
    synced = torch.full_like(r.model.bn.running_mean, 0.25)  # the first replica's
    r.model.bn.running_mean.copy_(synced)  # the loop's broadcast
    StepRunner.capture_at_start(runner)  # type: ignore[arg-type]
    assert torch.equal(dict(r.ts.tensors())["buffer.bn.running_mean"], synced)
