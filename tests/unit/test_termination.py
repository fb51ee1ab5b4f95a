"""SIGTERM handling: without an agreed flush the process still dies of the signal, after
the grace period (a crashed peer's group restart must not wait for torchrun's 30 s kill)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import os, signal, time
from baft.liveness.termination import Termination
t = Termination(grace_s=0.3).install()
{setup}
os.kill(os.getpid(), signal.SIGTERM)
assert t.requested
{body}
time.sleep(20)
print("survived")
"""


def _run(body: str, setup: str = "") -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(body=body, setup=setup)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=15)


def test_no_agreed_flush_dies_of_sigterm_after_the_grace() -> None:
    r = _run("")
    assert r.returncode == 128 + 15, r.stderr
    assert "survived" not in r.stdout
    assert "no agreed flush within 0.3 s" in r.stderr


def test_an_agreed_flush_cancels_the_grace() -> None:
    r = _run("t.flushing(); time.sleep(0.8); print('flushed'); raise SystemExit(0)")
    assert r.returncode == 0, r.stderr
    assert "flushed" in r.stdout


def test_a_peer_that_cannot_vote_ends_the_wait_at_once() -> None:
    """torchrun stops the survivors of a SIGKILLed rank: the dead rank never votes, so
    the process dies of the SIGTERM when the watchdog says so, not after the grace."""
    r = _run(
        "",
        setup="t.absent = lambda: 'rank 1 has exited (pid 7 on this host)'; t.grace_s = 60.0",
    )
    assert r.returncode == 128 + 15, r.stderr
    assert "survived" not in r.stdout
    assert (
        "SIGTERM: rank 1 has exited (pid 7 on this host), so no flush can be agreed: exiting "
        "without the grace" in r.stderr
    )


def test_an_agreed_flush_is_not_cut_short_by_a_peer_leaving_later() -> None:
    """Once this rank flushes, the watch is over: a peer done flushing first and gone is
    no reason to stop this rank's flush."""
    r = _run(
        "t.flushing(); gone.append(1); time.sleep(0.5); print('flushed'); raise SystemExit(0)",
        setup="gone = []; t.absent = lambda: 'rank 1 has exited' if gone else None",
    )
    assert r.returncode == 0, r.stderr
    assert "flushed" in r.stdout and "no flush can be agreed" not in r.stderr


def test_leaving_on_an_error_after_sigterm_skips_the_finalization() -> None:
    """An error ends training after the SIGTERM (the collective the dead rank broke): the
    process dies of the signal at exit instead of finalizing for seconds."""
    r = _run("raise RuntimeError('Connection closed by peer')")
    assert r.returncode == 128 + 15, r.stderr
    assert "RuntimeError: Connection closed by peer" in r.stderr
    assert "leaving without an agreed flush (training ended by an error)" in r.stderr
