"""In-process recovery's pieces without processes: the give-up policy, the control store
(one TCPStore in this process), the child's channel and the socket abort."""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from baft.config import InprocessTimeouts
from baft.inprocess import messages as msg
from baft.inprocess.channel import Channel
from baft.inprocess.control import Control
from baft.inprocess.policy import Ledger, must_replace, silent_peers
from baft.inprocess.run import abandon_generation
from baft.inprocess.sockets import shutdown_tcp, tcp_inodes
from baft.liveness import generation as link
from baft.liveness.generation import Generation, recovery_phases


@pytest.fixture
def piped(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Channel]]:
    """A channel installed as this process's, and the supervisor's end of its pipe; the
    environment it sets on ``enter()`` is put back afterwards."""
    monkeypatch.setenv(link.GENERATION_ENV, "0")  # restored (or removed) at the end
    monkeypatch.setenv("MASTER_PORT", "1234")
    parent, child = multiprocessing.Pipe()
    timeouts = InprocessTimeouts(stuck_s=0.2)
    ch = Channel(child, Generation(0, 1234), rank=2, timeouts=timeouts, on_lost=lambda: None)
    link.install(ch)
    yield parent, ch
    link.install(None)
    parent.close()


def test_ledger_gives_up_on_a_failure_during_a_recovery() -> None:
    led = Ledger(max_failures=3)
    assert led.failure(0) is None  # the first failure: recover in-process
    led.progress(1)
    assert led.failure(1) is None  # generation 1 had completed an iteration
    reason = led.failure(2)  # generation 2 never did: a failure during its recovery
    assert reason is not None and "in generation 2 before its first iteration" in reason


def test_ledger_gives_up_after_max_failures() -> None:
    led = Ledger(max_failures=2)
    for g in range(3):
        led.progress(g)
    assert [led.failure(0), led.failure(1)] == [None, None]
    assert "3 failures of this rank (limit 2)" in str(led.failure(2))


def test_only_a_named_child_spawned_before_the_generation_is_replaced() -> None:
    assert must_replace(2, {2}, spawned_in=0, generation=1)
    assert not must_replace(2, {2}, spawned_in=1, generation=1)  # the replacement itself
    assert not must_replace(1, {2}, spawned_in=0, generation=1)
    assert silent_peers(10.0, {0: 9.0, 1: 2.0, 3: 4.9}, 5.0) == [1, 3]


def test_control_starts_one_generation_per_failure() -> None:
    c = Control("127.0.0.1", 0, rank=0, world_size=1, timeout_s=5.0)
    assert c.generation() == 0
    assert c.begin(0, "rank 1 died") == 1
    assert c.begin(0, "rank 2 saw it too", kill=[3]) == 1  # the same failure: still 1
    assert c.generation() == 1
    cause, at = c.describe(1)
    assert cause == "rank 1 died; rank 2 saw it too" and at > 0
    assert c.kill_list(1) == {3} and c.kill_list(2) == set()
    port = c.host_generation(1)
    assert c.port(1) == port and c.port(2) is None
    assert c.given_up() is None
    c.give_up("first")
    c.give_up("second")
    assert c.given_up() == "first"
    assert c.refused() is None  # giving up is not refusing
    c.refuse("rank 0: ValueError: bad layout")
    c.refuse("rank 1: ValueError: bad layout")
    assert c.refused() == "rank 0: ValueError: bad layout"
    assert not c.job_ended()
    c.ended()
    assert c.job_ended()
    alone = Control("127.0.0.1", 0, rank=0, world_size=1, timeout_s=5.0)
    alone.refuse("rank 2: ValueError: x")  # the one key the supervisors poll says stop
    assert alone.given_up() == "refused: rank 2: ValueError: x"
    assert alone.refused() == "rank 2: ValueError: x"


