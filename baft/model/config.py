"""Shape of the reference GPT decoder (the demo's, the tests' and the reference app's
model; a user's own model needs none of this)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the reference GPT decoder."""

    num_layers: int = 8
    """Transformer blocks; must be >= the number of pipeline stages."""
    d_model: int = 128
    """Hidden size; divisible by num_heads."""
    num_heads: int = 4
    """Attention heads; divisible by the TP degree."""
    vocab_size: int = 256
    """Byte-level vocabulary (256 covers the bundled corpus)."""
    seq_len: int = 64
    """Tokens per training sequence."""
    mlp_ratio: int = 4
    """MLP hidden size = mlp_ratio * d_model."""

    def validate(self, num_tp: int = 1) -> None:
        for name in ("num_layers", "d_model", "num_heads", "vocab_size", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: "
                "pick --d-model as a multiple of --heads"
            )
        if self.num_heads % num_tp:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by tp={num_tp}: "
                "pick --heads as a multiple of --tp"
            )
        if (self.mlp_ratio * self.d_model) % num_tp:
            raise ValueError(
                f"MLP width {self.mlp_ratio * self.d_model} not divisible by tp={num_tp}"
            )
