"""The end-of-job rule for snapshot stores (pure): free or keep, and why."""

from __future__ import annotations

from baft.engine.closing import decide


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