def test_control_reads_every_peer_heartbeat_in_one_call() -> None:
    """Peers that have not beaten yet are absent; one that finished reads ``done``; the
    whole table is one ``multi_get`` (not a ``check`` per peer)."""
    c0 = Control("127.0.0.1", 0, rank=0, world_size=3, timeout_s=5.0)
    assert c0.beats() == {}  # nobody beat yet
    c0.beat(1)
    c2 = Control("127.0.0.1", c0.listen_port, rank=2, world_size=3, timeout_s=5.0)
    assert c2.beats() == {0: b"1"}
    c2.finished()
    calls: list[str] = []
    real = c0.store

    class Counting:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(real, name)

    c0.store = Counting()
    assert c0.beats() == {2: b"done"}
    assert calls == ["multi_get"]


def _tcp_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    return server, client, peer


def test_shutdown_tcp_unblocks_a_reader_and_spares_the_snapshot() -> None:
    old_server, old_client, old_peer = _tcp_pair()
    keep = tcp_inodes()
    server, client, peer = _tcp_pair()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(client.recv(10)))
    reader.start()
    time.sleep(0.05)
    assert shutdown_tcp(keep) == 2  # the new pair's two ends (both in this process)
    reader.join(5.0)
    assert got == [b""]  # the blocked recv returned (end of stream)
    old_peer.sendall(b"x")
    assert old_client.recv(1) == b"x"  # what existed before is untouched
    for s in (old_server, old_client, old_peer, server, client, peer):
        s.close()


def test_channel_takes_a_generation_and_reports_up(piped: tuple[Any, Channel]) -> None:
    parent, ch = piped
    ch.progress()
    ch.progress()  # once per generation
    ch.failed("boom")
    ch.suspect([3, 1], "silent")
    assert [parent.recv() for _ in range(3)] == [
        msg.Progress(0), msg.Failed(0, "boom"), msg.Suspect(0, (1, 3), "silent"),
    ]  # fmt: skip
    assert not parent.poll(0.05)
    parent.send(msg.Announce(Generation(1, 5678, "rank 1 died", 100.0)))
    assert ch.wait_for_generation(5.0)
    gen = ch.enter()
    assert gen == Generation(1, 5678, "rank 1 died", 100.0)
    assert parent.recv() == msg.Entered(1)
    assert os.environ["MASTER_PORT"] == "5678" and link.number() == 1
    assert link.describe() == {"generation": 1, "cause": "rank 1 died", "replacement": False}
    assert recovery_phases(99.5, t_launch=100.25) == {"detect": 0.5, "abort": 0.25}


@pytest.mark.parametrize("fault_at", [None])
def test_no_phases_without_a_supervisor(fault_at: float | None) -> None:
    assert recovery_phases(fault_at, 1.0) == {} and link.describe() == {}


def test_a_connection_opened_before_entering_the_new_generation_is_shut_too(
    piped: tuple[Any, Channel],
) -> None:
    """A rank still entering the old generation's rendezvous when the next one is announced
    must not wait there: until ``enter()``, every new TCP connection is shut down."""
    parent, ch = piped
    parent.send(msg.Announce(Generation(1, 2, "x", 1.0)))
    assert ch.wait_for_generation(5.0)
    server, client, peer = _tcp_pair()  # opened after the abort, before enter()
    client.settimeout(5.0)
    assert client.recv(1) == b""  # shut down by the channel's reader
    ch.enter()
    time.sleep(0.2)
    server2, client2, peer2 = _tcp_pair()  # the new generation's: left alone
    peer2.sendall(b"y")
    client2.settimeout(5.0)
    assert client2.recv(1) == b"y"
    for s in (server, client, peer, server2, client2, peer2):
        s.close()


