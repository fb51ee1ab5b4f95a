"""Tests of the DCP persister: real 2-rank gloo jobs checked with plain DCP loads.

One job (module fixture) runs the pp, dp, tp, keep-latest and timing scenarios; the
kill tests launch their own jobs. Checks happen in the test process with
``dcp.load(..., no_dist=True)`` into fresh full tensors, bit for bit.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from baft.store import disk as persister_mod
from baft.store.disk import (
    COMPLETE_MARKER,
    LATEST_FILE,
    Persister,
    latest_version,
    list_versions,
    load_version,
    select_prunable,
    version_dir,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:Detected an existing checkpoint:UserWarning",
)

# ---------------------------------------------------------------- shared state data


def _values(fqn: str, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """Deterministic float32 values for ``fqn`` (same in every process)."""
    gen = torch.Generator().manual_seed(zlib.crc32(fqn.encode()) + salt)
    return torch.randn(shape, generator=gen)


def full_model() -> nn.Module:
    """A tiny 2-stage model; stage s holds layers 2s and 2s+1 under full FQNs."""
    model = nn.Module()
    model.layers = nn.Sequential(
        nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)
    )
    return model


def stage_state(stage: int, salt: int = 0) -> dict[str, torch.Tensor]:
    """Flat state of pipeline stage ``stage``: params, fake AdamW state, extras."""
    state: dict[str, torch.Tensor] = {}
    for name, param in full_model().named_parameters():
        if int(name.split(".")[1]) // 2 != stage:
            continue
        state[f"model.{name}"] = _values(f"model.{name}", tuple(param.shape), salt)
        for moment in ("exp_avg", "exp_avg_sq"):
            fqn = f"optim.{name}.{moment}"
            state[fqn] = _values(fqn, tuple(param.shape), salt)
        state[f"optim.{name}.step"] = torch.tensor(7.0 + salt)
    torch.manual_seed(100 + stage)
    state[f"extra.pp{stage}.rng.cpu"] = torch.get_rng_state()
    if stage == 0:
        state["extra.data.position"] = torch.tensor(1234 + salt, dtype=torch.int64)
    return state


def full_state(salt: int = 0) -> dict[str, torch.Tensor]:
    return {**stage_state(0, salt), **stage_state(1, salt)}


def as_buffer_views(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy ``state`` into one flat byte buffer and return typed views of it,
    the way the snapshot store hands state to the persister."""
    offsets, total = [], 0
    for value in state.values():
        offsets.append(total)
        total += (value.nbytes + 63) // 64 * 64
    buffer = torch.zeros(total, dtype=torch.uint8)
    views = {}
    for (fqn, value), off in zip(state.items(), offsets, strict=True):
        view = buffer[off : off + value.nbytes].view(value.dtype).view(value.shape)
        view.copy_(value)
        views[fqn] = view
    return views


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]):
    assert sorted(got) == sorted(want)
    for fqn, expected in want.items():
        actual = got[fqn]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, fqn
        a = actual.contiguous().reshape(-1).view(torch.uint8)
        b = expected.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{fqn} differs"


def dp_owner(fqn: str, names: list[str]) -> int:
    """Whole-tensor ownership over dp=2: alternate in sorted FQN order."""
    return sorted(names).index(fqn) % 2


TP_SHAPES = {"tp.attn.wq.weight": (8, 6), "tp.mlp.w2.weight": (4, 10)}


def tp_full(fqn: str) -> torch.Tensor:
    return _values(fqn, TP_SHAPES[fqn])


MIB_PER_RANK = 50
NUM_TIMED_TENSORS = 25

# ---------------------------------------------------------------- rank workers


