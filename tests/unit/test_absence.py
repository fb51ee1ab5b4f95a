"""Who can no longer vote: the pure rule behind "no SIGTERM grace for a dead peer", and
the /proc reading it rests on (a SIGKILLed process, a zombie, a reused pid)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from baft.liveness import absence
from baft.liveness.absence import PeerBeat, absent

HERE = "hostA"


def _rule(
    peers: list[PeerBeat], *, exited: frozenset[int] = frozenset(), store_silent_s: float = 0.0
) -> tuple[str | None, list[tuple[int, str]]]:
    calls: list[tuple[int, str]] = []

    def fake_exited(pid: int, start: str) -> bool:
        calls.append((pid, start))
        return pid in exited

    why = absent(
        100.0, peers, here=HERE, store_silent_s=store_silent_s, quiet_s=3.0, exited=fake_exited
    )
    return why, calls


def test_a_peer_process_gone_on_this_host_is_absent_at_once() -> None:
    peers = [
        PeerBeat(1, 99.9, host=HERE, pid=11, start="500"),
        PeerBeat(2, 99.9, host=HERE, pid=12, start="501"),
    ]
    why, calls = _rule(peers, exited=frozenset({12}))
    assert why == "rank 2 has exited (pid 12 on this host)"
    assert calls == [(11, "500"), (12, "501")]


def test_every_peer_alive_and_beating_is_no_absence() -> None:
    peers = [PeerBeat(1, 99.0, host=HERE, pid=11, start="5"), PeerBeat(3, 97.5, host="hostB")]
    assert _rule(peers) == (None, [(11, "5")])  # the remote peer's process is never read


def test_a_remote_peer_counts_only_by_its_silent_heartbeat() -> None:
    peers = [PeerBeat(1, 99.0, host="hostB", pid=11, start="5"), PeerBeat(3, 96.5, host="hostB")]
    why, calls = _rule(peers, exited=frozenset({11}))
    assert why == "rank 3 has not sent a heartbeat for 3.5 s" and calls == []


def test_a_silent_store_comes_before_silent_peers() -> None:
    peers = [PeerBeat(1, 90.0, host="hostB")]
    why, _ = _rule(peers, store_silent_s=3.5)
    assert why == "the store has not answered for 3.5 s (its host is gone)"
    assert _rule(peers, store_silent_s=3.0)[0] == "rank 1 has not sent a heartbeat for 10.0 s"


def test_a_peer_that_finished_cleanly_never_counts() -> None:
    peers = [PeerBeat(1, 50.0, host=HERE, pid=11, start="5", done=True)]
    assert _rule(peers, exited=frozenset({11})) == (None, [])


def test_a_peer_never_seen_counts_only_once_silent() -> None:
    assert _rule([PeerBeat(1, 97.5)]) == (None, [])
    assert _rule([PeerBeat(1, 96.0)])[0] == "rank 1 has not sent a heartbeat for 4.0 s"


def test_has_exited_reads_a_killed_process_its_zombie_and_a_reused_pid() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = absence.start_time(proc.pid)
        assert start is not None
        assert not absence.has_exited(proc.pid, start)
        assert absence.has_exited(proc.pid, str(int(start) + 1))  # the pid is another process
        os.kill(proc.pid, signal.SIGKILL)
        while absence.proc_state(proc.pid) != "Z":  # not reaped yet: a zombie
            time.sleep(0.01)
        assert absence.has_exited(proc.pid, start)
        proc.wait()
        assert absence.proc_state(proc.pid) == "" and absence.has_exited(proc.pid, start)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
