"""The watchdog's decision (pure), its limits, its records, and two live watchdogs on a
real TCPStore (threads in this process) telling a frozen peer from a straggler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from baft.liveness import absence
from baft.liveness import watchdog as wdm
from baft.liveness.watchdog import PeerView, Verdict, Watchdog, decide

T = 10.0


def _decide(now: float, peers: list[PeerView], **kw: object) -> tuple[Verdict | None, str]:
    args: dict[str, object] = dict(
        store_ok_at=now,
        store_rank=0,
        section=None,
        section_since=0.0,
        section_limit_s=2 * T,
        timeout_s=T,
    )
    args.update(kw)
    return decide(now, peers, **args)  # type: ignore[arg-type]


def test_silent_peer_is_a_hang_after_the_timeout() -> None:
    peers = [PeerView(1, 100.0, "iteration 7"), PeerView(2, 95.0, "iteration 7")]
    assert _decide(105.0, peers) == (None, "ok")  # rank 2 silent 10.0 s: not yet
    verdict, reason = _decide(105.5, peers)
    assert verdict == Verdict("peer", 2, "iteration 7", 10.5)
    assert reason == (
        "rank 2 has not sent a heartbeat for 10.5 s in section 'iteration 7' "
        "(timeout 10 s): it is frozen or gone"
    )


def test_finished_peer_is_never_a_hang() -> None:
    peers = [PeerView(1, 0.0, "", done=True)]
    assert _decide(1000.0, peers) == (None, "ok")


def test_straggler_keeps_beating_and_is_not_a_hang() -> None:
    # A slow rank: its heartbeat changed 0.9 s ago, its section ran 5x an iteration.
    peers = [PeerView(1, 99.1, "iteration 12")]
    assert _decide(100.0, peers, section="iteration 12", section_since=95.0) == (None, "ok")


def test_store_silence_blames_the_store_host_not_the_first_peer() -> None:
    peers = [PeerView(1, 80.0), PeerView(2, 80.0)]  # everyone looks silent: store is down
    verdict, reason = _decide(100.0, peers, store_ok_at=80.0)
    assert verdict == Verdict("store", 0, "", 20.0)
    assert reason.startswith("the rendezvous store (hosted by rank 0) has not answered for 20.0 s")


def test_own_section_past_its_limit() -> None:
    verdict, reason = _decide(200.0, [], section="iteration 3", section_since=179.0)
    assert verdict == Verdict("self", None, "iteration 3", 21.0)
    assert reason == (
        "this rank has been in section 'iteration 3' for 21.0 s (limit 20 s = 2 x timeout)"
    )


def test_limits_and_hierarchy() -> None:
    assert wdm.beat_period(60.0) == 1.0 and wdm.beat_period(8.0) == 0.8
    assert wdm.section_limit("iteration 5", 8.0) == 16.0
    assert wdm.section_limit("restore", 8.0) == 80.0
    assert wdm.section_limit("close", 8.0) == 80.0
    assert wdm.watched_peers(1, 4) == [0, 2, 3]
    assert wdm.watched_peers(0, 100) == [1, 2, 98, 99]


def test_hang_records_roundtrip(tmp_path: Path) -> None:
    wdm.append_hang(tmp_path, {"attempt": 1, "detected_at": 5.0, "suspect": 3})
    wdm.append_hang(tmp_path, {"attempt": 0, "detected_at": 2.0, "suspect": 1})
    wdm.append_hang(tmp_path, {"attempt": 0, "detected_at": 1.0, "suspect": 2})
    assert [r["suspect"] for r in wdm.read_hangs(tmp_path)] == [2, 1, 3]
    assert [r["suspect"] for r in wdm.read_hangs(tmp_path, attempt=0)] == [2, 1]
    assert wdm.read_hangs(tmp_path / "none") == []


def test_only_a_stopped_process_with_the_same_start_time_is_killed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = absence.start_time(proc.pid)
        assert start is not None
        assert not absence.kill_if_stopped(proc.pid, start)  # running: torchrun's SIGTERM works
        os.kill(proc.pid, signal.SIGSTOP)
        while absence.proc_state(proc.pid) != "T":
            time.sleep(0.01)
        assert not absence.kill_if_stopped(proc.pid, str(int(start) + 1))  # another process
        assert absence.kill_if_stopped(proc.pid, start)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _live_dog(run_dir: Path, port: int, rank: int, *, timeout_s: float) -> Watchdog:
    """A started watchdog of ``rank`` (of two) on the TCPStore at ``port``; it records
    hangs but never ends the test process."""
    return Watchdog(
        rank=rank,
        world_size=2,
        timeout_s=timeout_s,
        run_dir=run_dir,
        host="127.0.0.1",
        port=port,
        exit_process=False,
    ).start()


@pytest.mark.timeout(60)
def test_live_watchdogs_catch_a_frozen_peer(tmp_path: Path) -> None:
    """Two watchdogs on one TCPStore. Rank 1 slows its section down (still beating), then
    its threads stop (as under SIGSTOP): rank 0 names rank 1 and records it."""
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dogs = [_live_dog(tmp_path, port, r, timeout_s=1.0) for r in (0, 1)]
    try:
        with dogs[1].section("iteration 4"):
            time.sleep(1.5)  # longer than the timeout, below the 2x section limit
        assert dogs[0].verdict is None and dogs[1].verdict is None
        with dogs[1].section("iteration 5"):
            time.sleep(0.3)
            dogs[1]._stop.set()  # frozen: no more heartbeats
            deadline = time.monotonic() + 20
            while dogs[0].verdict is None and time.monotonic() < deadline:
                time.sleep(0.05)
        assert dogs[0].verdict is not None
        verdict, reason = dogs[0].verdict
        assert (verdict.kind, verdict.rank, verdict.section) == ("peer", 1, "iteration 5")
        assert reason.startswith("rank 1 has not sent a heartbeat for ")
        (rec,) = wdm.read_hangs(tmp_path)
        assert rec["suspect"] == 1 and rec["detected_by"] == 0 and rec["killed"] == []
        assert rec["detected_at"] - rec["last_seen_at"] == pytest.approx(rec["silent_s"], abs=0.01)
    finally:
        for d in dogs:
            d._stop.set()
        del master


def test_error_in_a_section_kills_nobody_when_peers_beat(tmp_path: Path) -> None:
    dog = Watchdog(
        rank=0,
        world_size=2,
        timeout_s=5.0,
        run_dir=tmp_path,
        host="127.0.0.1",
        port=1,
        exit_process=False,
    )
    now = time.monotonic()
    dog._seen[1] = (b"x", now, {"section": "iteration 2"})
    dog._store_ok_at = now
    with pytest.raises(TimeoutError, match="peer gone"), dog.section("iteration 2"):
        raise TimeoutError("peer gone")
    assert dog.verdict is None and wdm.read_hangs(tmp_path) == []
    dog._seen[1] = (b"x", now - 10, {"section": "iteration 2", "host": "elsewhere", "pid": 1})
    with pytest.raises(TimeoutError), dog.section("iteration 3"):
        raise TimeoutError("pipeline wait w2 (p2p) found no peer for 5 s")
    assert dog.verdict is not None and dog.verdict[0].rank == 1
    (rec,) = wdm.read_hangs(tmp_path)
    assert rec["kind"] == "peer" and rec["killed"] == []  # on another host: not ours to kill
    assert "TimeoutError while rank 1 has been silent for " in rec["reason"]


@pytest.mark.timeout(60)
def test_an_error_outside_any_section_is_dealt_with_on_its_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective between steps (the trainer's metrics all-reduce, one in a user's
    loop) times out on a frozen peer: the exception ending the process reaches the
    watchdog through sys.excepthook, which records the hang once and hands the error on
    to the previous hook; stop() puts that hook back."""
    printed: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, err, tb: printed.append(err))
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dog = _live_dog(tmp_path, port, 0, timeout_s=5.0)
    try:
        with dog._lock:  # peer 1 silent for 2 s: past 3 beats, not yet the 5 s timeout
            dog._seen[1] = (b"x", time.monotonic() - 2.0, {"section": "iteration 7"})
        err = RuntimeError("Timed out waiting 5000ms for recv operation to complete")
        sys.excepthook(RuntimeError, err, None)
        sys.excepthook(RuntimeError, err, None)  # again: no second record
        assert printed == [err, err]
        assert dog.verdict is not None and dog.verdict[0].rank == 1
        (rec,) = wdm.read_hangs(tmp_path)
        assert (rec["kind"], rec["suspect"], rec["section"]) == ("peer", 1, "iteration 7")
        assert rec["reason"].startswith("RuntimeError while rank 1 has been silent for 2.")
    finally:
        dog.stop()
        del master
    sys.excepthook(ValueError, ValueError("after stop"), None)
    assert [str(e) for e in printed[2:]] == ["after stop"] and len(wdm.read_hangs(tmp_path)) == 1


