"""A persisted checkpoint of a pp=2 x dp_shard=2 FSDP2 job (``examples/fsdp2_pipeline.py``
under torchrun, 4 ranks, the head's 7 rows sharded 4 + 3) is a plain DCP checkpoint:

- torch's keys (plain FQNs, ``optimizer.state.<fqn>.<key>``,
  ``optimizer.param_groups.<fqn>.<hyper>``), DTensor chunks as FSDP2 lays them out, one
  writer per chunk;
- plain ``dcp.load`` (the docs/fsdp2-dcp.md recipe) reads it into the unsharded model in
  one process and into a pp=2 x dp_shard=1 job, equal bit for bit to the job's gathered
  state at that version (``--dump-full``), and reports differences against another
  version (the comparison can fail);
- the same job relaunched with ``--dp-shard 1`` on 2 ranks (its memory stores kept, of the
  old layout) restores from DCP, resharded, says why in ``recoveries.jsonl``, holds the
  persisted version's parameters and optimizer state, and trains on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from baft.store.disk import latest_version, read_metadata, version_dir

# slow: default tier: unit test_persist_keys (every write path keyed by stage, each stage
# loaded with plain dcp.load) and the FSDP2 x PP smoke cell of the matrix
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "fsdp2_pipeline.py"
LOADER = REPO / "tests" / "dist" / "fsdp2_dcp_load.py"
ITERATIONS = 4


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _torchrun(nproc: int, logs: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "--max-restarts=0", f"--log-dir={logs}", "--redirects=3",
        *args,
    ]  # fmt: skip


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stderr[-4000:]}"


def _example(nproc: int, out: Path, root: Path, *args: str) -> list[str]:
    return _torchrun(
        nproc, out.parent / f"logs-{out.name}-{nproc}", str(EXAMPLE), "--out", str(out),
        "--store-root", str(root), "--job-id", "dcp", "--persist-every", "1",
        "--keep-stores", "--timeout", "30", *args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 4-rank job, run once: its run dir, store root and newest persisted version."""
    base = tmp_path_factory.mktemp("fsdp2dcp")
    out, root = base / "run", base / "shm"
    cmd = _example(4, out, root, "--pp", "2", "--dp-shard", "2", "--iterations", str(ITERATIONS))
    _run([*cmd, "--dump-full", str(out / "full")], "the pp=2 x dp_shard=2 job")
    version = latest_version(out / "checkpoints")
    assert version is not None
    return {"out": out, "root": root, "version": version, "base": base}


def _ckpt(job: dict[str, Any]) -> Path:
    return version_dir(job["out"] / "checkpoints", job["version"])


def _dump(job: dict[str, Any], version: int) -> Path:
    return job["out"] / "full" / f"v{version:08d}.pt"


def test_keys_are_torch_conventions_with_fsdp2_chunks(job: dict[str, Any]) -> None:
    assert read_metadata(job["out"] / "checkpoints", job["version"])["dcp_keys"] == "torch"
    md = FileSystemReader(_ckpt(job)).read_metadata()
    chunks = {
        k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "chunks")
    }
    assert chunks["head.weight"] == [((0, 0), (4, 32)), ((4, 0), (3, 32))]
    assert chunks["optimizer.state.head.weight.exp_avg_sq"] == chunks["head.weight"]
    assert chunks["optimizer.state.head.bias.step"] == [((), ())]
    assert chunks["layers.2.w1.weight"] == [((0, 0), (24, 32)), ((24, 0), (24, 32))]
    keys = set(md.state_dict_metadata)
    assert {"embed.weight", "optimizer.param_groups.embed.weight.lr"} <= keys
    assert not [k for k in keys if k.startswith("optim.") or k.startswith("model.")]
    # one writer per chunk: every (key, offset) is stored once, plain tensors by one rank
    stored = Counter((i.fqn, tuple(i.offset or ())) for i in md.storage_data)
    assert max(stored.values()) == 1
    files = {i.fqn: s.relative_path for i, s in md.storage_data.items()}
    # pp1's plain tensors and hyperparameters: from its dp_shard rank 0 (global rank 2)
    assert files["optimizer.state.head.weight.step"] == "__2_0.distcp"
    assert files["optimizer.param_groups.head.bias.lr"] == "__2_0.distcp"
    assert files["extra.pp1.tp1.rng.cpu"] == "__3_0.distcp"
    lr = torch.load(_dump(job, job["version"]), weights_only=False)["optim"]
    assert "param_groups.head.weight.initial_lr" in lr  # the scheduler's entry, kept


