"""Two pipeline stages built from a fresh ``nn.Sequential`` each (the same FQNs,
``0.weight``, on both) persist to DCP under stage keys and come back from it after a
"power loss" (every store wiped) into the right stage, bit-exactly: with full snapshots
(the persister reads the committed slot) and with differential ones (a live copy).
Plain ``dcp.load`` reads each stage back with the ``pp<i>.`` prefix. Over real gloo ranks
in one job (processes start once)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from baft.store.disk import latest_version, read_metadata, version_dir
from tests.dist.test_api_restore import _digest, _iteration, _protect, _setup

pytestmark = pytest.mark.timeout(240)
ITERATIONS = 6


def _power_loss_job(
    rank: int, world: int, root: str, full_every: int, writer: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s = _setup(rank, world)
    ft = _protect(s, root, full_every=full_every, persist_every=2, writer=writer)
    ft.restore()
    digests, params = {}, {}
    for it in range(ITERATIONS):
        digests[it] = _digest(s["module"], s["opt"], s["sched"], s["sampler"])
        params[it] = {n: p.detach().clone() for n, p in s["module"].named_parameters()}
        _iteration(s, rank)
    # a version passed over while the writer was busy is owed, and close persists the
    # final state (version ITERATIONS) in its place
    digests[ITERATIONS] = _digest(s["module"], s["opt"], s["sched"], s["sampler"])
    params[ITERATIONS] = {n: p.detach().clone() for n, p in s["module"].named_parameters()}
    ft.close()
    ckdir = Path(root) / "run" / "checkpoints"
    newest = latest_version(ckdir)
    assert newest is not None
    out["persisted"] = newest
    out["keys"] = read_metadata(ckdir, newest).get("dcp_keys")

    # what a user does: a fresh stage module, its keys prefixed with the stage, plain DCP
    fresh = _setup(rank, world)["module"]
    target = {f"pp{rank}.{n}": p.detach() for n, p in fresh.named_parameters()}
    dcp.load(target, checkpoint_id=str(version_dir(ckdir, newest)), no_dist=True)
    out["plain_load_equal"] = all(
        torch.equal(p, params[newest][n]) for n, p in fresh.named_parameters()
    )

    # power loss: every store gone; the next launch resumes from DCP
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(root) / "shm", ignore_errors=True)
    dist.barrier()
    s2 = _setup(rank, world)
    ft2 = _protect(s2, root, full_every=full_every, persist_every=2, writer=writer)
    out["restored"] = ft2.restore()
    out["source"] = ft2.recovery.record["source"]
    out["restored_equal"] = (
        _digest(s2["module"], s2["opt"], s2["sched"], s2["sampler"]) == digests[out["restored"]]
    )
    ft2.close()
    return out


@pytest.mark.parametrize(
    ("full_every", "writer"),
    # the writer process (PersistConfig(writer="process")) reads the committed slot (full)
    # and the live copy's shared buffer (differential)
    [(1, "thread"), (2, "thread"), (1, "process"), (2, "process")],
)
def test_stages_sharing_fqns_persist_and_restore_from_dcp(
    gloo, tmp_path: Path, full_every: int, writer: str
) -> None:
    got = gloo.run(_power_loss_job, 2, args=(str(tmp_path), full_every, writer), timeout_s=180)
    for out in got:
        assert out["keys"] == "pp", out
        # the last due version (4), the last iteration's, or close's final flush (6)
        assert out["persisted"] in (ITERATIONS - 2, ITERATIONS - 1, ITERATIONS), out
        assert out["plain_load_equal"] is True, out
        assert out["source"] == "disk", out
        assert out["restored"] == out["persisted"], out
        assert out["restored_equal"] is True, out