@pytest.mark.timeout(60)
def test_a_finished_rank_is_not_a_hang(tmp_path: Path) -> None:
    """stop() publishes done=True before its threads end (and joins them): the peer never
    declares the finished rank, however long it keeps running."""
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dogs = [_live_dog(tmp_path, port, r, timeout_s=1.0) for r in (0, 1)]
    try:
        while 1 not in dogs[0]._seen:
            time.sleep(0.05)
        dogs[1].stop()
        assert dogs[1]._threads == []
        while not dogs[0]._views(time.monotonic())[0].done:
            time.sleep(0.05)
        time.sleep(1.5)  # past the timeout: a silent, unfinished rank would be declared
        assert dogs[0].verdict is None
        assert wdm.read_hangs(tmp_path) == []
    finally:
        dogs[0].stop()
        del master


@pytest.mark.timeout(60)
def test_the_running_watchdog_tells_the_sigterm_handling_a_peer_exited(tmp_path: Path) -> None:
    """The running watchdog's probe (what the engine's SIGTERM handling is built with): a
    peer on this host whose process is gone (its heartbeat's pid and start time) is
    absent at once; stopped, the watchdog sees nothing."""
    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = absence.start_time(peer.pid)
    dog = _live_dog(tmp_path, port, 0, timeout_s=5.0)
    try:
        beat = {"host": dog.hostname, "pid": peer.pid, "start": start, "section": "iteration 3"}
        with dog._lock:
            dog._seen[1] = (b"x", time.monotonic(), beat)
        assert dog.absent_peer() is None
        peer.kill()
        peer.wait()
        assert dog.absent_peer() == f"rank 1 has exited (pid {peer.pid} on this host)"
        with dog._lock:
            dog._seen[1] = (b"y", time.monotonic(), dict(beat, done=True))
        assert dog.absent_peer() is None  # it had finished cleanly
    finally:
        dog.stop()
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        del master
    assert dog.absent_peer() is None