def test_waits_off_sockets_give_up_once_a_generation_is_announced(
    piped: tuple[Any, Channel],
) -> None:
    """A same-host shared-memory wait has no socket to shut down: it asks the channel."""
    parent, ch = piped
    link.check_aborted()  # nothing announced: goes on
    parent.send(msg.Announce(Generation(1, 2, "rank 1 died", 1.0)))
    assert ch.wait_for_generation(5.0)
    with pytest.raises(link.GenerationAborted, match="generation 1 began"):
        link.check_aborted()
    ch.enter()
    link.check_aborted()  # in the new generation: goes on


def test_a_training_thread_that_does_not_take_a_generation_is_reported_stuck(
    piped: tuple[Any, Channel],
) -> None:
    """A main thread hung off any socket (a sleep, a deadlock) never takes the announced
    generation: after ``stuck_s`` (0.2 s here) the channel says so, once, for its
    supervisor to replace."""
    parent, ch = piped
    parent.send(msg.Announce(Generation(1, 2, "rank 0 timed out", 1.0)))
    assert parent.poll(5.0)
    assert parent.recv() == msg.Stuck(1)
    assert not parent.poll(0.5)  # once
    ch.enter()
    assert parent.recv() == msg.Entered(1)


def test_connections_opened_before_run_survive_an_abort(piped: tuple[Any, Channel]) -> None:
    """A module-level client (opened after the channel, before the training function)
    is kept through every abort; what the training function opens is not."""
    parent, ch = piped
    module = _tcp_pair()  # the script's module level
    ch.keep_connections()  # baft.run, before the training function
    gen_pair = _tcp_pair()  # the training function's
    parent.send(msg.Announce(Generation(1, 2, "rank 1 died", 1.0)))
    assert ch.wait_for_generation(5.0)
    ch.enter()
    server, client, peer = gen_pair
    client.settimeout(5.0)
    assert client.recv(1) == b""  # shut down
    server, client, peer = module
    peer.sendall(b"m")
    client.settimeout(5.0)
    assert client.recv(1) == b"m"
    for s in (*module, *gen_pair):
        s.close()


def test_the_nccl_abort_gets_the_settings_torch_asks_for_unless_the_user_set_them() -> None:
    from baft.inprocess.child import NCCL_ENV, nccl_env

    assert nccl_env({}) == (NCCL_ENV, [])
    assert NCCL_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # _abort_process_group's note
    to_set, conflicts = nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_NVLS_ENABLE": "0"})
    assert to_set == {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
    assert conflicts == ["TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (in-process recovery needs 0)"]


def test_inprocess_timeouts_come_from_the_environment() -> None:
    assert InprocessTimeouts.from_env({}) == InprocessTimeouts()
    t = InprocessTimeouts.from_env({"BAFT_INPROCESS_STUCK_S": "3", "BAFT_INPROCESS_STORE_S": "9"})
    assert (t.stuck_s, t.store_s, t.peer_silence_s) == (3.0, 9.0, 5.0)
    with pytest.raises(ValueError, match="BAFT_INPROCESS_STUCK_S='soon': expected seconds"):
        InprocessTimeouts.from_env({"BAFT_INPROCESS_STUCK_S": "soon"})
    with pytest.raises(ValueError, match="must be > 0"):
        InprocessTimeouts.from_env({"BAFT_INPROCESS_ABORT_WAIT_S": "0"})


class _Member:
    abandoned: list[int] = []

    def abandon(self) -> None:
        _Member.abandoned.append(id(self))


def test_a_member_nothing_else_holds_is_still_abandoned(piped: tuple[Any, Channel]) -> None:
    """When the training function raised, its frames (the only holders of ``ft``) are
    gone before the abort: the generation must still reach its member, or the member's
    watchdog beats on into the next generation and names a healthy replacement frozen."""
    parent, ch = piped
    _Member.abandoned.clear()
    link.join(_Member())  # no other reference
    gc.collect()
    assert len(link.members()) == 1
    abandon_generation(ch)
    assert len(_Member.abandoned) == 1 and link.members() == []


def test_without_a_supervisor_nothing_joins_a_generation() -> None:
    link.join(_Member())
    assert link.members() == []
