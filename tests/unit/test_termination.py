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
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


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


LOADER = r"""
import os, signal, subprocess, sys, time
import torch
from baft.liveness.termination import Termination
os.setpgid(0, 0)  # a group of our own, as torchrun gives each worker
t = Termination(grace_s=5.0).install()
t.absent = lambda: None

class Items(torch.utils.data.Dataset):
    def __len__(self): return 1000
    def __getitem__(self, i): return torch.tensor([i])

it = iter(torch.utils.data.DataLoader(Items(), num_workers=2, persistent_workers=True,
                                      batch_size=None))
first = int(next(it))
# torchrun's stop: killpg(SIGTERM) from another process reaches the workers too
subprocess.run([sys.executable, "-c", f"import os, signal; os.killpg({os.getpid()}, 15)"])
time.sleep(0.5)
served = [int(next(it)) for _ in range(6)]
print("served", first, served, t.requested, flush=True)
t.flushing()
"""


def test_dataloader_workers_serve_through_a_preemption_sigterm_and_end_with_the_process() -> None:
    """torchrun's killpg reaches DataLoader workers, which die of it in torch (and the
    training thread raises before the flush): forked after baft's handler, they serve on
    until the flush is done; the process still exits at once with its iterator alive
    (multiprocessing's exit terminates them: a SIGTERM from their parent)."""
    r = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "served 0 [1, 2, 3, 4, 5, 6] True" in r.stdout, (r.stdout, r.stderr)


HOLD = r"""
import multiprocessing, os, signal, time
import baft.liveness.termination as term
from baft.config import InprocessTimeouts
from baft.inprocess.channel import Channel
from baft.liveness import generation
from baft.liveness.generation import Generation
parent, child = multiprocessing.Pipe()
timeouts = InprocessTimeouts(hold_sigterm_s={hold})
ch = Channel(child, Generation(0, 1), rank=0, timeouts=timeouts, on_lost=lambda: None)
generation.install(ch)
ch.hold_sigterm()  # baft.run, under a supervisor
os.kill(os.getpid(), signal.SIGTERM)  # between two engines (an in-process recovery)
time.sleep(0.2)
print("held", flush=True)
{body}
time.sleep(5)
print("survived", flush=True)
"""


def _hold(body: str, hold: float = 1.0) -> subprocess.CompletedProcess[str]:
    code = HOLD.format(body=body, hold=hold)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_held_sigterm_is_taken_over_by_the_next_engine() -> None:
    r = _hold(
        "t = term.Termination(grace_s=60.0).install(); t.absent = lambda: None\n"
        "print('requested', t.requested, flush=True); t.flushing(); raise SystemExit(0)"
    )
    assert r.returncode == 0, r.stderr
    assert "held\nrequested True" in r.stdout


def test_a_held_sigterm_no_engine_takes_dies_after_the_hold() -> None:
    r = _hold("")
    assert r.returncode == 128 + 15, r.stderr
    assert "held" in r.stdout and "survived" not in r.stdout
    assert "no engine took the held SIGTERM over within 1 s" in r.stderr


def test_an_unflushed_sigterm_is_held_again_when_its_engine_is_abandoned() -> None:
    """A recovery abandons the engine that had the SIGTERM: the next one flushes it."""
    r = _hold(
        "a = term.Termination(grace_s=60.0).install(); a.absent = lambda: None\n"
        "a.uninstall()\n"
        "b = term.Termination(grace_s=60.0).install(); b.absent = lambda: None\n"
        "print('again', b.requested, flush=True); b.flushing(); raise SystemExit(0)"
    )
    assert r.returncode == 0, r.stderr
    assert "again True" in r.stdout
