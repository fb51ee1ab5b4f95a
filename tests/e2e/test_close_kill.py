"""A rank killed inside ``ft.close()``, at the job's end, in a job of two agents.

The training is over, its last version committed; one rank dies before the ranks agree
that the job ended. Under torchrun's group restart the peers used to end with status 0
("no agreement on a clean end: keeping the stores"), so the victim's agent restarted
alone and waited 300 s in a rendezvous nobody else would join, then failed the job
(CI, 2026-12-07). Now the peers' ``close()`` raises ``JobNotEnded``: both agents
restart, the job restores its last version from memory, runs no iteration and closes
cleanly. In-process, the survivors re-enter and the victim is replaced. Either way both
agents end with status 0, the training bit-identical to the same job without baft.

Without the fix this test ends in the agents' timeout (``WAIT_S``), not the rendezvous'.
The kill is the fault injector's (``kill:rank=R,iter=0,at=close``: SIGKILL of the rank's
own process at that point): no signal from outside can aim at a window of milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e import jobs
from tests.e2e.matrix import Case

pytestmark = pytest.mark.timeout(300)
ITERATIONS = 8
WAIT_S = 150.0
"""Far below the 300 s rendezvous timeout the old behaviour ended in."""


def _case(launch: str) -> Case:
    return Case(
        app="user-unique", layout="pp2", schedule="1f1b", full_every="1", redundancy="xor",
        persist="off", hosts="hostid", launch=launch, fault="kill",
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return jobs.reference(_case("group"), tmp_path_factory.mktemp("ref"), ITERATIONS)


def _run(case: Case, tmp_path: Path, ref: dict[str, Any], victim: int) -> jobs.Job:
    root = Path("/dev/shm") / f"baft-close-{tmp_path.name}"
    out = tmp_path / "run"
    out.mkdir()
    job = jobs.Job(case=case, out=out, root=root, env=jobs.launch_env(), iterations=ITERATIONS)
    job.inject = [f"kill:rank={victim},iter=0,at=close"]
    job.extra_args = ["--after-close=0.2"]
    # the workers' output into the agents' logs, as a plain torchrun: with --redirects the
    # survivor's exit came late enough that its agent joined the victim's restart anyway
    job.redirect = False
    try:
        job.start(["a", "b"])
        rcs = job.wait(WAIT_S)
        problems = [] if all(rc == 0 for rc in rcs.values()) else [f"agents ended {rcs}"]
        done = sorted(p.name for p in out.glob("after_close.rank*"))
        if done != ["after_close.rank1"]:  # the last stage's work after close(), once done
            problems.append(f"after-close work: {done}")
        problems += jobs.check_training(case, job, ref, ITERATIONS)
        if problems:
            pytest.fail("\n".join([*problems, job.tail()]), pytrace=False)
        return job
    finally:
        jobs.stop_job(job)


def test_group_restart_ends_cleanly_after_a_rank_dies_in_close(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    job = _run(_case("group"), tmp_path, reference, victim=1)
    fired = jobs.read_jsonl(job.out / "faults.jsonl")
    assert [(f["rank"], f["point"]) for f in fired] == [(1, "close")]
    recs = jobs.read_jsonl(job.out / "recoveries.jsonl")
    # the restart restored the last iteration's version from memory and trained no more
    assert [(r["source"], r["restored_version"], r["lost_iterations"]) for r in recs] == [
        ("memory", ITERATIONS - 1, 1)
    ]
    survivor = (job.out / "agent-a-0.log").read_text(errors="replace")
    assert "JobNotEnded: baft: ft.close() found no agreement" in survivor


@pytest.mark.slow
def test_inprocess_ends_cleanly_after_a_rank_dies_in_close(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    job = _run(_case("inprocess"), tmp_path, reference, victim=1)
    recs = jobs.read_jsonl(job.out / "recoveries.jsonl")
    assert [(r["attempt"], r["source"], r["restored_version"]) for r in recs] == [
        (0, "memory", ITERATIONS - 1)
    ]
    assert all(jobs.generation(r) == 1 for r in recs)
