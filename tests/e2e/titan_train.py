"""torchtitan 0.3.0's own Trainer, llama3 debugmodel, with baft as its checkpointer.

Launched by ``tests/e2e/test_torchtitan_real.py`` (CPU, gloo) and ``benchmarks/gpu_suite.sh``
(CUDA) under torchrun::

    torchrun --nproc-per-node 4 tests/e2e/titan_train.py --out runs/t --assets runs/assets \\
        --pp 2 --dp-shard 2 --steps 12 [--unprotected]
    torchrun ... -m baft.inprocess tests/e2e/titan_train.py ...   # in-process recovery

Everything is torchtitan's: ``Trainer.__init__`` builds the meshes (``ParallelDims``), the
llama3 debugmodel on the meta device, splits it with ``pipeline_llm`` and parallelizes each
part with ``parallelize_llama`` (FSDP2, TP), builds its ``OptimizersContainer`` (AdamW),
``LRSchedulersContainer`` (warmup + linear decay), ``HuggingFaceTokenizer``,
``HuggingFaceTextDataLoader`` and the checkpointer from ``checkpoint=``
(``BaftCheckpointManager.Config``); ``Trainer.train()`` runs the loop (``load``,
``maybe_wait_for_staging``, ``optimizers.step``, ``lr_schedulers.step``, ``save``).

What this script changes, each because torchtitan 0.3.0 does not run otherwise here
(:func:`torch_compat`, :func:`cpu_compat`; the reasons are in their docstrings):

- torch 2.13 (any device): ``PipelineScheduleSingle.step`` takes no ``arg_mbs``/
  ``kwarg_mbs``/``target_mbs`` (torchtitan ``trainer.py`` ``pp_forward_backward_step``
  passes them: pytorch PR 188500 adds them, torchtitan PR 4071 discusses the break); no
  ``torch.distributed.set_timeout`` (``distributed/utils.py`` ``set_pg_timeouts``).
- CPU: ``tools/utils.py`` ``device_type = _get_available_device_type() or "cuda"`` and
  ``trainer.py`` ``device_module.set_device(self.device)``; the metrics' device memory
  monitor reads ``torch.cuda``; ``FlexAttention`` has no CPU backward (torch
  ``flex_attention.py`` ``_validate_device``): the CPU runs use torchtitan's own
  ``ScaledDotProductAttention`` (causal) as inner attention; FSDP2 with torchtitan's
  gradient divide factor 1.0 reduce-scatters with ``PREMUL_SUM``, which gloo lacks: sum
  reductions instead (``set_force_sum_reduction_for_comms``, the same values).

After each step every rank with baft writes ``<out>/restorable/rank<R>``: the newest
version baft committed that a restore from memory can rebuild (-1: none yet), for the
test to kill only once there is one. At the end every rank writes
``<out>/state.rank<R>.json``: sha256 of each local shard of
its model parts, of the optimizer state, the LR schedulers, the data loader's state and
the RNG, the trainer's step, each step's loss and gradient norm this process ran, its pid.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pickle
import random
import types
from pathlib import Path
from typing import Any

import torch

import baft

WORDS = 300


def make_assets(root: Path, documents: int = 600, seed: int = 0) -> None:
    """A word-level tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with BOS/EOS)
    and a C4-shaped JSON-lines dataset (``{"text": ...}``) under ``root``, made offline
    (the wheel ships neither torchtitan's ``tests/assets/tokenizer`` nor ``c4_test``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    (root / "c4").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(special))
    lines = []
    for _ in range(documents):
        n = rng.randint(5, 120)
        lines.append(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}))
    (root / "c4" / "c4.json").write_text("\n".join(lines) + "\n")


def torch_compat() -> None:
    """torchtitan 0.3.0 on torch 2.13: ``set_pg_timeouts`` calls
    ``torch.distributed.set_timeout``, which torch 2.13 lacks: keep the groups' timeouts."""
    import torchtitan.distributed.utils as dist_utils

    if not hasattr(torch.distributed, "set_timeout"):
        dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


