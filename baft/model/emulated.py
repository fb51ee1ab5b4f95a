"""Emulated compute: a pipeline stage whose forward/backward are calibrated timed sleeps.

On a CPU box the ranks' compute fights the checkpoint work for the same two cores, which
says little about an accelerator, where compute runs on the device and the host is free.
:func:`wrap_emulated` turns a real :class:`~baft.model.gpt.GPTStage` into an
:class:`EmulatedStage`: the same parameters under the same names (so every byte a
checkpoint moves is real), while forward sleeps ``fwd_s`` and backward sleeps ``bwd_s``
(sleeping releases the GIL and the core, as a device kernel would). Outputs are
deterministic functions of the input with the real output shape; every parameter gets a
small constant gradient, so the optimizer does its real work. :func:`calibrate_stage`
measures the real stage's forward/backward seconds on one microbatch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from baft.model.config import ModelConfig
from baft.model.gpt import loss_fn

PARAM_GRAD = 1e-4
"""Constant gradient every parameter receives from one emulated backward."""
_ACTIVATION_SCALE = 1e-3
"""Scale from token id to emulated activation value (keeps losses finite)."""


@dataclass(frozen=True, slots=True)
class _Spec:
    """What one emulated stage computes and how long it pretends to take."""

    fwd_s: float
    bwd_s: float
    d_model: int
    vocab_size: int
    has_embed: bool
    has_head: bool
    sleep: Callable[[float], Any]

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """Deterministic output of the real stage's shape (a fresh tensor, never a view)."""
        h = x
        if self.has_embed:  # (b, t) token ids -> (b, t, d)
            ids = x.to(torch.float32).unsqueeze(-1) * _ACTIVATION_SCALE
            h = ids.expand(*x.shape, self.d_model)
        if self.has_head:  # (b, t, d) -> (b, t, vocab)
            h = h[..., :1].expand(*h.shape[:-1], self.vocab_size)
        return h.clone(memory_format=torch.contiguous_format)


class _SleepFunction(torch.autograd.Function):
    """Forward sleeps ``spec.fwd_s``; backward sleeps ``spec.bwd_s`` and returns gradients
    for the input (when it is floating point) and for every parameter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: _Spec, *params: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        ctx.x_float = x.is_floating_point()
        ctx.x_shape = x.shape
        ctx.save_for_backward(*params)
        spec.sleep(spec.fwd_s)
        return spec.output(x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        spec: _Spec = ctx.spec
        spec.sleep(spec.bwd_s)
        grad_x = None
        if ctx.x_float:
            if tuple(grad_out.shape) == tuple(ctx.x_shape):
                grad_x = grad_out.clone()
            else:
                grad_x = grad_out.new_zeros(ctx.x_shape)
        param_grads = [torch.full_like(p, PARAM_GRAD) for p in ctx.saved_tensors]
        return (grad_x, None, *param_grads)


class EmulatedStage(nn.Module):
    """A GPT stage with its real parameters (same names) and timed-sleep compute."""

    def __init__(
        self,
        stage: nn.Module,
        fwd_s: float,
        bwd_s: float,
        *,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        super().__init__()
        cfg = getattr(stage, "cfg", None)
        if not isinstance(cfg, ModelConfig) or not hasattr(stage, "has_embed"):
            raise ValueError(
                f"wrap_emulated needs a baft.model.gpt.GPTStage, got {type(stage).__name__}"
            )
        if fwd_s < 0 or bwd_s < 0:
            raise ValueError(f"emulated times must be >= 0 seconds, got fwd={fwd_s} bwd={bwd_s}")
        self.cfg = cfg
        self.has_embed = bool(stage.has_embed)
        self.has_head = bool(stage.has_head)
        for name, child in stage.named_children():
            self.add_module(name, child)
        for name, p in stage.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.spec = _Spec(
            fwd_s=float(fwd_s),
            bwd_s=float(bwd_s),
            d_model=cfg.d_model,
            vocab_size=cfg.vocab_size,
            has_embed=self.has_embed,
            has_head=self.has_head,
            sleep=sleep,
        )
        self._params = tuple(self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _SleepFunction.apply(x, self.spec, *self._params)
        return out


def wrap_emulated(
    module: nn.Module,
    fwd_s: float,
    bwd_s: float,
    *,
    sleep: Callable[[float], Any] = time.sleep,
) -> nn.Module:
    """``module`` (a GPTStage) as an :class:`EmulatedStage` sleeping ``fwd_s``/``bwd_s``
    per microbatch; the parameters are the same tensor objects, under the same names."""
    return EmulatedStage(module, fwd_s, bwd_s, sleep=sleep)


def _stage_input(stage: nn.Module, cfg: ModelConfig, batch: int, gen: torch.Generator) -> Any:
    if getattr(stage, "has_embed", False):
        return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=gen)
    return x.requires_grad_(True)


def calibrate_stage(
    stage: nn.Module, cfg: ModelConfig, microbatch: int, *, num_reps: int = 5
) -> tuple[float, float]:
    """Fastest (forward, backward) seconds of the real ``stage`` on one microbatch.

    The minimum over ``num_reps`` runs, not the median: on a shared machine other jobs
    only ever add time, and the emulated device should not inherit their load. The
    forward of the last stage includes the loss, as in the pipeline. One unmeasured
    warm-up run comes first; gradients are cleared afterwards.
    """
    if microbatch < 1 or num_reps < 1:
        raise ValueError("calibrate_stage needs microbatch >= 1 and num_reps >= 1")
    gen = torch.Generator().manual_seed(0)
    fwd: list[float] = []
    bwd: list[float] = []
    for rep in range(num_reps + 1):
        x = _stage_input(stage, cfg, microbatch, gen)
        start = time.perf_counter()
        out = stage(x)
        if getattr(stage, "has_head", False):
            target = torch.randint(0, cfg.vocab_size, (microbatch, cfg.seq_len), generator=gen)
            out = loss_fn(out, target)
        mid = time.perf_counter()
        out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
        end = time.perf_counter()
        if rep > 0:
            fwd.append(mid - start)
            bwd.append(end - mid)
    stage.zero_grad(set_to_none=True)
    return min(fwd), min(bwd)
