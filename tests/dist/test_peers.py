"""The peer-library adapters of ``baft bench overhead`` (lm-resiliency, DLRover Flash
Checkpoint) on 2 real gloo ranks: in one launch each takes one snapshot and restores it
bit-exactly; in a second launch a crashed DLRover job leaves nothing in /dev/shm once the
launcher has cleaned up."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from baft_bench.peers import INSTALL_HINT, PEER_MODES, SHM_DIR, SOCKET_DIR, missing_peers

# slow: the peers (lm-resiliency, DLRover) are the bench's, not baft's; default tier:
# unit test_bench_peers (the adapters' contract)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(150),
    pytest.mark.skipif(
        bool(missing_peers(PEER_MODES)),
        reason=f"peer libraries {missing_peers(PEER_MODES)} not installed ({INSTALL_HINT})",
    ),
]


def _trainer(rank: int, world: int, root: str) -> Any:
    """A tiny pp=2 trainer after one step (optimizer state exists); DLRover reads
    torchrun's local-rank variables, which this harness does not set."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from baft.model.config import ModelConfig
    from baft.train.config import ParallelConfig, TrainConfig
    from baft.pipeline.mesh import init_mesh
    from baft.train.trainer import Trainer

    cfg = TrainConfig(
        model=ModelConfig(num_layers=2, d_model=32, num_heads=2, seq_len=16),
        parallel=ParallelConfig(num_pp=2, num_dp=1, num_microbatches=2, ranks_per_node=1),
        num_iterations=4,
        global_batch=4,
        out_dir=root,
    )
    trainer = Trainer(cfg, init_mesh(cfg.parallel))
    trainer.run_step(0)
    return trainer


def _digests(state: dict[str, Any]) -> dict[str, str]:
    import hashlib

    import torch

    out = {}
    for name, t in sorted(state.items()):
        if isinstance(t, torch.Tensor):
            out[name] = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
    return out


def _record_saver(hooks: Any, root: str) -> None:
    """Write the pid of DLRover's saver (a child of local rank 0) where the test finds it:
    after a crash it is an orphan, which torchrun would kill with the worker's group."""
    engine = getattr(getattr(hooks, "checkpointer", None), "_engine", None)
    saver = getattr(engine, "saver_proc", None)
    if saver is not None:
        (Path(root) / f"saver-{saver.pid}.pid").write_text(str(saver.pid))


def _snapshot_restore(trainer: Any, root: str, mode: str) -> dict[str, Any]:
    """Snapshot after one step with ``mode``, move on one step, restore; what happened."""
    from baft_bench.peers import make_peer

    out_dir = str(Path(root) / mode)
    hooks = make_peer(mode, trainer, Path(out_dir) / "ckpt", out_dir=out_dir, ranks_per_node=1)
    _record_saver(hooks, root)
    trainer.hooks = hooks
    trainer.run_step(1)  # the mode snapshots the state after this step
    trainer.hooks, hooks.enabled = None, False  # as the bench switches a mode off
    hooks.drain()
    snap = trainer.state_digests()
    model_snap = _digests({k: v for m in trainer.modules for k, v in m.state_dict().items()})
    metrics = dict(hooks.last_metrics)
    trainer.run_step(2)  # the live state moves on
    moved = trainer.state_digests() != snap
    out: dict[str, Any] = {"moved": moved, "metrics": metrics, "model_snap": model_snap}
    if mode == "lm-resiliency":
        replica = hooks.peer_replica()  # type: ignore[attr-defined]
        out["replica"] = _digests(replica["model"]) if replica else None
        out["step"] = hooks.restore()  # type: ignore[attr-defined]
    else:
        state = hooks.restore()  # type: ignore[attr-defined]
        for m in trainer.modules:
            m.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optim"])
        out["shm"] = sorted(p.name for p in SHM_DIR.glob(f"{hooks.run_id}_*"))  # type: ignore[attr-defined]
    out["restored_equal"] = trainer.state_digests() == snap
    out["nbytes"] = hooks.nbytes  # type: ignore[attr-defined]
    hooks.close()
    if mode == "dlrover-flash":
        out["left"] = sorted(p.name for p in SHM_DIR.glob(f"{hooks.run_id}_*"))  # type: ignore[attr-defined]
    return out