def _scenarios_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    group = dist.new_group(backend="gloo")
    base = Path(root)
    out: dict[str, Any] = {}

    def persist(sub: str, version: int, state: dict, meta: dict, **kw: Any) -> None:
        p = Persister(base / sub, process_group=group, rank=rank, **kw)
        h = p.save_async(version, state, meta)
        h.wait(60)
        out[f"{sub}.done"] = h.done()
        p.shutdown()

    # 1. pp=2: each rank its own stage's FQNs
    persist("pp", 1, as_buffer_views(stage_state(rank)), {"kind": "pp", "rank": rank})

    # 2. dp=2: same FQNs, each tensor written by its owner only
    state = full_state()
    owned = {k: v for k, v in state.items() if dp_owner(k, list(state)) == rank}
    persist("dp", 5, as_buffer_views(owned), {"kind": "dp"})
    persist("dp_lopsided", 1, state if rank == 0 else {}, {})  # rank 1 owns nothing

    # 3. tp=2: DTensors over a 1-D tp mesh (Shard(0), Shard(1), Replicate)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    w = tp_full("tp.attn.wq.weight").chunk(world_size, dim=0)[rank]
    w2 = tp_full("tp.mlp.w2.weight").chunk(world_size, dim=1)[rank].contiguous()
    local = as_buffer_views({"w": w, "w2": w2, "b": torch.arange(6.0)})
    tp_state = {
        "tp.attn.wq.weight": DTensor.from_local(local["w"], mesh, [Shard(0)]),
        "tp.mlp.w2.weight": DTensor.from_local(local["w2"], mesh, [Shard(1)]),
        "tp.attn.wq.bias": DTensor.from_local(local["b"], mesh, [Replicate()]),
    }
    persist("tp", 7, tp_state, {"kind": "tp"})

    # 4. keep_latest=2 over three versions, with a stale partial directory
    if rank == 0:
        version_dir(base / "keep", 0).mkdir(parents=True)
    dist.barrier(group)
    keeper = Persister(base / "keep", keep_latest=2, process_group=group, rank=rank)
    for version in (1, 2, 3):
        state = as_buffer_views(stage_state(rank, salt=version))
        keeper.save_async(version, state, {"v": version}).wait(60)
        out[f"keep.latest_after_{version}"] = latest_version(base / "keep")
    keeper.shutdown()

    # timing: ~50 MiB per rank in NUM_TIMED_TENSORS views of one buffer
    numel = MIB_PER_RANK * 2**20 // 4 // NUM_TIMED_TENSORS
    big = as_buffer_views(
        {f"model.big.pp{rank}.{i}.weight": torch.full((numel,), float(i + rank))
         for i in range(NUM_TIMED_TENSORS)}
    )  # fmt: skip
    timer = Persister(base / "timing", process_group=group, rank=rank)
    for version in (1, 2):
        dist.barrier(group)
        t0 = time.perf_counter()
        handle = timer.save_async(version, big)
        t1 = time.perf_counter()
        handle.wait(60)
        t2 = time.perf_counter()
        out[f"timing.v{version}"] = (t1 - t0, t2 - t0)
    timer.shutdown()
    return out


class _DieOnItem:
    """Planner proxy that SIGKILLs this process when DCP resolves its 3rd tensor,
    i.e. while the rank's data file is half written."""

    def __init__(self, planner: Any) -> None:
        self._planner = planner
        self._left = 2

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, item: Any) -> Any:
        if self._left == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self._left -= 1
        return self._planner.resolve_data(item)


def _sigkill_worker(rank: int, world_size: int, root: str, victim: str) -> str:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
    p = Persister(root, process_group=group, rank=rank)
    p.save_async(1, as_buffer_views(stage_state(rank))).wait(30)
    if victim == "writer" and rank == 1:

        class DyingWriter(persister_mod.FileSystemWriter):
            def write_data(self, plan: Any, planner: Any) -> Any:
                return super().write_data(plan, cast(Any, _DieOnItem(planner)))

        persister_mod.FileSystemWriter = DyingWriter  # type: ignore[misc]
    if victim == "coordinator" and rank == 0:
        real_write = persister_mod._atomic_write_text

        def write_then_die(path: Path, text: str) -> None:
            if path.name == COMPLETE_MARKER:  # DCP files and baft_meta.json are done
                os.kill(os.getpid(), signal.SIGKILL)
            real_write(path, text)

        persister_mod._atomic_write_text = write_then_die
    try:
        p.save_async(2, as_buffer_views(stage_state(rank, salt=2))).wait(30)
    except Exception as e:  # noqa: BLE001 - the survivor reports what it saw
        return f"error: {type(e).__name__}"
    return "ok"


# ---------------------------------------------------------------- distributed tests


