"""Load a baft checkpoint of ``examples/fsdp2_pipeline.py`` with plain torch APIs (the
recipe of docs/fsdp2-dcp.md) and compare it bit for bit with the job's gathered state.

``python fsdp2_dcp_load.py full CKPT DUMP OUT``: the whole (unsharded) ``Model`` in this
one process, no process group. ``torchrun --nproc-per-node 2 fsdp2_dcp_load.py sharded
CKPT DUMP OUT``: the example's pp=2 x dp_shard=1 stages. ``DUMP`` is the job's
``--dump-full`` file of the checkpoint's version; ``OUT`` gets one JSON per process:
the keys compared and the ones that differ. Exit status 1 when any differs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_pipeline.py"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("fsdp2_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _full(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(model: torch.nn.Module, opt: torch.optim.Optimizer, dump: dict[str, Any]) -> dict:
    """Every parameter and every flattened optimizer entry of ``model``/``opt`` against
    ``dump`` (torch.equal for tensors, == for hyperparameters)."""
    differ: list[str] = []
    compared: list[str] = []
    for fqn, p in model.named_parameters():
        compared.append(fqn)
        if not torch.equal(_full(p).detach(), dump["model"][fqn]):
            differ.append(fqn)
    osd = get_optimizer_state_dict(model, opt, options=FLAT)
    for key, v in osd.items():
        compared.append(f"optimizer.{key}")
        want = dump["optim"].get(key)
        same = (
            isinstance(want, torch.Tensor) and torch.equal(_full(v).detach(), want)
            if isinstance(v, torch.Tensor)
            else v == want
        )
        if not same:
            differ.append(f"optimizer.{key}")
    return {"compared": compared, "differ": differ}


def load_full(ckpt: str, dump: dict[str, Any]) -> dict:
    """(b): the unsharded model in one process: the documented one-liner."""
    ex = _example()
    model = ex.Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    msd = model.state_dict()
    osd = get_optimizer_state_dict(model, opt, options=FLAT)
    dcp.load({**msd, "optimizer": osd}, checkpoint_id=ckpt, no_dist=True)
    model.load_state_dict(msd)
    set_optimizer_state_dict(model, opt, osd, options=FLAT)
    return _compare(model, opt, dump)


def load_sharded(ckpt: str, dump: dict[str, Any]) -> dict:
    """(a): the example's stages on a pp=2 x dp_shard=1 mesh (2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    ex = _example()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp_shard"))
    pp = mesh["pp"].get_local_rank()
    model = ex.stage_model(pp, 2)
    ex.parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt, options=FLAT)
    dcp.load({**msd, "optimizer": osd}, checkpoint_id=ckpt)
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt, osd, options=FLAT)
    out = _compare(model, opt, dump)
    out["rank"] = dist.get_rank()
    out["placements"] = {
        fqn: [repr(x) for x in p.placements]
        for fqn, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    dist.destroy_process_group()
    return out


def main() -> None:
    mode, ckpt, dump_path, out = sys.argv[1:5]
    torch.set_num_threads(1)
    dump = torch.load(dump_path, weights_only=False)
    result = load_full(ckpt, dump) if mode == "full" else load_sharded(ckpt, dump)
    Path(out).mkdir(parents=True, exist_ok=True)
    name = f"{mode}.rank{result.get('rank', 0)}.json"
    (Path(out) / name).write_text(json.dumps(result, indent=1))
    sys.exit(1 if result["differ"] or not result["compared"] else 0)


if __name__ == "__main__":
    main()