def _load(job: dict[str, Any], mode: str, dump: Path, out: Path) -> tuple[int, list[dict]]:
    args = [mode, str(_ckpt(job)), str(dump), str(out)]
    if mode == "full":
        cmd = [sys.executable, str(LOADER), *args]
    else:
        cmd = _torchrun(2, out / "logs", str(LOADER), *args)
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    results = [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}.rank*.json"))]
    return done.returncode, results


def test_plain_dcp_load_into_the_unsharded_model(job: dict[str, Any], tmp_path: Path) -> None:
    rc, [got] = _load(job, "full", _dump(job, job["version"]), tmp_path / "ok")
    assert (rc, got["differ"]) == (0, [])
    fqns = [k for k in got["compared"] if not k.startswith("optimizer.")]
    assert len(fqns) == 28 and "head.weight" in fqns and "embed.weight" in fqns
    assert "optimizer.state.head.weight.exp_avg" in got["compared"]
    assert "optimizer.param_groups.layers.3.w2.bias.lr" in got["compared"]
    # against the version before: parameters and moments differ, so the check can fail
    rc, [other] = _load(job, "full", _dump(job, job["version"] - 1), tmp_path / "neg")
    assert rc == 1 and "head.weight" in other["differ"]
    assert "optimizer.state.head.weight.exp_avg" in other["differ"]


def test_plain_dcp_load_into_dp_shard_1(job: dict[str, Any], tmp_path: Path) -> None:
    rc, got = _load(job, "sharded", _dump(job, job["version"]), tmp_path)
    assert rc == 0 and [r["rank"] for r in got] == [0, 1]
    assert [r["differ"] for r in got] == [[], []]
    assert "embed.weight" in got[0]["placements"] and "head.weight" in got[1]["placements"]
    assert got[1]["placements"]["head.weight"] == ["Shard(dim=0)"]
    assert sum(len(r["compared"]) for r in got) == 420


def test_relaunch_with_another_dp_shard_degree_restores_from_dcp(job: dict[str, Any]) -> None:
    out = job["base"] / "relaunch"
    shutil.copytree(job["out"], out)  # the other tests keep the original checkpoint
    v = job["version"]
    cmd = _example(2, out, job["root"], "--pp", "2", "--dp-shard", "1", "--ranks-per-node", "1")
    _run([*cmd, "--iterations", str(v + 2), "--dump-full", str(out / "full2")], "the relaunch")
    [record] = [json.loads(x) for x in (out / "recoveries.jsonl").read_text().splitlines()]
    assert (record["source"], record["restored_version"]) == ("disk", v)
    assert "memory holds another layout" in record["reason"]
    assert "pp=2 dp=1 tp=2, but this job runs pp=2 dp=1 tp=1" in record["reason"]
    assert "shard ranks per stage pp0: 2 -> 1, pp1: 2 -> 1" in record["resharded"]
    assert "RNG states not restored" in record["resharded"]
    want = torch.load(_dump(job, v), weights_only=False)
    got = torch.load(out / "full2" / f"v{v:08d}.pt", weights_only=False)
    assert sorted(got["model"]) == sorted(want["model"])
    assert [k for k in want["model"] if not torch.equal(got["model"][k], want["model"][k])] == []
    assert sorted(got["optim"]) == sorted(want["optim"])
    for key, value in want["optim"].items():
        same = (
            torch.equal(got["optim"][key], value)
            if isinstance(value, torch.Tensor)
            else got["optim"][key] == value
        )
        assert same, key
    assert json.loads((out / "final.json").read_text())["start"] == v
    assert (out / "full2" / f"v{v + 2:08d}.pt").exists()  # trained on to the end
