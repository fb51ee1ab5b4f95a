"""Leases (:mod:`baft.inprocess.lease`): rank 0's supervisor sees a peer supervisor's
death as end-of-file on its connection, at once, over real sockets and a real kill -9."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time

import pytest

from baft.inprocess.lease import LeaseServer, hold_lease, serve_leases


def _poll_until(server: LeaseServer, held: set[int], timeout_s: float = 10.0) -> list[int]:
    """Every rank ``poll`` named gone, polling until the held leases are ``held``."""
    deadline = time.monotonic() + timeout_s
    gone = server.poll()
    while server.held() != held and time.monotonic() < deadline:
        time.sleep(0.01)
        gone += server.poll()
    return gone


def test_a_closed_lease_names_its_rank_once() -> None:
    server = LeaseServer()
    try:
        a = hold_lease("127.0.0.1", server.port, 1)
        b = hold_lease("127.0.0.1", server.port, 2)
        assert a is not None and b is not None
        assert _poll_until(server, {1, 2}) == []
        b.close()
        assert _poll_until(server, {1}) == [2]
        assert server.held() == {1} and server.poll() == []
        a.close()
    finally:
        server.close()


def test_a_connection_that_names_no_rank_is_no_lease() -> None:
    server = LeaseServer()
    try:
        junk = socket.create_connection(("127.0.0.1", server.port))
        junk.sendall(b"hello\n")
        time.sleep(0.05)
        assert server.poll() == [] and server.held() == set()
        junk.close()
    finally:
        server.close()


def test_a_killed_process_ends_its_lease() -> None:
    server = LeaseServer()
    code = (
        "import sys, time\n"
        "from baft.inprocess.lease import hold_lease\n"
        f"s = hold_lease('127.0.0.1', {server.port}, 3)\n"
        "print('held', s is not None, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held True"
        assert _poll_until(server, {3}) == []
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _poll_until(server, set()) == [3]
    finally:
        proc.kill()
        server.close()


def test_no_listener_means_no_lease_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: the connection is refused
        with caplog.at_level(logging.WARNING, logger="baft"):
            assert hold_lease("127.0.0.1", port, 1) is None
    assert "found by heartbeat silence only" in caplog.text


def test_a_listener_that_failed_is_port_zero_and_no_lease(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no address")

    monkeypatch.setattr(socket, "create_server", refuse)
    with caplog.at_level(logging.WARNING, logger="baft"):
        assert serve_leases() is None
    assert "no lease listener (no address)" in caplog.text
    assert hold_lease("127.0.0.1", 0, 1) is None  # what a peer is told: no connection tried
