"""Declared failure domains vs detected shared memory (issue 28, bug 4).

``memory_domains`` is pure: which ranks' stores share memory (read in place by the
same-host exchange and the recovery inventory), from each rank's detected host and store
root; the declared nodes stay the failure domains. ``find_same_host_peers`` is its
collective shell: peers only within a location, one log line on rank 0.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from baft.engine.local_transport import LocalTransport
from baft.engine.peers import find_same_host_peers
from baft.topology import Topology, _listed, memory_domains

T4 = Topology(num_dp=4, ranks_per_node=2)


def test_one_machine_one_root_is_one_memory() -> None:
    """The single-machine simulation (one agent, simulated nodes in one root): every
    store is read in place, nothing to warn about."""
    got = memory_domains(T4, [("m", "/r")] * 4)
    assert got.locations == ("m", "m", "m", "m")
    assert got.reason == (
        "failure domains: 2 declared node(s) of 2 rank(s) (ranks_per_node) place the "
        "redundancy; detected 1 host(s); stores shared in place within: m: ranks 0-3 "
        "(nodes 0-1)"
    )
    assert got.warning == ""


def test_one_machine_two_store_roots_are_two_memories() -> None:
    """Two agents on one machine without BAFT_HOST_ID, a store root each: the detected
    host is the same, but each root is its own memory (as BAFT_HOST_ID per agent would
    say), so nobody reads the other root's stores as its own."""
    got = memory_domains(T4, [("m", "/a"), ("m", "/a"), ("m", "/b"), ("m", "/b")])
    assert got.locations == ("m@/a", "m@/a", "m@/b", "m@/b")
    assert got.reason == (
        "failure domains: 2 declared node(s) of 2 rank(s) (ranks_per_node) place the "
        "redundancy; detected 1 host(s), m with several store roots, each its own memory; "
        "stores shared in place within: m@/a: ranks 0-1 (node 0); m@/b: ranks 2-3 (node 1)"
    )
    assert got.warning == ""


def test_hosts_with_one_root_each_keep_their_names() -> None:
    got = memory_domains(T4, [("a", "/r"), ("a", "/r"), ("b", "/r"), ("b", "/r")])
    assert got.locations == ("a", "a", "b", "b")
    assert got.warning == ""


def test_a_declared_node_split_over_hosts_is_honoured_quietly() -> None:
    """Declared nodes of 4 ranks over hosts of 2: a host loss is part of one declared
    node's loss, which the redundancy survives."""
    topo = Topology(num_dp=8, ranks_per_node=4)
    got = memory_domains(topo, [(h, "/r") for h in "aabbccdd"])
    assert got.locations == tuple("aabbccdd")
    assert got.reason.endswith(
        "detected 4 host(s); stores shared in place within: a: ranks 0-1 (node 0); "
        "b: ranks 2-3 (node 0); c: ranks 4-5 (node 1); d: ranks 6-7 (node 1)"
    )
    assert got.warning == ""


def test_a_host_holding_several_declared_nodes_of_a_multi_host_job_warns() -> None:
    """Two hosts of 4 ranks with the default ranks_per_node=2: a host loss takes two
    declared nodes; the placement still follows them, the log says how to fix it."""
    topo = Topology(num_dp=8, ranks_per_node=2)
    got = memory_domains(topo, [(h, "/r") for h in "aaaabbbb"])
    assert got.locations == tuple("aaaabbbb")
    assert got.warning == (
        "host a runs ranks 0-3 of declared nodes 0-1: losing that host loses 2 failure "
        "domains at once, more than the redundancy may survive; set ranks_per_node to the "
        "number of ranks per host (or a multiple of it)"
    )


def test_listed() -> None:
    assert _listed([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _listed([3]) == "3"


def _each_rank(roots: list[Path], enabled: bool) -> list[Any]:
    transports = LocalTransport.group(len(roots), timeout_s=5.0)
    out: list[Any] = [None] * len(roots)

    def run(r: int) -> None:
        store = roots[r] / "job" / f"node{r // 2}" / f"rank{r}"
        loc, peers = find_same_host_peers(
            transports[r], store, roots[r], T4, enabled=enabled, host="m"
        )
        out[r] = (loc, {p: str(s.path) for p, s in peers.items()})

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(roots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    return out


@pytest.mark.parametrize("enabled", [True, False])
def test_same_host_peers_share_a_store_root(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, enabled: bool
) -> None:
    """One detected host, two store roots: the same-host exchange pairs only ranks of
    one root (on main every rank of the host was a peer, reading across roots)."""
    caplog.set_level(logging.INFO, logger="baft")
    a, b = tmp_path / "a", tmp_path / "b"
    got = _each_rank([a, a, b, b], enabled)
    assert [loc for loc, _ in got] == [f"m@{a}", f"m@{a}", f"m@{b}", f"m@{b}"]
    want = [
        {1: f"{a}/job/node0/rank1"},
        {0: f"{a}/job/node0/rank0"},
        {3: f"{b}/job/node1/rank3"},
        {2: f"{b}/job/node1/rank2"},
    ]
    assert [peers for _, peers in got] == (want if enabled else [{}] * 4)
    (rec,) = [r for r in caplog.records if r.name == "baft"]  # once, by rank 0
    assert rec.getMessage().endswith(
        f"stores shared in place within: m@{a}: ranks 0-1 (node 0); m@{b}: ranks 2-3 (node 1)"
    )
