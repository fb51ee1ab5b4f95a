"""In-process shrink of an elastic job: the verdict on lost peers (pure), the world the
control store hands every supervisor, and the environment a survivor re-enters with."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from baft.config import dp_degree
from baft.inprocess import messages as msg
from baft.inprocess.channel import Channel
from baft.inprocess.control import Control
from baft.inprocess.policy import (
    Elastic,
    LostPeers,
    Silence,
    Verdict,
    shrunk_world,
    world_env,
)
from baft.liveness.generation import GENERATION_ENV, Generation

HOSTS = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}  # three hosts of two ranks
PP2 = Elastic(num_replicas=3, model_ranks=2)  # pp=2, 3 replicas: dp 3 on 6 ranks


def test_whole_lost_hosts_shrink_an_elastic_job_to_the_ranks_left() -> None:
    members = tuple(range(6))
    assert shrunk_world(members, HOSTS, [4, 5], PP2) == (None, (
        "4 ranks cannot hold a copy of every stage (2 ranks each) with a DP degree "
        "dividing 3 replicas"
    ))  # fmt: skip
    six = Elastic(num_replicas=6, model_ranks=2)
    assert shrunk_world(members, HOSTS, [2, 3], six) == ((0, 1, 4, 5), "")
    assert shrunk_world(members, HOSTS, [2, 3, 4, 5], six) == ((0, 1), "")
    assert shrunk_world(members, HOSTS, [3], six) == (
        None,
        "host(s) [1] lost only some of their ranks",
    )
    assert shrunk_world(members, HOSTS, [2, 3], None)[0] is None  # no elastic replicas
    assert dp_degree(6, 4, 2) == 2 and dp_degree(3, 4, 2) is None


def test_a_survivor_takes_the_rank_and_host_torchrun_would_give_it() -> None:
    world = (0, 1, 4, 5)  # host 1 lost: host 2 becomes the second host
    assert world_env(world, HOSTS, 4) == {
        "RANK": "2", "ROLE_RANK": "2", "WORLD_SIZE": "4", "ROLE_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
    }  # fmt: skip
    assert world_env(world, HOSTS, 1)["RANK"] == "1"


def test_a_partly_lost_host_is_given_the_grace_then_the_group_restarts() -> None:
    lost = LostPeers(grace_s=1.0, elastic=Elastic(6, 2))
    members = tuple(range(6))
    lost.ended([2], now=10.0)
    assert lost.verdict(members, set(), HOSTS, now=10.5) is None  # rank 3 may follow
    lost.ended([3], now=10.6)
    assert lost.verdict(members, set(), HOSTS, now=10.6) == Verdict((2, 3), (0, 1, 4, 5), "", (1,))
    assert lost.gone == set() and lost.since is None
    lost.ended([4], now=20.0)  # one supervisor of host 2 killed alone: no shrink
    assert lost.verdict(members, set(), HOSTS, now=20.9) is None
    verdict = lost.verdict(members, set(), HOSTS, now=21.0)
    assert verdict is not None and verdict.world is None and "only some" in verdict.why_not
    lost.ended([5], now=30.0)  # a peer that finished ends its lease: nothing lost
    assert lost.verdict(members, {5}, HOSTS, now=30.0) is None and not lost.gone
    lost.ended([5], now=31.0)  # hosts unknown: give up at once
    unknown = lost.verdict(members, set(), None, now=31.0)
    assert unknown is not None and unknown.world is None and unknown.hosts == ()


def _eventually(read: Callable[[], Any], want: Any, within_s: float = 5.0) -> Any:
    """``read()`` once it returns ``want`` (or at the deadline): a value another client
    connection set reaches the store in that connection's order, not this one's."""
    deadline = time.monotonic() + within_s
    got = read()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.01)
        got = read()
    return got


def test_the_control_store_hands_the_shrunk_world_to_every_supervisor() -> None:
    c0 = Control("127.0.0.1", 0, rank=0, world_size=4, timeout_s=5.0)
    c3 = Control("127.0.0.1", c0.listen_port, rank=3, world_size=4, timeout_s=5.0)
    assert c0.hosts() is None  # not every rank published its host yet
    c1 = Control("127.0.0.1", c0.listen_port, rank=1, world_size=4, timeout_s=5.0)
    c2 = Control("127.0.0.1", c0.listen_port, rank=2, world_size=4, timeout_s=5.0)
    for c, h in [(c0, 0), (c1, 0), (c2, 1), (c3, 1)]:
        c.publish_host(h)
    assert _eventually(c0.hosts, {0: 0, 1: 0, 2: 1, 3: 1}) == {0: 0, 1: 0, 2: 1, 3: 1}
    c0.host_generation(0)
    assert c0.hosted == 0 and c3.world(0) is None
    c0.shrink(1, {0: 0, 1: 0})
    assert _eventually(lambda: c3.world(1), {0: 0, 1: 0}) == {0: 0, 1: 0}
    assert c3.world(0) is None and c3.world(5) == {0: 0, 1: 0}
    c0.members = (0, 1)
    c0.beat(1)
    c3.beat(7)  # a lost rank's stale beat is no member's
    assert c0.beats() == {}
    c1.members = (0, 1)
    assert _eventually(c1.beats, {0: b"1"}) == {0: b"1"}


@pytest.fixture
def piped(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Channel]]:
    """A channel and the supervisor's end of its pipe; the environment it sets on
    ``enter()`` is put back afterwards."""
    for name, value in [("RANK", "4"), ("WORLD_SIZE", "6"), ("GROUP_RANK", "2")]:
        monkeypatch.setenv(name, value)
    for name in ("MASTER_PORT", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", GENERATION_ENV):
        monkeypatch.setenv(name, "0")
    parent, child = multiprocessing.Pipe()
    ch = Channel(child, Generation(0, 1234), rank=4, on_lost=lambda: None)
    yield parent, ch
    parent.close()


def test_a_survivor_re_enters_with_its_new_rank_and_world(piped: Any) -> None:
    parent, ch = piped
    ch.elastic(6, 2)
    assert parent.recv() == Elastic(6, 2)
    env = tuple(world_env((0, 1, 4, 5), HOSTS, 4).items())
    parent.send(msg.Announce(Generation(1, 5678, "host(s) [1] lost", 1.0, env)))
    assert ch.wait_for_generation(5.0)
    ch.enter()
    assert parent.recv() == msg.Entered(1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == (
        "2",
        "4",
        "5678",
    )
    assert os.environ["GROUP_RANK"] == "1" and ch.rank == 2


def test_a_peer_leaves_a_silence_to_rank_0_unless_rank_0_is_silent_or_undecided() -> None:
    s = Silence(limit_s=5.0)
    assert s.why_give_up([2, 3], now=100.0) is None  # rank 0 shrinks or gives up
    assert s.why_give_up([2, 3], now=104.9) is None
    assert s.why_give_up([2, 3], now=105.1) == (
        "the supervisors of ranks [2, 3] are silent (host lost?), and rank 0 decided nothing in 5 s"
    )
    assert s.why_give_up([], now=106.0) is None and s.since is None  # the world moved on
    assert s.why_give_up([3], now=107.0) is None and s.since == 107.0
    assert s.why_give_up([0, 1], now=107.1) == (
        "the supervisors of ranks [0, 1] are silent (host lost?)"  # rank 0's host: no verdict
    )


def test_silent_hosts_count_as_lost_like_ended_leases() -> None:
    """Rank 0 feeds silent peers to the same verdict as ended leases: a frozen whole
    host shrinks an elastic job; a frozen part of a host waits the grace, then gives up."""
    lost = LostPeers(grace_s=1.0, elastic=Elastic(6, 2))
    members = tuple(range(6))
    lost.ended([4, 5], now=50.0)  # both of host 2's supervisors fell silent
    assert lost.verdict(members, set(), HOSTS, now=50.0) == Verdict((4, 5), (0, 1, 2, 3), "", (2,))
    lost.ended([5], now=60.0)
    assert lost.verdict(members, set(), HOSTS, now=60.5) is None
    got = lost.verdict(members, set(), HOSTS, now=61.1)
    assert got is not None and got.world is None and got.lost == (5,)
