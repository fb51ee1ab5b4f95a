"""The recovery bench's peer arms end to end: torchft 0.2.0 (lighthouse, two torchruns)
and NVRx 0.4.1's in-process Wrapper (reserve rank) on a small model, a replica's worker
SIGKILLed from outside, each against its failure-free job of the same length."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from baft_bench.peer_arms import installed, replay_check
from baft_bench.peer_downtime import failures, final_state

SMALL = {"layers": 2, "d_model": 64, "gap": 3, "seed": 7}


@pytest.mark.slow  # two torchft jobs (~1-2 min each on 2 cores): the survivor waits out the dead replica's 5 s heartbeat timeout, torchrun restarts the other
@pytest.mark.timeout(900)
@pytest.mark.skipif(installed("torchft", "torchft") is None, reason="torchft not installed (benchmarks[peers])")  # fmt: skip
def test_torchft_survivor_goes_on_and_the_difference_is_the_dropped_rows(tmp_path: Path) -> None:
    from baft_bench.torchft_recovery import run_job

    got = run_job(tmp_path / "faulted", kills=1, steps=10_000, **SMALL)
    ref = run_job(tmp_path / "failure-free", kills=0, steps=got["steps"], **SMALL)
    (f,) = failures(got["kills"], got["attempts"], got["ready"], replicas=2)
    assert f["survivors_replaced"] == 0  # the survivor kept its process
    # its step in flight fails and is tried again when the kill lands before that step's
    # allreduce; a kill after it costs nothing (the kill's moment in the step is random)
    assert f["lost_iterations"] in (0, 1)
    assert f["dropped_batches"] >= 1  # steps it committed alone
    assert f["full_strength_s"] is not None and f["full_strength_s"] >= f["downtime_s"]
    assert f["seconds"]["restore"] > 0  # the new worker healed from the survivor
    final = final_state(got["finals"], ref["finals"], None)
    assert final["replicas_agree"] and final["steps"] == final["reference_steps"] == [got["steps"]]
    assert not final["bit_identical"]
    # ... and replaying the committed steps without the dropped rows gives its bits
    a = argparse.Namespace(layers=SMALL["layers"], d_model=SMALL["d_model"])
    rep = replay_check(a, got)
    assert rep["matches"] is True
    # step 0 lacks replica 1's rows in both jobs (torchft's init_sync heal zeroes them)
    assert rep["steps_without_a_replica"][0] == 0
    assert len(rep["steps_without_a_replica"]) - 1 == f["dropped_batches"]


@pytest.mark.slow  # two NVRx jobs of 3 processes each (~1 min each)
@pytest.mark.timeout(600)
@pytest.mark.skipif(installed("nvidia-resiliency-ext", "nvidia_resiliency_ext") is None, reason="NVRx not installed (benchmarks[peers])")  # fmt: skip
def test_nvrx_wrapper_with_a_reserve_ends_on_the_failure_free_state(tmp_path: Path) -> None:
    from baft_bench.nvrx_recovery import run_job

    got = run_job(tmp_path / "faulted", kills=1, steps=10_000, **SMALL)
    ref = run_job(tmp_path / "failure-free", kills=0, steps=got["steps"], **SMALL)
    (f,) = failures(got["kills"], got["attempts"], got["ready"], replicas=2)
    assert f["survivors_replaced"] == 0 and f["dropped_batches"] == 0
    assert f["lost_iterations"] in (0, 1)  # the survivor's failed step (unlogged if NVRx
    # interrupts it outside the step's try, e.g. in ping())
    assert f["full_strength_s"] == f["downtime_s"]  # the reserve is rank 1 at once
    assert f["seconds"]["restore"] > 0  # the state broadcast to the reserve
    final = final_state(got["finals"], ref["finals"], None)
    assert final["bit_identical"], final