def _adapters(rank: int, world: int, root: str) -> None:
    """Both adapters in one launch (start-up dominates). DLRover goes first: its saver is
    a forked child of local rank 0, and a fork taken while another library's threads hold
    locks (lm-resiliency's) could hang the child, which then never opens its socket."""
    trainer = _trainer(rank, world, root)
    result = {mode: _snapshot_restore(trainer, root, mode) for mode in reversed(PEER_MODES)}
    (Path(root) / f"result{rank}.pkl").write_bytes(pickle.dumps(result))


def _dlrover_crash(rank: int, world: int, root: str) -> None:
    """A fresh launch (see ``_adapters``): a DLRover snapshot under a second run directory
    and a SIGKILL: no close, no atexit, what a crash leaves."""
    import torch.distributed as dist

    from baft_bench.peers import make_peer

    trainer = _trainer(rank, world, root)
    crashed = str(Path(root) / "crashed")
    hooks = make_peer(
        "dlrover-flash", trainer, Path(crashed) / "ckpt", out_dir=crashed, ranks_per_node=1
    )
    _record_saver(hooks, root)
    trainer.hooks = hooks
    trainer.run_step(3)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def test_peer_adapters_snapshot_restore_and_crash_cleanup(gloo: Any, tmp_path: Path) -> None:
    from baft_bench.command import _clean
    from baft_bench.overhead import OverheadConfig
    from baft_bench.peers import dlrover_run_id

    crashed = tmp_path / "crashed"
    run_id = dlrover_run_id(str(crashed))
    try:
        outcomes = gloo.start(_adapters, 2, args=(str(tmp_path),), timeout_s=70).wait(75)
        assert [o.returncode for o in outcomes] == [0, 0], [o.log[-3000:] for o in outcomes]
        outcomes = gloo.start(_dlrover_crash, 2, args=(str(tmp_path),), timeout_s=70).wait(75)
        assert [o.returncode for o in outcomes] == [-signal.SIGKILL] * 2, [
            o.log[-3000:] for o in outcomes
        ]
        results = [pickle.loads((tmp_path / f"result{r}.pkl").read_bytes()) for r in (0, 1)]
        for mode in PEER_MODES:
            out = [r[mode] for r in results]
            for rank, o in enumerate(out):
                assert o["moved"], (
                    f"{mode} rank {rank}: the step after the snapshot changed nothing"
                )
                assert o["restored_equal"], f"{mode} rank {rank}: restored state != snapshot"
                assert o["metrics"]["bytes"] == o["nbytes"] > 0
                assert o["metrics"]["exposed_s"] > 0
            if mode == "lm-resiliency":
                assert [o["step"] for o in out] == [1, 1]  # the hook's first step
                # each rank holds its peer's snapshot bit-exactly (names differ by a prefix)
                assert list(out[0]["replica"].values()) == list(out[1]["model_snap"].values())
                assert list(out[1]["replica"].values()) == list(out[0]["model_snap"].values())
            else:
                assert len(out[0]["shm"]) == 2  # one segment per rank, named after the run id
                assert out[0]["left"] == [] and out[1]["left"] == []  # close removed them
        # the crash left the DLRover segments and sockets behind ...
        assert len(sorted(SHM_DIR.glob(f"{run_id}_*"))) == 2
        assert (SOCKET_DIR / run_id).is_dir()
        _clean(OverheadConfig(out_dir=str(crashed), modes=["none", "dlrover-flash"]))
        # ... and the bench launcher's cleanup removes them
        assert sorted(SHM_DIR.glob(f"{run_id}_*")) == []
        assert not (SOCKET_DIR / run_id).exists()
    finally:
        for pid_file in tmp_path.glob("saver-*.pid"):  # orphaned savers (torchrun would
            try:  # kill them with the worker's process group)
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
