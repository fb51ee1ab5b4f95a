"""The DCP writer process (``PersistConfig(writer="process")``): real 2-rank gloo jobs whose
checkpoints, written by each rank's writer process from shared files, load bit for bit
with plain ``dcp.load``; and the writer dies with its training process.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from baft.store.disk import latest_version, list_versions, load_version, version_dir
from baft.store.disk_process import BUFFER_NAME, ProcessPersister, agree_prefix
from tests.dist.test_persister import (
    TP_SHAPES,
    assert_bit_equal,
    dp_owner,
    full_state,
    stage_state,
    tp_full,
    zeros_like_state,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:Detected an existing checkpoint:UserWarning",
)


def shared_views(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """``state`` copied into one shared file mapping (as the snapshot store's slot), as
    typed views of it."""
    offsets, total = [], 0
    for value in state.values():
        offsets.append(total)
        total += (value.nbytes + 63) // 64 * 64
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, max(total, 1))
    mm = mmap.mmap(fd, max(total, 1), mmap.MAP_SHARED)
    os.close(fd)
    buffer = torch.frombuffer(mm, dtype=torch.uint8)
    views = {}
    for (fqn, value), off in zip(state.items(), offsets, strict=True):
        view = buffer[off : off + value.nbytes].view(value.dtype).view(value.shape)
        view.copy_(value)
        views[fqn] = view
    return views


class _Layout:
    def __init__(self, mesh: Any, placements: Any, shape: tuple[int, ...]) -> None:
        self.mesh, self.placements, self.shape = mesh, tuple(placements), torch.Size(shape)
        self.stride = torch.empty(shape).stride()


def _scenarios_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    group = dist.new_group(backend="gloo")
    base = Path(root)
    shm = base / f"shm{rank}"
    shm.mkdir()
    out: dict[str, Any] = {}
    # one writer process per rank for every scenario (each start imports torch);
    # keep_latest=3 prunes the first of four versions in the writer
    p = ProcessPersister(
        base / "ckpt", prefix=agree_prefix(group), buffer_dir=shm, process_group=group,
        rank=rank, timeout_s=60, keep_latest=3,
    )  # fmt: skip
    out["pid"] = p.pid

    # 1. full snapshots, typed views of a shared file (the store's slot): pp=2 (each
    #    rank its stage), then dp=2 (owners) with a plain value
    p.save_async(1, shared_views(stage_state(rank), shm / "slot0"), {"kind": "pp"}).wait(60)
    out["inline.pp"] = p.inline_bytes
    state = full_state(salt=2)
    owned = {k: v for k, v in state.items() if dp_owner(k, list(state)) == rank}
    views: dict[str, Any] = shared_views(owned, shm / "slot1")
    # a plain value (torch's flattened param_groups entries are) goes pickled
    views[f"optimizer.param_groups.x{rank}.lr"] = 0.5 + rank
    p.save_async(2, views, {"kind": "dp"}).wait(60)
    out["inline.dp"] = p.inline_bytes

    # 2. differential: the live copy's buffer is a shared file the writer maps
    want = stage_state(rank, salt=3)
    buf = p.host_buffer(sum(v.nbytes for v in want.values()))
    out["buffer_file"] = (shm / BUFFER_NAME).stat().st_size
    views, off = {}, 0
    for k, v in want.items():
        views[k] = buf[off : off + v.nbytes].view(v.dtype).view(v.shape)
        views[k].copy_(v)
        off += v.nbytes
    p.save_async(4, views, {"kind": "diff"}).wait(60)
    out["inline.diff"] = p.inline_bytes
    del views, buf

    # 3. tp=2: TP shards as DTensors through the engine's layouts (mesh, placements)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    w = tp_full("tp.attn.wq.weight").chunk(world_size, dim=0)[rank]
    w2 = tp_full("tp.mlp.w2.weight").chunk(world_size, dim=1)[rank].contiguous()
    p.layouts = {
        "tp.attn.wq.weight": _Layout(mesh, [Shard(0)], TP_SHAPES["tp.attn.wq.weight"]),
        "tp.mlp.w2.weight": _Layout(mesh, [Shard(1)], TP_SHAPES["tp.mlp.w2.weight"]),
    }
    local = shared_views({"tp.attn.wq.weight": w, "tp.mlp.w2.weight": w2}, shm / "slot2")
    p.save_async(7, local, {"kind": "tp"}).wait(60)
    out["inline.tp"] = p.inline_bytes
    out["latest"] = latest_version(base / "ckpt")
    p.shutdown()
    out["exit"] = p._proc.returncode
    out["buffer_left"] = (shm / BUFFER_NAME).exists()
    return out


@pytest.fixture(scope="module")
def scenarios(gloo: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("persist_proc")
    values = gloo.run(_scenarios_worker, 2, args=(str(root),), timeout_s=90)
    return {"root": root, "ranks": values}


@pytest.mark.timeout(100)  # the 2-rank launch and two writer processes (~30-60 s here)
def test_full_snapshots_from_shared_files_load_bit_for_bit(scenarios: dict) -> None:
    root = scenarios["root"] / "ckpt"
    for r in scenarios["ranks"]:
        assert r["inline.pp"] == 0 and r["inline.dp"] == 0  # every tensor mapped, none sent
        assert r["latest"] == 7 and r["exit"] == 0
    assert scenarios["ranks"][0]["pid"] != scenarios["ranks"][1]["pid"]
    assert list_versions(root) == [2, 4, 7]  # keep_latest=3 pruned v1 in the writer
    want = full_state(salt=2)
    state = zeros_like_state(want)
    dcp.load(state, checkpoint_id=version_dir(root, 2), no_dist=True)
    assert_bit_equal(state, want)
    groups = {"optimizer.param_groups.x0.lr": 0.0, "optimizer.param_groups.x1.lr": 0.0}
    dcp.load(groups, checkpoint_id=version_dir(root, 2), no_dist=True)
    assert groups == {"optimizer.param_groups.x0.lr": 0.5, "optimizer.param_groups.x1.lr": 1.5}
    assert load_version(root, 2, zeros_like_state(want)) == {"kind": "dp"}


@pytest.mark.timeout(20)
def test_differential_buffer_checkpoint_loads_bit_for_bit(scenarios: dict) -> None:
    root = scenarios["root"] / "ckpt"
    want = full_state(salt=3)
    for r in scenarios["ranks"]:
        assert r["inline.diff"] == 0
        assert r["buffer_file"] == sum(v.nbytes for k, v in stage_state(0, 3).items()) or (
            r["buffer_file"] == sum(v.nbytes for v in stage_state(1, 3).values())
        )
        assert r["buffer_left"] is False  # shutdown removes the shared file
    state = zeros_like_state(want)
    dcp.load(state, checkpoint_id=version_dir(root, 4), no_dist=True)
    assert_bit_equal(state, want)


@pytest.mark.timeout(20)
def test_tp_layouts_become_dtensors_in_the_writer(scenarios: dict) -> None:
    state = {fqn: torch.zeros(shape) for fqn, shape in TP_SHAPES.items()}
    dcp.load(state, checkpoint_id=version_dir(scenarios["root"] / "ckpt", 7), no_dist=True)
    assert all(r["inline.tp"] == 0 for r in scenarios["ranks"])
    assert_bit_equal(state, {fqn: tp_full(fqn) for fqn in TP_SHAPES})


_ORPHAN = r"""
import os, sys, time
import torch
from baft.store.disk_process import ProcessPersister
root = sys.argv[1]
p = ProcessPersister(root + "/ckpt", prefix="x", buffer_dir=root, rank=0, timeout_s=60)
big = p.host_buffer(int(sys.argv[2]) * 2**20)
big.copy_(torch.arange(big.numel(), dtype=torch.int64).to(torch.uint8))
state = {f"t{i}": big[i * 2**20 : (i + 1) * 2**20] for i in range(int(sys.argv[2]))}
if sys.argv[3] == "save":
    p.save_async(1, state)
print(p.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["idle", "save"])
def test_writer_exits_when_its_training_process_is_killed(tmp_path: Path, when: str) -> None:
    """SIGKILL the training process (idle, or while its writer saves 256 MiB): the writer
    process exits, and no checkpoint is marked complete unless it is whole."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, str(tmp_path), "256", when],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert _alive(child)
    if when == "save":  # the writer has started writing (its data file exists)
        deadline = time.monotonic() + 40
        while not list((tmp_path / "ckpt").glob("v*/*.distcp")) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the writer process outlived its training process"
    for version in list_versions(tmp_path / "ckpt"):  # complete only if whole
        got = {f"t{i}": torch.zeros(2**20, dtype=torch.uint8) for i in range(256)}
        dcp.load(got, checkpoint_id=version_dir(tmp_path / "ckpt", version), no_dist=True)
        flat = torch.cat([got[f"t{i}"] for i in range(256)])
        assert torch.equal(flat, torch.arange(flat.numel(), dtype=torch.int64).to(torch.uint8))


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.timeout(60)
def test_the_writer_is_idle_from_its_first_line_and_a_waiter_raises_it(tmp_path: Path) -> None:
    """The writer process is lowered by its parent before it runs (were it to lower itself,
    a waiter's boost could come first and it would stay idle through the wait, its torch
    import starved behind any busy core), and a waiter raises every thread of it for as
    long as the outermost wait lasts."""
    p = ProcessPersister(tmp_path / "ckpt", prefix="x", buffer_dir=tmp_path, rank=0)
    try:
        if not p.lowered:
            pytest.skip("this machine refuses SCHED_IDLE")
        assert _policies(p.pid) == {os.SCHED_IDLE}  # at once, before the child's import
        with p.boosted():
            assert _policies(p.pid) == {os.SCHED_OTHER}
            with p.boosted():
                pass
            assert _policies(p.pid) == {os.SCHED_OTHER}  # the inner wait ended, not this
            handle = p.save_async(1, {"w": torch.arange(1000, dtype=torch.float32)})
            handle.wait(30)
        assert _policies(p.pid) == {os.SCHED_IDLE}  # every thread, those it started too
        got = {"w": torch.zeros(1000)}
        dcp.load(got, checkpoint_id=version_dir(tmp_path / "ckpt", 1), no_dist=True)
        assert torch.equal(got["w"], torch.arange(1000, dtype=torch.float32))
    finally:
        p.shutdown()
