"""The recovery bench's cold disk row: its ranks run ``baft_bench.cold_worker``, which
evicts the run's DCP files from the page cache before the training worker starts (the
harness does it; nothing in baft reads an environment variable for it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import baft.train.worker
import baft_bench.recovery as recovery
from baft.config import CheckpointConfig, StoreConfig
from baft.model.config import ModelConfig
from baft.train.config import ParallelConfig, TrainConfig
from baft.train.launch import WORKER, prepare_run_dir
from baft_bench import cold_worker


def _cfg(out: Path, checkpoint: CheckpointConfig | None) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(num_layers=2, d_model=32, num_heads=2, seq_len=16),
        parallel=ParallelConfig(num_pp=2, num_dp=1, num_microbatches=2, ranks_per_node=1),
        global_batch=4,
        out_dir=str(out),
        checkpoint=checkpoint,
    )


def test_persist_dir_is_the_one_launch_wrote(tmp_path: Path) -> None:
    ck = CheckpointConfig(store=StoreConfig(root=str(tmp_path / "shm")))
    path = prepare_run_dir(_cfg(tmp_path / "run", ck))
    assert cold_worker.persist_dir(path) == tmp_path / "run" / "checkpoints"
    assert cold_worker.persist_dir(prepare_run_dir(_cfg(tmp_path / "bare", None))) is None


def test_evict_counts_every_file_and_keeps_the_bytes(tmp_path: Path) -> None:
    files = {tmp_path / "ck" / "v7" / "__0_0.distcp": b"a" * 5000, tmp_path / "ck" / "x": b"b"}
    for f, data in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    assert cold_worker.evict_page_cache(tmp_path / "ck") == 2
    assert {f: f.read_bytes() for f in files} == files
    assert cold_worker.evict_page_cache(tmp_path / "missing") == 0


def test_main_evicts_then_runs_the_training_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = CheckpointConfig(store=StoreConfig(root=str(tmp_path / "shm")))
    path = prepare_run_dir(_cfg(tmp_path / "run", ck))
    (tmp_path / "run" / "checkpoints" / "v3").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "v3" / "f").write_bytes(b"x")
    calls: list[Any] = []
    monkeypatch.setattr(cold_worker, "evict_page_cache", lambda d: calls.append(("evict", d)) or 1)
    monkeypatch.setattr(baft.train.worker, "main", lambda argv: calls.append(("train", argv)) or 0)
    assert cold_worker.main([str(path)]) == 0
    assert calls == [("evict", tmp_path / "run" / "checkpoints"), ("train", [str(path)])]


@pytest.mark.parametrize(("cold", "worker"), [(True, "baft_bench.cold_worker"), (False, WORKER)])
def test_only_the_cold_row_runs_the_evicting_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool, worker: str
) -> None:
    seen: dict[str, Any] = {}

    def launch(cfg: TrainConfig, **kw: Any) -> int:
        seen.update(kw, env=os.environ.get("BAFT_COLD_DISK_RESTORE"))
        summary = {"recoveries": [{"source": "disk"}]}
        (Path(cfg.out_dir) / "summary.json").write_text(json.dumps(summary))
        return 0

    monkeypatch.setattr(recovery, "launch", launch)
    a = SimpleNamespace(
        out=str(tmp_path), layers=2, d_model=32, iterations=6, persist_every=2,
        full_every="1", verbose=False,
    )  # fmt: skip
    (tmp_path / "disk").mkdir()
    assert recovery._run(a, "disk", ["power:iter=4"], cold=cold) == [{"source": "disk"}]
    assert seen == {"quiet": True, "worker": worker, "env": None}
