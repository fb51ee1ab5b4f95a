"""Deterministic, resumable byte-level data from a corpus bundled with the package.

The corpus is prose from CPython's standard-library documentation (PSF licence), shipped
as ``baft/data/corpus.txt``. Batch ``i`` is a pure function of ``(seed, i)``, so the whole
data-loader state is one integer (the next batch index) and a resumed run reads exactly
the batches an uninterrupted run would have read.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch


def load_corpus() -> np.ndarray:
    """The bundled corpus as uint8 bytes (byte-level tokens, vocab 256)."""
    data = resources.files("baft").joinpath("data/corpus.txt").read_bytes()
    return np.frombuffer(data, dtype=np.uint8)


@dataclass(slots=True)
class ByteDataSource:
    """Random windows of the corpus; ``position`` is the index of the next global batch."""

    seq_len: int
    global_batch: int
    seed: int
    position: int = 0
    _corpus: np.ndarray | None = None

    def __post_init__(self) -> None:
        self._corpus = load_corpus()
        if len(self._corpus) <= self.seq_len + 1:
            raise ValueError(f"corpus too short for seq_len={self.seq_len}")

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch ``index``: (inputs, targets), each (global_batch, seq_len) int64."""
        assert self._corpus is not None
        rng = np.random.Generator(np.random.PCG64([self.seed, index]))
        starts = rng.integers(0, len(self._corpus) - self.seq_len - 1, size=self.global_batch)
        windows = np.stack([self._corpus[s : s + self.seq_len + 1] for s in starts])
        t = torch.from_numpy(windows.astype(np.int64))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def next_batch(self, dp_rank: int = 0, num_dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP replica's slice of the next global batch; advances ``position``."""
        x, y = self.batch(self.position)
        self.position += 1
        per = self.global_batch // num_dp
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        return x[sl], y[sl]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"data state is for seed {state['seed']}, this run uses seed {self.seed}"
            )
        self.position = int(state["position"])