@pytest.fixture(scope="module")
def scenarios(gloo: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("persist")
    values = gloo.run(_scenarios_worker, 2, args=(str(root),), timeout_s=50)
    return {"root": root, "ranks": values}


@pytest.mark.timeout(45)  # includes the shared 2-rank launch (~8-12 s)
def test_pp_checkpoint_loads_into_fresh_full_model(scenarios: dict) -> None:
    root = scenarios["root"] / "pp"
    assert [r["pp.done"] for r in scenarios["ranks"]] == [True, True]
    assert list_versions(root) == [1] and latest_version(root) == 1
    model = full_model()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    want = full_state()
    for fqn, value in want.items():
        if not fqn.startswith("model."):
            state[fqn] = torch.zeros_like(value)
    dcp.load(state, checkpoint_id=version_dir(root, 1), no_dist=True)
    assert_bit_equal(state, want)
    loaded = dict(model.named_parameters())  # the model itself holds the values
    assert torch.equal(loaded["layers.3.bias"], want["model.layers.3.bias"])
    again = zeros_like_state(want)
    assert load_version(root, 1, again) == {"kind": "pp", "rank": 0}
    assert_bit_equal(again, want)


@pytest.mark.timeout(20)
def test_dp_owners_write_disjoint_tensors_whose_union_loads(scenarios: dict) -> None:
    ckpt = version_dir(scenarios["root"] / "dp", 5)
    want = full_state()
    state = zeros_like_state(want)
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    assert_bit_equal(state, want)
    storage = FileSystemReader(ckpt).read_metadata().storage_data
    written_by = {index.fqn: info.relative_path for index, info in storage.items()}
    assert written_by == {fqn: f"__{dp_owner(fqn, list(want))}_0.distcp" for fqn in want}
    state = zeros_like_state(want)
    dcp.load(state, checkpoint_id=scenarios["root"] / "dp_lopsided/v00000001")
    assert_bit_equal(state, want)


@pytest.mark.timeout(20)
def test_tp_dtensor_shards_load_as_full_tensors(scenarios: dict) -> None:
    state = {fqn: torch.zeros(shape) for fqn, shape in TP_SHAPES.items()}
    state["tp.attn.wq.bias"] = torch.zeros(6)
    dcp.load(state, checkpoint_id=version_dir(scenarios["root"] / "tp", 7), no_dist=True)
    want = {fqn: tp_full(fqn) for fqn in TP_SHAPES}
    want["tp.attn.wq.bias"] = torch.arange(6.0)
    assert_bit_equal(state, want)


@pytest.mark.timeout(20)
def test_keep_latest_two_after_three_saves(scenarios: dict) -> None:
    root = scenarios["root"] / "keep"
    for r in scenarios["ranks"]:  # every rank sees the marker once its wait returns
        assert [r[f"keep.latest_after_{v}"] for v in (1, 2, 3)] == [1, 2, 3]
    assert sorted(os.listdir(root)) == [LATEST_FILE, "v00000002", "v00000003"]
    assert list_versions(root) == [2, 3] and latest_version(root) == 3
    assert (root / LATEST_FILE).read_text() == "3\n"
    want = full_state(salt=3)
    state = zeros_like_state(want)
    assert load_version(root, 3, state) == {"v": 3}
    assert_bit_equal(state, want)


@pytest.mark.timeout(20)
def test_timing_50mib_per_rank(scenarios: dict) -> None:
    root = scenarios["root"] / "timing"
    assert list_versions(root) == [1, 2]
    for rank, r in enumerate(scenarios["ranks"]):
        for version in (1, 2):
            returned, done = r[f"timing.v{version}"]
            print(
                f"rank {rank} v{version}: {MIB_PER_RANK} MiB save_async returned in "
                f"{returned * 1e3:.1f} ms, complete after {done * 1e3:.0f} ms"
            )
    # one file per rank, each holding its own ~50 MiB (not the whole buffer twice)
    sizes = [p.stat().st_size for p in version_dir(root, 2).glob("__*_0.distcp")]
    assert len(sizes) == 2
    assert all(MIB_PER_RANK * 2**20 <= s < (MIB_PER_RANK + 1) * 2**20 for s in sizes)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("victim", ["writer", "coordinator"])
def test_sigkill_mid_save_keeps_previous_version(gloo: Any, tmp_path: Path, victim: str) -> None:
    job = gloo.start(_sigkill_worker, 2, args=(str(tmp_path), victim), timeout_s=30)
    outcomes = job.wait(30, grace_s=10)
    dead, survivor = (1, 0) if victim == "writer" else (0, 1)
    assert outcomes[dead].returncode == -signal.SIGKILL, outcomes[dead].log
    # the peer's handle fails (gloo sees the dead peer) instead of hanging
    assert str(outcomes[survivor].value).startswith("error:"), outcomes[survivor].log
    assert latest_version(tmp_path) == 1
    assert list_versions(tmp_path) == [1]
    partial = version_dir(tmp_path, 2)
    assert partial.is_dir() and not (partial / COMPLETE_MARKER).exists()
    if victim == "coordinator":  # looks like a valid DCP checkpoint, still partial
        assert (partial / ".metadata").is_file()
    # restart (single process): the next save completes and drops the stale partial
    restarted = Persister(tmp_path, rank=0)
    restarted.save_async(3, {"x": torch.arange(4)}).wait(30)
    restarted.shutdown()
    assert list_versions(tmp_path) == [1, 3] and not partial.exists()
    assert latest_version(tmp_path) == 3


# ---------------------------------------------------------------- single-process tests


@pytest.mark.timeout(20)
def test_single_process_round_trip_of_views_of_all_dtypes(tmp_path: Path) -> None:
    want = {
        "a": torch.randn(5, 3),
        "b16": torch.randn(7).to(torch.bfloat16),
        "pos": torch.tensor(99, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "c": torch.randn(2, 2, dtype=torch.complex64),
    }
    p = Persister(tmp_path, rank=0)
    handle = p.save_async(4, as_buffer_views(want), {"step": 4, "tag": ["x"]})
    handle.wait(20)
    assert handle.done() and handle.version == 4
    got = zeros_like_state(want)
    assert load_version(tmp_path, 4, got) == {"step": 4, "tag": ["x"]}
    assert_bit_equal(got, want)
    with pytest.raises(ValueError, match="increasing order"):
        p.save_async(4, want)
    with pytest.raises(ValueError, match="JSON"):
        p.save_async(5, want, {"bad": object()})
    with pytest.raises(ValueError, match="FQN strings to tensors"):
        p.save_async(5, {"a": [1, object()]})  # plain values (param groups) pass, not objects
    p.shutdown()
    p.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        p.save_async(6, want)


@pytest.mark.timeout(20)
def test_resaving_a_version_replaces_it(tmp_path: Path) -> None:
    for value in (1.0, 2.0):  # e.g. after a restart from an older version
        p = Persister(tmp_path, rank=0)
        p.save_async(1, {"w": torch.full((3,), value)}).wait(20)
        p.shutdown()
    got = {"w": torch.zeros(3)}
    load_version(tmp_path, 1, got)
    assert got["w"].tolist() == [2.0, 2.0, 2.0]


def test_the_writer_thread_has_set_its_priority_before_save_async_returns(
    tmp_path: Path,
) -> None:
    """A waiter raises the writer thread only if it is lowered: ``lowered`` must be true
    before the first save can be waited on (a thread lowering itself after the waiter's
    boost would stay idle through the wait)."""

    def slow_lower() -> bool:
        time.sleep(0.3)
        return True

    p = Persister(tmp_path, rank=0, on_thread_start=slow_lower)
    handle = p.save_async(1, {"w": torch.ones(4)})
    assert p.lowered is True
    handle.wait(30)
    p.shutdown()


def test_constructor_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_latest"):
        Persister(tmp_path, rank=0, keep_latest=0)
    with pytest.raises(ValueError, match="rank=1"):
        Persister(tmp_path, rank=1)
    assert not tmp_path.joinpath("v00000000").exists()  # no I/O


def test_select_prunable() -> None:
    assert select_prunable([], [4], 2) == []
    assert select_prunable([3, 1, 2], [], 2) == [1]
    assert select_prunable([1, 2, 3], [0, 5], 1) == [0, 1, 2]
    assert select_prunable([5], [7], 3) == []
    with pytest.raises(ValueError):
        select_prunable([1], [], 0)


def test_latest_version_ignores_bad_or_partial_markers(tmp_path: Path) -> None:
    assert latest_version(tmp_path / "missing") is None
    assert list_versions(tmp_path / "missing") == []
    for v in (1, 2):
        version_dir(tmp_path, v).mkdir()
    (version_dir(tmp_path, 1) / COMPLETE_MARKER).write_text("1\n")
    (tmp_path / LATEST_FILE).write_text("2\n")  # points at a partial directory
    assert latest_version(tmp_path) == 1
    (tmp_path / LATEST_FILE).write_text("garbage")
    assert latest_version(tmp_path) == 1
    assert list_versions(tmp_path) == [1]
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_version(tmp_path, 2, {})
