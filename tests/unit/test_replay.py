"""Differential recovery is bit-exact: full copies from a k=3 rotation + replayed records.

A small model trains N steps under an LR scheduler (OneCycleLR: lr every step, and
momentum/betas where the optimizer has them) with gradient clipping before the step and
one param that gets a gradient only on odd steps. A step pre-hook records what each step
consumed; full copies of every tensor group are kept at every version. For each target
version v, a fresh model and optimizer are loaded with each group's copy from its
rotation base (plan/rotation.py) and ``replay`` applies the records; params, optimizer
state (``step`` included) and param-group entries must equal the uninterrupted run's.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from baft.pipeline.replay import REPLAY_SAFE, StepRecord, record_step, replay, replay_safe
from baft.plan.rotation import TensorGroup, assign_slices, base_version

N_STEPS = 7
K = 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CPU_ONLY = {"adagrad-fused"}
"""Cases torch has no kernel for on CUDA (Adagrad's fused step is CPU-only; seen on an
H200 with torch 2.11)."""


def _skip_unsupported(case: str, device: str) -> None:
    if device == "cuda" and case in CPU_ONLY:
        pytest.skip(f"{case}: torch has no CUDA kernel for it")


"""CUDA runs the foreach/fused multi-tensor kernels, where the subset property matters most."""
Factory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def _sgd(**kw: Any) -> Factory:
    return lambda groups: torch.optim.SGD(groups, lr=0.1, **kw)


def _cls(cls: type[torch.optim.Optimizer], **kw: Any) -> Factory:
    return lambda groups: cls(groups, **kw)


CASES: dict[str, Factory] = {
    "sgd": _sgd(),
    "sgd-foreach": _sgd(foreach=True),
    "sgd-momentum": _sgd(momentum=0.9, foreach=False),
    "sgd-momentum-foreach": _sgd(momentum=0.9, foreach=True),
    "sgd-momentum-fused": _sgd(momentum=0.9, fused=True),
    "sgd-nesterov-wd": _sgd(momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False),
    "sgd-nesterov-wd-foreach": _sgd(momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True),
    "sgd-dampening-maximize": _sgd(momentum=0.8, dampening=0.1, maximize=True, foreach=True),
    "adam": _cls(torch.optim.Adam, foreach=False),
    "adam-foreach": _cls(torch.optim.Adam, foreach=True),
    "adam-fused": _cls(torch.optim.Adam, fused=True),
    "adam-amsgrad-wd-foreach": _cls(
        torch.optim.Adam, amsgrad=True, weight_decay=0.01, foreach=True
    ),
    "adam-amsgrad-fused": _cls(torch.optim.Adam, amsgrad=True, fused=True),
    "adamw": _cls(torch.optim.AdamW, weight_decay=0.1, foreach=False),
    "adamw-foreach": _cls(torch.optim.AdamW, weight_decay=0.1, foreach=True),
    "adamw-fused": _cls(torch.optim.AdamW, weight_decay=0.1, fused=True),
    "adamw-amsgrad-maximize-foreach": _cls(
        torch.optim.AdamW, amsgrad=True, maximize=True, foreach=True
    ),
    "adagrad": _cls(torch.optim.Adagrad, lr=0.1, lr_decay=0.01, foreach=False),
    "adagrad-foreach": _cls(
        torch.optim.Adagrad, lr=0.1, weight_decay=0.01, initial_accumulator_value=0.1, foreach=True
    ),
    "adagrad-fused": _cls(torch.optim.Adagrad, lr=0.1, fused=True),
    "rmsprop": _cls(torch.optim.RMSprop, foreach=False),
    "rmsprop-foreach": _cls(torch.optim.RMSprop, foreach=True),
    "rmsprop-momentum": _cls(torch.optim.RMSprop, momentum=0.9, foreach=False),
    "rmsprop-momentum-foreach": _cls(torch.optim.RMSprop, momentum=0.9, foreach=True),
    "rmsprop-centered": _cls(torch.optim.RMSprop, centered=True, foreach=False),
    "rmsprop-centered-momentum-foreach": _cls(
        torch.optim.RMSprop, centered=True, momentum=0.5, weight_decay=0.01, foreach=True
    ),
    "adamax": _cls(torch.optim.Adamax, foreach=False),
    "adamax-foreach": _cls(torch.optim.Adamax, weight_decay=0.01, foreach=True),
    "nadam": _cls(torch.optim.NAdam, foreach=False),
    "nadam-decoupled-foreach": _cls(
        torch.optim.NAdam, weight_decay=0.01, decoupled_weight_decay=True, foreach=True
    ),
    "radam": _cls(torch.optim.RAdam, foreach=False),
    "radam-foreach": _cls(torch.optim.RAdam, weight_decay=0.01, foreach=True),
    "adadelta": _cls(torch.optim.Adadelta, foreach=False),
    "adadelta-foreach": _cls(torch.optim.Adadelta, weight_decay=0.01, foreach=True),
    "asgd": _cls(torch.optim.ASGD, t0=2, foreach=False),
    "asgd-foreach": _cls(torch.optim.ASGD, t0=2, foreach=True),
    "rprop": _cls(torch.optim.Rprop, foreach=False),
    "rprop-foreach": _cls(torch.optim.Rprop, foreach=True),
}


LATE_FIRST_GRAD_BREAKS = {"sgd-momentum-fused"}
"""torch's fused SGD cannot step a group in which some params have a momentum buffer and
others get their first gradient (``torch._fused_sgd_`` raises TypeError in the
uninterrupted run already): for it the side param gets gradients from step 0 on."""


class Net(nn.Module):
    def __init__(self, side_parity: int = 1) -> None:
        super().__init__()
        self.side_parity = side_parity
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)
        self.c = nn.Linear(4, 3)
        self.side = nn.Linear(6, 3, bias=False)  # a gradient on odd (or even) steps only

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        out = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return out + self.side(x) if step % 2 == self.side_parity else out


def _groups(model: Net) -> list[dict[str, Any]]:
    return [
        {"params": [model.a.weight, model.a.bias, model.side.weight]},
        {"params": [model.b.weight, model.b.bias, model.c.weight, model.c.bias]},
    ]


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    cycle = "betas" in opt.defaults or opt.defaults.get("momentum", 0) > 0
    return torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=[0.05, 0.02],
        total_steps=N_STEPS + 1,
        cycle_momentum=cycle,
        base_momentum=0.8,
        max_momentum=0.95,
    )


Copy = tuple[torch.Tensor, dict[str, Any]]


def _full_copy(opt: torch.optim.Optimizer, p: torch.Tensor) -> Copy:
    state = opt.state.get(p, {})
    return p.detach().clone(), {
        k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()
    }


def _entries(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]


class Run:
    """The uninterrupted run: records, and full copies + param-group entries per version."""

    def __init__(
        self, factory: Factory, side_parity: int = 1, amp: str = "", device: str = "cpu"
    ) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = Net(side_parity).to(device)
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.opt = factory(_groups(self.model))
        sched = _schedule(self.opt)
        self.records: list[StepRecord] = []
        self.opt.register_step_pre_hook(
            lambda opt, args, kwargs: self.records.append(
                record_step(opt, self.names, len(self.records))
            )
        )
        self.copies: list[dict[str, Copy]] = []  # version -> name -> full copy
        self.entries: list[list[dict[str, Any]]] = []  # version -> param-group entries
        # amp="scaled": GradScaler, grads reach a fused step still scaled (it unscales);
        # amp="unscaled": unscale_ + clip first, a step with an inf is skipped entirely
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=2)
        data = torch.Generator().manual_seed(1)
        for step in range(N_STEPS):
            self._version()
            x = torch.randn(8, 6, generator=data).to(device)
            y = torch.randn(8, 3, generator=data).to(device)
            self.opt.zero_grad(set_to_none=True)
            loss = 50.0 * nn.functional.mse_loss(self.model(x, step), y)
            if not amp:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=0.5)
                self.opt.step()
            else:
                scaler.scale(loss * (float("inf") if step == 3 else 1.0)).backward()
                if amp == "unscaled":
                    scaler.unscale_(self.opt)
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=0.5)
                scaler.step(self.opt)
                scaler.update()
                if len(self.records) == step:  # the step never ran: an empty record
                    self.records.append(StepRecord(step, {}, _entries(self.opt)))
            with warnings.catch_warnings():  # OneCycleLR warns after a skipped step
                warnings.simplefilter("ignore")
                sched.step()
        self._version()

    def _version(self) -> None:
        self.copies.append({n: _full_copy(self.opt, p) for p, n in self.names.items()})
        self.entries.append(_entries(self.opt))


def _rebuild(
    run: Run, factory: Factory, v: int, k: int = K, consume: bool = False
) -> tuple[Net, torch.optim.Optimizer]:
    """A fresh model/optimizer restored from a k-slice rotation and replayed up to v
    (``consume``: on copies of the records, which the replay may take as they are)."""
    torch.manual_seed(123)  # different init: every value must come from copies + replay
    model = Net(run.model.side_parity).to(run.device)
    opt = factory(_groups(model))
    params = dict(model.named_parameters())
    groups = [TensorGroup(n, p.numel() * 4) for n, p in params.items()]
    slices = dict(zip(params, assign_slices(groups, k), strict=True))
    # anchor=True: versions 0..k-2 also rebuild (from version 0's copies of every group)
    bases = {n: base_version(slices[n], v, k, anchor=True) for n in params}
    base = {n: b for n, b in bases.items() if b is not None}
    assert len(base) == len(bases)
    assert len(set(base.values())) > 1 or v == 0  # groups really come from several versions
    for n, p in params.items():
        weight, state = run.copies[base[n]][n]
        with torch.no_grad():
            p.copy_(weight)
        opt.state[p] = {
            k: x.clone() if isinstance(x, torch.Tensor) else x for k, x in state.items()
        }
        if not state:
            del opt.state[p]
    for group, entries in zip(opt.param_groups, run.entries[v], strict=True):
        group.update(copy.deepcopy(entries))  # version v's hyperparameters (small state)
    records = run.records[min(base.values()) : v]
    if consume:
        records = [_cloned(r) for r in records]
    replay(opt, params, base, records, consume=consume)
    return model, opt


def _cloned(rec: StepRecord) -> StepRecord:
    grads = {n: g.clone() for n, g in rec.grads.items()}
    return StepRecord(rec.step, grads, copy.deepcopy(rec.groups), dict(rec.scaler))


def _assert_same(run_model: Net, run_opt: torch.optim.Optimizer, copies: dict, model: Net, opt):
    for n, p in model.named_parameters():
        weight, state = copies[n]
        assert torch.equal(p, weight), n
        got = opt.state.get(p, {})
        assert set(got) == set(state), n
        for key, want in state.items():
            if isinstance(want, torch.Tensor):
                assert got[key].dtype == want.dtype and torch.equal(got[key], want), (n, key)
            else:
                assert got[key] == want, (n, key)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_from_rotating_copies_is_bit_exact(case: str, device: str) -> None:
    _skip_unsupported(case, device)
    factory = CASES[case]
    parity = 0 if case in LATE_FIRST_GRAD_BREAKS else 1
    run = Run(factory, parity, device=device)
    assert len(run.records) == N_STEPS
    assert all("side.weight" in r.grads for r in run.records[parity::2])
    assert all("side.weight" not in r.grads for r in run.records[1 - parity :: 2])
    assert len({r.groups[0]["lr"] for r in run.records}) == N_STEPS  # lr changes every step
    for v in range(N_STEPS + 1):
        model, opt = _rebuild(run, factory, v)
        _assert_same(run.model, run.opt, run.copies[v], model, opt)
        assert _entries(opt) == run.entries[v]  # replay put version v's entries back
        assert all(p.grad is None for p in model.parameters())
    # the last version is the live state of the uninterrupted run
    model, opt = _rebuild(run, factory, N_STEPS)
    for (n, p), q in zip(model.named_parameters(), run.model.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_consuming_its_records_is_bit_exact(case: str) -> None:
    """``consume=True`` (the restore's records: payload views read for it alone) hands
    the recorded grads to the optimizer as they are: the same bits at every version."""
    factory = CASES[case]
    run = Run(factory, 0 if case in LATE_FIRST_GRAD_BREAKS else 1)
    for v in range(N_STEPS + 1):
        model, opt = _rebuild(run, factory, v, consume=True)
        _assert_same(run.model, run.opt, run.copies[v], model, opt)
        assert _entries(opt) == run.entries[v]
        assert all(p.grad is None for p in model.parameters())


def test_consumed_records_are_the_grads_the_optimizer_steps_with() -> None:
    """SGD's foreach Nesterov step adds the momentum into its grads in place: with
    ``consume=True`` that lands in the records (they were the grads, no copy), without
    it the records keep their bytes; the params end equal either way."""
    factory = _sgd(momentum=0.9, nesterov=True, foreach=True)  # no weight decay: no copy first
    run = Run(factory)
    kept = [_cloned(r) for r in run.records]
    for consume in (False, True):
        records = [_cloned(r) for r in kept]
        torch.manual_seed(0)
        model = Net(1)
        opt = factory(_groups(model))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(run.copies[0][n][0])
        replay(opt, params, dict.fromkeys(params, 0), records, consume=consume)
        for n, p in params.items():
            assert torch.equal(p, run.copies[N_STEPS][n][0]), (consume, n)
        changed = [
            n
            for r, orig in zip(records, kept, strict=True)
            for n, g in r.grads.items()
            if not torch.equal(g, orig.grads[n])
        ]
        # the first step creates the momentum buffers: steps 1.. add them into the grads
        assert bool(changed) == consume, (consume, changed)


def test_only_a_plain_tensor_of_the_params_kind_is_taken_as_its_grad() -> None:
    from baft.pipeline.replay import _usable_as_grad

    p = torch.zeros(4, 3)
    assert _usable_as_grad(torch.ones(4, 3), p)
    assert _usable_as_grad(torch.ones(12)[:12].view(4, 3), p)
    assert not _usable_as_grad(torch.ones(4, 3, dtype=torch.float64), p)
    assert not _usable_as_grad(torch.ones(3, 4).t(), p)  # other strides
    assert not _usable_as_grad(torch.ones(3, 4), p)
    assert not _usable_as_grad(torch.ones(4, 3, device="meta"), p)


@pytest.mark.parametrize("k", [2, 5, 7])
@pytest.mark.parametrize(
    "case", ["adamw-foreach", "sgd-nesterov-wd-foreach", "rmsprop-centered-momentum-foreach"]
)
def test_replay_with_other_rotation_lengths(case: str, k: int) -> None:
    run = Run(CASES[case])
    for v in range(N_STEPS + 1):
        model, opt = _rebuild(run, CASES[case], v, k)
        _assert_same(run.model, run.opt, run.copies[v], model, opt)


def _train_state(factory: Factory, steps: int, device: str) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net().to(device)
    opt = factory(_groups(model))
    data = torch.Generator().manual_seed(2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 6, generator=data).to(device)
        y = torch.randn(4, 3, generator=data).to(device)
        nn.functional.mse_loss(model(x, 1), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("steps_before", [0, 2])
def test_stepping_a_subset_equals_stepping_all_per_tensor(
    case: str, steps_before: int, device: str
) -> None:
    """The property replay rests on: a param's step does not depend on which other params
    are stepped with it (foreach/fused kernels included), and a skipped param is untouched."""
    _skip_unsupported(case, device)
    model, opt = _train_state(CASES[case], steps_before, device)
    all_model, all_opt = copy.deepcopy((model, opt))
    sub_model, sub_opt = copy.deepcopy((model, opt))
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    subset = {"a.bias", "b.weight", "side.weight"}
    for n, p in all_model.named_parameters():
        p.grad = grads[n].clone()
    for n, p in sub_model.named_parameters():
        p.grad = grads[n].clone() if n in subset else None
    all_opt.step()
    sub_opt.step()
    before = dict(model.named_parameters())
    for (n, p_all), p_sub in zip(all_model.named_parameters(), sub_model.parameters(), strict=True):
        want = (
            (p_all, all_opt.state.get(p_all, {}))
            if n in subset
            else (before[n], opt.state.get(before[n], {}))
        )
        got_state = sub_opt.state.get(p_sub, {})
        assert torch.equal(p_sub, want[0]), n
        assert set(got_state) == set(want[1]), n
        for key, x in want[1].items():
            if isinstance(x, torch.Tensor):
                assert torch.equal(got_state[key], x), (n, key)


def test_sgd_momentum_buffer_is_created_by_the_replayed_first_step() -> None:
    run = Run(_sgd(momentum=0.9, foreach=True))
    assert run.copies[0]["a.weight"][1] == {}  # version 0: no momentum_buffer yet
    model, opt = _rebuild(run, _sgd(momentum=0.9, foreach=True), 1)
    buf = opt.state[model.a.weight]["momentum_buffer"]
    assert torch.equal(buf, run.records[0].grads["a.weight"])  # clone(grad) on the first step


def test_replay_skips_hooks_and_restores_grads_and_entries() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(_groups(model), lr=0.01)
    names = {p: n for n, p in model.named_parameters()}
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = torch.ones_like(p)
    rec = record_step(opt, names, 0)
    kept_grad = model.a.weight.grad
    model.b.bias.grad = None
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[0]["extra"] = "x"
    replay(opt, params, dict.fromkeys(params, 0), [rec])
    assert calls == [] and not getattr(opt, "_opt_called", False)
    assert sched.last_epoch == 0
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["extra"] == "x"
    assert model.a.weight.grad is kept_grad and model.b.bias.grad is None
    assert int(opt.state[model.b.bias]["step"]) == 1  # stepped with the recorded grad
    assert torch.equal(rec.grads["a.weight"], torch.ones_like(model.a.weight))  # record intact
    # a param the caller leaves out is not stepped, even with a grad, and keeps it
    side = model.side.weight
    before, side_grad = side.detach().clone(), side.grad
    named = {n: p for n, p in params.items() if n != "side.weight"}
    rec1 = record_step(opt, names, 1)
    with pytest.raises(ValueError, match="grad for unknown 'side.weight'"):
        replay(opt, named, dict.fromkeys(named, 1), [rec1])  # names must line up
    del rec1.grads["side.weight"]
    replay(opt, named, dict.fromkeys(named, 1), [rec1])
    assert torch.equal(side, before) and side.grad is side_grad
    assert int(opt.state[side]["step"]) == 1 and int(opt.state[model.c.bias]["step"]) == 2


def test_replay_rejects_inputs_that_do_not_line_up() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(_groups(model), lr=0.1)
    params = dict(model.named_parameters())
    names = {p: n for n, p in params.items()}
    for p in params.values():
        p.grad = torch.ones_like(p)
    r0, r1, r2 = (record_step(opt, names, s) for s in range(3))
    base = dict.fromkeys(params, 0)
    before = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(ValueError, match="consecutive"):
        replay(opt, params, base, [r0, r2])
    with pytest.raises(ValueError, match="records start at step 1"):
        replay(opt, params, base, [r1, r2])
    with pytest.raises(ValueError, match="newer than the replay target"):
        replay(opt, params, {**base, "a.weight": 3}, [r0])
    with pytest.raises(ValueError, match="different params"):
        replay(opt, params, {"a.weight": 0}, [r0])
    bad = StepRecord(step=0, grads={"a.weight": torch.ones(2, 2)}, groups=r0.groups)
    with pytest.raises(ValueError, match="grad of 'a.weight'"):
        replay(opt, params, base, [bad])
    with pytest.raises(ValueError, match="param groups"):
        replay(opt, params, base, [StepRecord(step=0, grads={}, groups=r0.groups[:1])])
    assert all(torch.equal(p, before[n]) for n, p in params.items())  # nothing stepped


def test_replay_safe_names_what_it_cannot_prove() -> None:
    p = nn.Parameter(torch.randn(3))
    classes: list[Any] = list(REPLAY_SAFE)
    assert [replay_safe(cls([p], lr=0.1)) for cls in classes] == [None] * len(classes)
    assert "closure" in (replay_safe(torch.optim.LBFGS([p])) or "")
    assert "sparse" in (replay_safe(torch.optim.SparseAdam([p])) or "")

    class MySGD(torch.optim.SGD):
        pass

    assert "MySGD" in (replay_safe(MySGD([p], lr=0.1)) or "")
    assert "differentiable" in (replay_safe(torch.optim.Adam([p], differentiable=True)) or "")
    with pytest.raises(ValueError, match="cannot replay LBFGS"):
        replay(torch.optim.LBFGS([p]), {"p": p}, {"p": 0}, [])


@pytest.mark.parametrize(
    ("case", "amp"),
    [
        ("adam-fused", "scaled"),
        ("adamw-fused", "unscaled"),
        ("adam", "unscaled"),
        ("sgd-momentum-foreach", "unscaled"),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_replay_under_grad_scaler_with_an_inf_step(case: str, amp: str, device: str) -> None:
    factory = CASES[case]
    run = Run(factory, amp=amp, device=device)
    assert len(run.records) == N_STEPS
    if case.endswith("fused"):  # the fused step ran, unscaling itself and skipping on inf
        assert [float(r.scaler["found_inf"]) for r in run.records] == [0, 0, 0, 1, 0, 0, 0]
        assert ("grad_scale" in run.records[0].scaler) == (amp == "scaled")
    else:  # the step never ran at the inf: the empty record stands for it
        assert run.records[3].grads == {} and run.records[3].scaler == {}
    for v in range(N_STEPS + 1):
        model, opt = _rebuild(run, factory, v)
        _assert_same(run.model, run.opt, run.copies[v], model, opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
