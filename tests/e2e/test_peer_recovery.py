"""lm-resiliency's restore after a rank crash (the recovery bench's peer row), end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from baft_bench.peers import INSTALL_HINT, missing_peers


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    bool(missing_peers(["lm-resiliency"])), reason=f"lm-resiliency not installed ({INSTALL_HINT})"
)
def test_lm_resiliency_restores_a_crashed_rank_from_its_peer(tmp_path: Path) -> None:
    from baft_bench.peer_recovery import run_lm_recovery

    row = run_lm_recovery(tmp_path / "run", layers=2, d_model=64, iterations=9)
    run = tmp_path / "run"
    # killed at iteration 3: the replica of step 3 was in flight, step 2 is restored
    # (run_lm_recovery raises unless the restored state is bit-exact)
    assert row["restored_version"] in (2, 3)
    assert row["lost_iterations"] == 3 - row["restored_version"]
    assert set(row["seconds"]) == {"detect_restart", "rendezvous", "load", "first_iteration"}
    assert row["restore_s"] == row["seconds"]["load"] > 0
    assert list(run.glob("gemini/**/rank-1.pt")), "rank 1's shard was never flushed by its peer"
