"""SIGTERM handling: without an agreed flush the process still dies of the signal, after
the grace period (a crashed peer's group restart must not wait for torchrun's 30 s kill)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import os, signal, time
from baft.liveness.termination import Termination
t = Termination(grace_s=0.3).install()
os.kill(os.getpid(), signal.SIGTERM)
assert t.requested
{body}
time.sleep(20)
print("survived")
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(body=body)
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