def presplit_step(schedule: Any) -> None:
    """Give ``schedule`` the pre-split ``step(arg_mbs=, kwarg_mbs=, target_mbs=)`` of newer
    torch (PR 188500), which torchtitan 0.3.0's Trainer calls: the microbatches go to
    ``_step_microbatches`` unsplit, as torch's own ``step`` hands them on after splitting.
    Installed before the checkpointer is built, so baft's wrapper calls this one."""
    raw = schedule.step
    if not hasattr(schedule, "_stage"):
        raise NotImplementedError("pre-split step: single-stage schedules only (1F1B, GPipe)")

    def step(
        *args: Any,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        return_outputs: bool = True,
        loss_kwargs: Any = None,
        **kwargs: Any,
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return raw(
                *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                **kwargs,
            )  # fmt: skip
        if args or kwargs:
            raise ValueError("pre-split inputs cannot be mixed with whole-batch inputs")
        schedule._stage.has_backward = schedule._has_backward
        schedule._stage.clear_runtime_states()
        schedule._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        if schedule._stage.is_last and return_outputs:
            return schedule._merge_outputs(schedule._stage.output_chunks)
        return None

    schedule.step = step


def cpu_compat() -> None:
    """torchtitan picks ``"cuda"`` when torch sees no accelerator (``tools/utils.py``:
    ``device_type = _get_available_device_type() or "cuda"``) and calls
    ``torch.cuda.set_device`` (``trainer.py``) and ``torch.cuda`` memory statistics
    (``components/metrics.py`` ``DeviceMemoryMonitor``): name the CPU, with zero memory
    statistics."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils

    cpu = types.ModuleType("torchtitan_cpu_device")
    cpu.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("_")})
    cpu.__dict__.update(
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 30, name="cpu"),
        memory_stats=lambda *a: {},
        reset_peak_memory_stats=lambda *a: None,
        empty_cache=lambda *a: None,
        current_device=lambda: 0,
    )
    for mod in (utils, dist_utils, metrics):
        mod.device_type, mod.device_module = "cpu", cpu  # type: ignore[attr-defined]
    parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]


def sum_reductions(parallelize_fn: Any) -> Any:
    """``parallelize_fn``, then FSDP2 sum reductions: torchtitan sets the gradient divide
    factor 1.0 (``disable_fsdp_gradient_division``), which FSDP2 reduce-scatters with
    ``PREMUL_SUM(1.0)``; gloo has no ``PREMUL_SUM``, and a sum divided by 1 is the same."""
    from torch.distributed.fsdp import FSDPModule

    def parallelize(model: Any, **kw: Any) -> Any:
        model = parallelize_fn(model, **kw)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def with_presplit(pipelining_fn: Any) -> Any:
    def pipelining(*a: Any, **kw: Any) -> Any:
        out = pipelining_fn(*a, **kw)
        presplit_step(out[0])
        return out

    return pipelining


def trainer_config(a: argparse.Namespace, cpu: bool) -> Any:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from baft.integrations.torchtitan import BaftCheckpointManager

    cfg = llama3_debugmodel()
    spec = cfg.model_spec
    spec = dataclasses.replace(spec, pipelining_fn=with_presplit(spec.pipelining_fn))
    if cpu:
        spec = dataclasses.replace(spec, parallelize_fn=sum_reductions(spec.parallelize_fn))
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.model_spec = spec
    assets = Path(a.assets)
    cfg.hf_assets_path = str(assets / "tokenizer")
    cfg.dataloader.dataset_path = str(assets / "c4")
    cfg.dump_folder = a.out
    t = cfg.training
    t.seq_len, t.local_batch_size, t.steps = a.seq_len, 2 * a.microbatches, a.steps
    t.mixed_precision_param = "float32"  # one dtype on CPU and GPU: bit-exact comparisons
    t.disable_cuda_graphs = True  # torchtitan: CUDA graphs do not support PP yet
    p = cfg.parallelism
    p.pipeline_parallel_degree, p.pipeline_parallel_schedule = a.pp, a.schedule
    p.pipeline_parallel_microbatch_size = 2
    p.data_parallel_shard_degree, p.data_parallel_replicate_degree = a.dp_shard, a.dp_replicate
    p.tensor_parallel_degree = a.tp
    p.spmd_backend = a.spmd_backend
    cfg.validator.enable = False
    cfg.debug.seed = 7
    cfg.debug.deterministic = not cpu
    cfg.debug.enable_structured_logging = False
    cfg.comm.trace_buf_size = 0
    cfg.checkpoint = BaftCheckpointManager.Config(
        enable=not a.unprotected,
        interval=a.persist_every,
        keep_latest_k=2,
        policy=a.policy,
        store_root=a.store_root or "/dev/shm/baft",
        ranks_per_node=a.ranks_per_node,
    )
    return cfg


def _sha(t: torch.Tensor) -> str:
    t = t.to_local() if hasattr(t, "to_local") else t
    return hashlib.sha256(
        t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    ).hexdigest()


def final_state(trainer: Any, ran: dict[int, list[float]]) -> dict[str, Any]:
    """What must be bit-identical to the run without baft, hashed per name."""
    out: dict[str, Any] = {"model": {}, "optim": {}}
    names: dict[int, str] = {}
    for part in trainer.model_parts:
        for k, v in part.state_dict().items():
            out["model"][k] = _sha(v)
        names.update({id(p): n for n, p in part.named_parameters()})
    for opt in trainer.optimizers.optimizers:
        for p, st in opt.state.items():
            for k, v in st.items():
                key = f"{names[id(p)]}.{k}"
                out["optim"][key] = _sha(v) if isinstance(v, torch.Tensor) else repr(v)
        out["lr"] = [g["lr"] for g in opt.param_groups]
    out["lr_schedulers"] = repr(trainer.lr_schedulers.state_dict())
    data = trainer.dataloader.state_dict()
    mine = pickle.loads(data[f"dp_rank_{trainer.dataloader.dp_rank}"])
    out["dataloader"] = hashlib.sha256(repr(mine).encode()).hexdigest()
    out["dataloader_yielded"] = mine.get("_num_yielded")
    out["rng"] = _sha(torch.get_rng_state())
    out["train_state"] = trainer.state_dict()
    out["steps"] = {str(k): v for k, v in sorted(ran.items())}
    out["pid"] = os.getpid()  # not compared: which process ended the job
    return out


def restorable_version(manager: Any) -> int:
    """The newest version baft committed that a restore from memory can rebuild, as this
    rank's engine knows it; -1: none yet. A differential version (``full_every=k > 1``)
    is rebuildable once its rotation is a whole window of ``k`` payloads old
    (``first_version + k - 1``, ``baft.plan.rotation.rebuildable``); a restore before that
    starts over from step 0 by design (``baft.recover.startover``)."""
    from baft.plan.rotation import rebuildable

    engine = getattr(getattr(manager, "ft", None), "engine", None)
    if engine is None or engine.committed is None or engine.rotation.first_version is None:
        return -1
    v = engine.committed
    return v if rebuildable(v, engine.k, engine.rotation.first_version) else -1


def write_restorable(out: Path, rank: int, version: int) -> None:
    """``<out>/restorable/rank<R>`` = :func:`restorable_version` (atomic), for the test
    that kills a rank only once a version is rebuildable from memory."""
    d = out / "restorable"
    d.mkdir(exist_ok=True)
    tmp = d / f".rank{rank}.tmp"
    tmp.write_text(str(version))
    tmp.replace(d / f"rank{rank}")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--assets", required=True, help="tokenizer/ and c4/ (--make-assets)")
    p.add_argument("--make-assets", action="store_true", help="write the assets and exit")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--spmd-backend", default="partial_dtensor")
    p.add_argument("--unprotected", action="store_true", help="checkpoint.enable=False")
    p.add_argument("--policy", default="redundancy=xor:2")
    p.add_argument("--persist-every", type=int, default=100)
    p.add_argument("--ranks-per-node", type=int, default=0)
    p.add_argument("--store-root", default="")
    return p.parse_args()


def main() -> None:
    a = arguments()
    if a.make_assets:
        make_assets(Path(a.assets))
        return
    from torch._utils import _get_available_device_type

    cpu = _get_available_device_type() is None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(Path(a.out) / "hf_cache"))
    from torchtitan.tools.logging import init_logger

    init_logger()  # as torchtitan's entry point (train.py): INFO to stdout, baft's lines too
    torch_compat()
    if cpu:
        cpu_compat()
    from torchtitan.trainer import Trainer

    trainer = Trainer(trainer_config(a, cpu))
    ran: dict[int, list[float]] = {}
    log = trainer.metrics_processor.log
    out, rank = Path(a.out), torch.distributed.get_rank()

    def record(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any) -> None:
        ran[step] = [loss, grad_norm]  # after the step's optimizers.step()
        log(step, loss, max_loss, grad_norm, **kw)
        if not a.unprotected:
            write_restorable(out, rank, restorable_version(trainer.checkpointer))

    trainer.metrics_processor.log = record  # type: ignore[method-assign]
    trainer.train()
    state = final_state(trainer, ran)
    trainer.close()
    (out / f"state.rank{rank}.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    baft.run(main)  # under `-m baft.inprocess`: survivors re-enter main() after a failure
