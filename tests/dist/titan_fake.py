"""torchtitan's Trainer loop over torchtitan's own components, small enough for 2 CPU ranks.

Everything the checkpointer meets is torchtitan 0.3.0's (a dev dependency):
``BaseCheckpointManager`` (``BaftCheckpointManager``'s base, its ``Config.build``),
``OptimizersContainer`` (``default_adamw``: AdamW, one container over the model part),
``LRSchedulersContainer`` (warmup + linear decay ``LambdaLR``), and the
``HuggingFaceTextDataLoader`` (a ``torchdata`` ``StatefulDataLoader``, state keyed by DP
rank) over an offline HF tokenizer and JSON-lines dataset
(:func:`make_assets`). Only the model (a 2-stage GPipe pipeline of
linear layers with dropout, fed the token ids as floats) and the loop are this file's:
:class:`Trainer` restates ``torchtitan.trainer.Trainer.train``/``train_step`` in their
order: ``load()``, then the data iterator (a torch DataLoader iterator draws its base seed
from the RNG when created); per step ``step += 1``, ``zero_grad``, batches,
``pp_schedule.step``, clipping, ``maybe_wait_for_staging()``, ``optimizers.step()``,
``lr_schedulers.step()``, ``save(step, last_step)``; ``close()``. The whole Trainer, with
the llama3 model, runs in ``tests/e2e/test_torchtitan_real.py`` (slow tier).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

SEQ = 8


def make_assets(root: Path) -> Path:
    """The tokenizer and dataset, made once before the ranks start (they read them)."""
    from tests.e2e.titan_train import make_assets as make

    make(root, documents=200)
    return root


class Trainer:
    """The calls of torchtitan's Trainer, in order, over a 2-stage GPipe pipeline."""

    def __init__(self, rank: int, world: int, checkpoint: Any, base: Path, assets: Path) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.components.tokenizer import HuggingFaceTokenizer
        from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

        torch.manual_seed(100 + rank)
        part = nn.Sequential(nn.Linear(SEQ, SEQ), nn.GELU(), nn.Dropout(0.1), nn.Linear(SEQ, SEQ))
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        self.rank, self.last = rank, rank == world - 1
        self.pp_schedule = ScheduleGPipe(
            stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
        )
        self.parallel_dims = None
        self.model_parts: list[nn.Module] = [part]
        self.optimizers = default_adamw(lr=0.01).build(model_parts=self.model_parts)
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1
        ).build(optimizers=self.optimizers, training_steps=10)
        self.step = 0
        self.ntokens_seen = 0
        tokenizer = HuggingFaceTokenizer(tokenizer_path=str(assets / "tokenizer"))
        config = HuggingFaceTextDataLoader.Config(dataset_path=str(assets / "c4"))
        self.dataloader = config.build(
            dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ, local_batch_size=4
        )
        self.checkpointer = checkpoint.build(
            dataloader=self.dataloader, model_parts=self.model_parts,
            optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
            states={"train_state": self}, sd_adapter=None, base_folder=str(base / "outputs"),
        )  # fmt: skip

    def train_step(self, data: Iterator[Any]) -> None:
        self.optimizers.zero_grad()
        inputs, labels = next(data)
        x, y = inputs["input"].float() / 300, labels.float() / 300
        self.ntokens_seen += labels.numel()
        if self.rank == 0:
            self.pp_schedule.step(x)
        else:
            self.pp_schedule.step(target=y, losses=[] if self.last else None)
        nn.utils.clip_grad_norm_(self.model_parts[0].parameters(), 1.0)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()

    def train(self, steps: int, after_step: Callable[[Trainer], None] = lambda _: None) -> bool:
        loaded = self.checkpointer.load(step=-1)
        after_step(self)  # the state the loop starts from
        data = iter(self.dataloader)  # after load(), as Trainer.train's batch_generator
        while self.step < steps:
            self.step += 1
            self.train_step(data)
            self.checkpointer.save(self.step, last_step=self.step == steps)
            after_step(self)
        return loaded

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]

    def close(self) -> None:
        self.checkpointer.close()

    def snapshot(self) -> dict[str, Any]:
        """Copies of everything a restore must bring back, by name."""
        opt = self.optimizers.optimizers[0]
        names = {id(p): n for n, p in self.model_parts[0].named_parameters()}
        out: dict[str, Any] = {f"model.{k}": v.detach().clone()
                               for k, v in self.model_parts[0].state_dict().items()}  # fmt: skip
        for p, st in opt.state.items():
            out.update({f"optim.{names[id(p)]}.{k}": v.clone() for k, v in st.items()})
        out["lr"] = [g["lr"] for g in opt.param_groups]
        out["scheduler"] = self.lr_schedulers.schedulers[0].state_dict()
        out["rng"] = torch.get_rng_state()
        out["train_state"] = self.state_dict()
        data = pickle.loads(self.dataloader.state_dict()["dp_rank_0"])
        out["data"] = (data.get("_num_yielded"), repr(data))
        return out
