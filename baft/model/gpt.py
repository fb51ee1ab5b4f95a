"""A small GPT-style decoder that splits into pipeline stages by layer ranges.

Parameter names are those of the full model (``tok_emb.weight``, ``layers.3.attn.wq.weight``,
``head.weight``) on every stage, so checkpoints are layout-independent: a state written by a
pp=4 run loads into a single full model. Initialisation is a pure function of (seed, name),
so every split of the same config starts from bit-identical parameters.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from baft.model.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.num_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv are column-sharded, so each rank holds
        # num_heads / tp heads; the view infers the local count.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.w2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


TP_PLAN_COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1")
"""Block submodules split by output features under tensor parallelism."""
TP_PLAN_ROWWISE = ("attn.wo", "mlp.w2")
"""Block submodules split by input features (their outputs are all-reduced)."""


class GPTStage(nn.Module):
    """Layers ``[first, last)`` of the GPT, with the embedding on the first stage and the
    final norm + LM head on the last. The full model is ``GPTStage(cfg, 0, L, True, True)``."""

    def __init__(
        self, cfg: ModelConfig, first: int, last: int, *, has_embed: bool, has_head: bool
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.has_embed = has_embed
        self.has_head = has_head
        if has_embed:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(first, last)})
        if has_head:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embed:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.layers.values():
            x = block(x)
        if self.has_head:
            x = self.head(self.ln_f(x))
        return x


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int) -> None:
    """Initialise every parameter from (seed, its name) alone, GPT-2 style."""
    cfg = getattr(module, "cfg", None)
    num_layers = cfg.num_layers if isinstance(cfg, ModelConfig) else 1
    for name, p in module.named_parameters():
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            p.fill_(1.0)
        elif name.endswith(("ln1.bias", "ln2.bias", "ln_f.bias")):
            p.zero_()
        else:
            std = (
                0.02 / math.sqrt(2 * num_layers)
                if name.endswith(("wo.weight", "w2.weight"))
                else 0.02
            )
            g = torch.Generator().manual_seed(_param_seed(seed, name))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges per stage, as even as possible (earlier stages get the extra)."""
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages but only {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        ranges.append((start, start + n))
        start += n
    return ranges


def build_stage_module(cfg: ModelConfig, stage: int, num_stages: int, seed: int) -> GPTStage:
    """The deterministic-initialised module of pipeline stage ``stage`` out of ``num_stages``."""
    first, last = split_layers(cfg.num_layers, num_stages)[stage]
    module = GPTStage(cfg, first, last, has_embed=stage == 0, has_head=stage == num_stages - 1)
    init_parameters(module, seed)
    return module


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
