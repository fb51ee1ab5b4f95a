"""``ft.close()`` at the end of a job frees its snapshot stores in ``/dev/shm`` (or keeps
them, as asked), over real gloo ranks; a job that did not end keeps them for its restart.

1. A clean end whose newest version is not persisted, ``keep_stores_on_close=False``: the
   store root holds no file of the job; relaunching the finished job says why nothing
   can be restored (not a bare 'refusing to start over').
2. The same with ``keep_stores_on_close=True``: the stores stay and a relaunch resumes
   from memory.
3. A clean end with the newest version persisted (``persist_every=1``): freed; a relaunch
   resumes from DCP.
4. ``close()`` with an exception in flight (not a clean end): the stores stay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.dist.test_api_restore import _error, _iteration, _protect, _setup

pytestmark = pytest.mark.timeout(240)


def _files(root: Path) -> list[str]:
    """Every file under the job's store directory, relative to the store root."""
    shm = root / "shm"
    return sorted(str(f.relative_to(shm)) for f in shm.rglob("*") if f.is_file())


def _run(rank: int, world: int, root: Path, keep: bool, persist_every: int) -> None:
    s = _setup(rank, world)
    ft = _protect(s, str(root), keep_stores=keep, persist_every=persist_every)
    ft.restore()
    for _ in range(4):
        _iteration(s, rank)
    ft.close()
    dist.barrier()  # every rank's close() has run


def _relaunch(rank: int, world: int, root: Path, keep: bool, persist_every: int) -> Any:
    s = _setup(rank, world)
    ft = _protect(s, str(root), keep_stores=keep, persist_every=persist_every)
    out = _error(ft.restore) or (ft.restore.__name__, ft.recovery.record["source"])
    ft.close()
    return out


def _close_job(rank: int, world: int, base: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, keep, persist_every in (("freed", False, 0), ("kept", True, 0), ("dcp", False, 1)):
        root = Path(base) / name
        _run(rank, world, root, keep, persist_every)
        out[name] = _files(root)
        dist.barrier()
        out[f"{name}_relaunch"] = _relaunch(rank, world, root, keep, persist_every)
        dist.barrier()

    # an exception in flight at close(): not a clean end, the stores stay
    root = Path(base) / "error"
    s = _setup(rank, world)
    ft = _protect(s, str(root), keep_stores=False)
    ft.restore()
    for _ in range(3):
        _iteration(s, rank)
    try:
        raise KeyError("the user's loop failed")
    except KeyError:
        ft.close()
    dist.barrier()
    out["error"] = _files(root)
    return out


def test_close_frees_or_keeps_the_stores(gloo, tmp_path: Path) -> None:
    got = gloo.run(_close_job, 2, args=(str(tmp_path),), timeout_s=200)
    stores = [
        f"restore-test/node{r}/rank{r}/{f}"
        for r in (0, 1)
        for f in ("commit.json", "progress", "slot0.data", "slot0.json", "slot0.red")
    ]
    for rank, out in enumerate(got):
        assert out["freed"] == [], out
        kind, message = out["freed_relaunch"]
        assert kind == "RestoreError", out
        assert "the job ended cleanly at iteration 3 and close() freed its stores" in message
        assert "keep_stores_on_close=True to continue a finished job from memory" in message
        assert set(stores) <= set(out["kept"]), (rank, out["kept"])
        assert out["kept_relaunch"] == ("restore", "memory"), out
        assert out["dcp"] == [], out
        assert out["dcp_relaunch"] == ("restore", "disk"), out
        assert set(stores) <= set(out["error"]), (rank, out["error"])