def test_recovery_attributes_the_hang_that_began_its_chain(tmp_path: Path) -> None:
    """A hang at attempt 0 whose first restart failed is still the hang the recovery at
    attempt 2 reports; a hang an earlier recovery already reported is not."""
    import json

    from baft.recover.report import unattributed_hangs

    def hang(attempt: int, at: float, suspect: int) -> None:
        rec = {"attempt": attempt, "detected_at": at, "last_seen_at": at - 8, "suspect": suspect}
        wdm.append_hang(tmp_path, rec)

    hang(0, 100.0, 1)  # reported by the recovery that resumed at 120
    (tmp_path / "recoveries.jsonl").write_text(json.dumps({"resumed_at": 120.0}) + "\n")
    hang(1, 200.0, 0)  # attempt 1's hang: its restart (attempt 2) failed before resuming
    hang(1, 201.0, 1)
    assert unattributed_hangs(tmp_path, (0, 0)) == []
    assert unattributed_hangs(tmp_path, (1, 0)) == []  # attempt 0's hang was reported already
    got = unattributed_hangs(tmp_path, (3, 0))
    assert [(h["attempt"], h["suspect"]) for h in got] == [(1, 0), (1, 1)]
    assert [(h["attempt"], h["suspect"]) for h in unattributed_hangs(tmp_path, (2, 0))] == [
        (1, 0),
        (1, 1),
    ]
    # in-process: generation 1 of attempt 1 reports the hang of its generation 0 (attempt 1)
    assert [h["suspect"] for h in unattributed_hangs(tmp_path, (1, 1))] == [0, 1]
    wdm.append_hang(tmp_path, {"attempt": 1, "generation": 1, "detected_at": 202.0,
                               "last_seen_at": 195.0, "suspect": 3})  # fmt: skip
    assert [h["suspect"] for h in unattributed_hangs(tmp_path, (1, 2))] == [0, 1]
    assert [h["suspect"] for h in unattributed_hangs(tmp_path, (2, 0))] == [0, 1]
