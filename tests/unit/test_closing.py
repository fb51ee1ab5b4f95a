"""The end-of-job rule for snapshot stores (pure): free or keep, and why."""

from __future__ import annotations

import threading
from pathlib import Path

from baft.engine.closing import JobNotEnded, agree_finished, decide, end_of_job
from baft.engine.local_transport import LocalTransport


def test_a_job_that_did_not_end_keeps_its_stores() -> None:
    assert decide(False, 7, None, False) == (
        False,
        "the job did not end cleanly on every rank (a restart resumes from them)",
    )


def test_asked_to_keep_keeps_even_a_persisted_version() -> None:
    assert decide(True, 7, 7, True) == (
        False,
        "they hold v7, the newest version, also persisted to DCP (keep_stores_on_close=True)",
    )
    assert decide(True, 7, 8, False) == (True, "v7 is persisted")


def test_unpersisted_newest_version_is_kept_only_when_asked() -> None:
    assert decide(True, 7, 6, True) == (
        False,
        "they hold v7, the newest version, not persisted to DCP (keep_stores_on_close=True)",
    )
    assert decide(True, 7, None, False) == (
        True,
        "v7, the newest version, is not persisted to DCP; set "
        "CheckpointConfig.store.keep_on_close=True to keep it in memory",
    )
    assert decide(True, None, None, True) == (True, "no version was committed")


def _agree(
    values: list[tuple[bool, int | None]], fail: int | None = None
) -> list[tuple[bool, str]]:
    """``agree_finished`` on every rank of an in-process group, each with its
    ``(finished, committed)``; rank ``fail`` dies instead of answering."""
    group = LocalTransport.group(len(values), timeout_s=5.0)
    out: list[tuple[bool, str]] = [(False, "")] * len(values)

    def rank(r: int) -> None:
        if r == fail:
            group[r].fail()
            return
        out[r] = agree_finished(group[r], *values[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_every_rank_agrees_on_one_clean_end() -> None:
    assert _agree([(True, 7), (True, 7)]) == [(True, ""), (True, "")]
    assert _agree([(True, None), (True, None)]) == [(True, ""), (True, "")]


def test_no_agreement_says_why() -> None:
    inside = "a rank closed with an exception in flight or inside an iteration"
    assert _agree([(True, 7), (False, 7)]) == [(False, inside)] * 2
    versions = "the ranks closed at different committed versions (v6..v7)"
    assert _agree([(True, 7), (True, 6)]) == [(False, versions)] * 2
    ok, why = _agree([(True, 7), (True, 7)], fail=1)[0]
    assert not ok and why.startswith("a rank did not answer (") and "failed" in why


def test_the_error_tells_the_user_what_happens_next() -> None:
    text = str(JobNotEnded.because("a rank did not answer (reset)"))
    assert "a rank did not answer (reset)" in text and "torchrun restarts every rank" in text


def test_the_final_flush_runs_only_once_every_rank_agreed(tmp_path: Path) -> None:
    """``end_of_job`` calls the engine's final flush after the agreement, on every rank,
    and only when every rank ended cleanly; the decision then sees what it wrote."""
    group = LocalTransport.group(2, timeout_s=5.0)
    flushed: list[int] = []

    def run(finished: list[bool]) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = [(False, "")] * 2

        def rank(r: int) -> None:
            out[r] = end_of_job(
                transport=group[r], finished=finished[r], committed=7,
                store_root=str(tmp_path / "shm"), job_id="j", persist_dir=str(tmp_path / "dcp"),
                keep=False, run_dir=tmp_path / "run", rank=r,
                flush_final=lambda: flushed.append(r),
            )  # fmt: skip

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    assert [ok for ok, _ in run([True, False])] == [False, False] and flushed == []
    assert run([True, True]) == [(True, ""), (True, "")] and sorted(flushed) == [0, 1]
