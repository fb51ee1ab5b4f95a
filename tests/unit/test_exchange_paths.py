"""Redundancy exchange, in process: the same-host path (pull from a peer's store) and the
network path (the transport) give identical redundancy bytes and checksums, for every code;
a failed peer makes the holder fail, never complete."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from baft.engine.local_transport import LocalTransport, PeerFailed
from baft.engine.redundancy import PeerStoreGone, RedundancyExchange
from baft.store.coding import Redundancy, group_layouts
from baft.store.manifest import checksum
from baft.store.peer import PeerStore
from baft.store.shm import SnapshotStore
from baft.topology import Topology

PIECE = 4096


class _Recording:
    """A background that runs each item at once (on the submitting thread) and remembers
    which threads ran how many."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def submit(self, item: Callable[[], None]) -> None:
        self.ran.append(threading.current_thread().name)
        item()

    def drain(self) -> None:
        pass


def _run_group(
    tmp: Path,
    code: str,
    world: int,
    same_host: set[int],
    sizes: list[int],
    seed: int = 0,
    background: list[_Recording] | None = None,
) -> tuple[list[np.ndarray], list[dict[int, int]], list[RedundancyExchange]]:
    """One version through every rank's exchange (one thread per rank). Ranks in
    ``same_host`` read each other's stores; all others use the transport."""
    topo = Topology(num_dp=world, ranks_per_node=1)
    red = Redundancy.parse(code)
    layouts = group_layouts(topo, red, dict(enumerate(sizes)))
    rng = np.random.default_rng(seed)
    stores = []
    for r in range(world):
        (tmp / "root").mkdir(parents=True, exist_ok=True)
        s = SnapshotStore(tmp / "root", "job", r, r, 1 << 30)
        s.allocate(sizes[r], layouts[r].redundancy_nbytes(r))
        stores.append(s)
    transports = LocalTransport.group(world)
    exchanges = []
    for r in range(world):
        peers = (
            {q: PeerStore(stores[q].path, q) for q in same_host if q != r} if r in same_host else {}
        )
        bg = background[r] if background is not None else None
        exchanges.append(
            RedundancyExchange(layouts[r], r, transports[r], PIECE, peers=peers, background=bg)
        )
    version, slot = 7, 0
    for r in range(world):
        data = stores[r].data_view(slot)
        data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            ex = exchanges[r]
            data = torch.from_numpy(stores[r].data_view(slot))
            ex.begin(data, torch.from_numpy(stores[r].red_view(slot)), version)
            half = sizes[r] // 2  # progress in two steps, pulling in between
            stores[r].publish(version, slot, half)
            for p in ex.take_sends(half):
                ex.send_now(p)
            ex.pull_ready()
            stores[r].publish(version, slot, sizes[r])
            ex.finish()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    reds = [stores[r].red_view(slot).copy() for r in range(world)]
    expected = []
    for r in range(world):  # what every region must hold, encoded directly
        want = {}
        for region in layouts[r].regions(r):
            inputs = [
                stores[s.rank].data_view(slot)[s.offset : s.offset + s.nbytes]
                for s in region.sources
            ]
            out = layouts[r].encode(region.region_id, inputs)
            want[region.region_id] = out
            assert np.array_equal(reds[r][region.offset : region.offset + region.nbytes], out), (
                code,
                r,
                region.region_id,
            )
        expected.append(want)
    sums = [dict(ex.region_checksums) for ex in exchanges]
    for r, ex in enumerate(exchanges):
        for rid, digest in ex.region_checksums.items():
            assert digest == checksum(expected[r][rid]), (code, r, rid)
    for s in stores:
        s.close()
    return reds, sums, exchanges


@pytest.mark.parametrize(
    "code,world,sizes",
    [
        ("xor:2", 2, [40_000, 40_000]),
        ("replicate:1", 2, [33_000, 35_000]),
        ("replicate:2", 3, [33_000, 35_000, 30_000]),
        ("xor:3", 3, [30_000, 30_000, 29_000]),
        ("rs:2+1", 3, [20_000, 21_000, 20_500]),
        # empty segments (a rank with no bytes, or a shard split short): no piece carries
        # them, and encoding must still run (it raised KeyError in finish())
        ("rs:2+2", 4, [10_000, 0, 10_000, 5_000]),
        ("xor:2", 2, [40_000, 0]),
    ],
)
def test_same_host_and_network_paths_give_identical_redundancy(
    tmp_path: Path, code: str, world: int, sizes: list[int]
) -> None:
    everyone = set(range(world))
    net, _, net_ex = _run_group(tmp_path / "net", code, world, set(), sizes)
    shm, sums, shm_ex = _run_group(tmp_path / "shm", code, world, everyone, sizes)
    mixed, _, mixed_ex = _run_group(tmp_path / "mix", code, world, {0, 1}, sizes)
    for r in range(world):
        assert np.array_equal(net[r], shm[r]) and np.array_equal(net[r], mixed[r])
    # which path moved the bytes: all network, all same host, or both
    assert sum(e.bytes_pulled for e in net_ex) == 0
    assert sum(e.bytes_received for e in net_ex) > 0
    assert sum(e.bytes_sent + e.bytes_received for e in shm_ex) == 0
    moved = sum(e.paths()["shm"] for e in shm_ex)
    assert moved == sum(e.paths()["net"] for e in net_ex) > 0
    # every region checksum of the same-host path was computed on the way
    assert all(len(s) == len(e.regions) for s, e in zip(sums, shm_ex, strict=True))


@pytest.mark.parametrize(
    "code,world,sizes", [("xor:2", 2, [40_000, 37_000]), ("replicate:2", 3, [33_000] * 3)]
)
def test_network_receives_are_hashed_as_they_arrive_off_the_caller(
    tmp_path: Path, code: str, world: int, sizes: list[int]
) -> None:
    """With a background, every received replica region's checksum is ready at finish,
    hashed piece by piece on the receiving thread's submissions, not by a pass over the
    region at the optimizer step (a 68 MiB xxh3 on the training thread, per iteration)."""
    bgs = [_Recording() for _ in range(world)]
    plain, plain_sums, _ = _run_group(tmp_path / "a", code, world, set(), sizes)
    reds, sums, exs = _run_group(tmp_path / "b", code, world, set(), sizes, background=bgs)
    for r in range(world):
        assert np.array_equal(plain[r], reds[r])
        assert sums[r] == plain_sums[r] or not plain_sums[r]  # same digests when both known
        assert set(sums[r]) == set(exs[r].regions)  # every region known: none left to hash
        assert len(bgs[r].ran) == len(exs[r].recvs) > 0  # one hashing item per piece
        assert set(bgs[r].ran) == {"baft-recv"}


def test_receiver_thread_reports_a_dead_peer_at_finish(tmp_path: Path) -> None:
    topo = Topology(num_dp=2, ranks_per_node=1)
    layouts = group_layouts(topo, Redundancy.parse("xor:2"), {0: 4 * PIECE, 1: 4 * PIECE})
    transports = LocalTransport.group(2, timeout_s=5.0)
    ex = RedundancyExchange(layouts[0], 0, transports[0], PIECE, background=_Recording())
    red = torch.zeros(layouts[0].redundancy_nbytes(0), dtype=torch.uint8)
    ex.begin(torch.zeros(4 * PIECE, dtype=torch.uint8), red, 1)
    sender = RedundancyExchange(layouts[1], 1, transports[1], PIECE)
    sender.begin(torch.ones(4 * PIECE, dtype=torch.uint8), torch.zeros_like(red), 1)
    for p in sender.take_sends(PIECE):
        sender.send_now(p)
    transports[1].fail()
    with pytest.raises(PeerFailed, match="peer rank 1 failed"):
        ex.finish()
    assert ex.region_checksums == {}


def _xor2_stores(tmp: Path, nbytes: int) -> tuple[dict, list[SnapshotStore]]:
    """Two ranks on two simulated nodes under xor:2, each with an allocated store."""
    topo = Topology(num_dp=2, ranks_per_node=1)
    layouts = group_layouts(topo, Redundancy.parse("xor:2"), {0: nbytes, 1: nbytes})
    stores = [SnapshotStore(tmp, "job", r, r, 1 << 30) for r in range(2)]
    for r, s in enumerate(stores):
        s.allocate(nbytes, layouts[r].redundancy_nbytes(r))
    return layouts, stores


def test_same_host_pull_waits_for_published_progress(tmp_path: Path) -> None:
    """Bytes the sender has not published as final are never copied."""
    layouts, stores = _xor2_stores(tmp_path, 3 * PIECE)
    stores[1].data_view(0)[:] = 5
    ex = RedundancyExchange(
        layouts[0], 0, LocalTransport.group(2)[0], PIECE, peers={1: PeerStore(stores[1].path, 1)}
    )
    ex.begin(torch.from_numpy(stores[0].data_view(0)), torch.from_numpy(stores[0].red_view(0)), 3)
    assert ex.pull_ready() == 0  # nothing published yet
    stores[1].publish(2, 0, 3 * PIECE)  # another version: still nothing
    assert ex.pull_ready() == 0
    stores[1].publish(3, 0, PIECE + 1)  # one whole piece and a byte
    assert ex.pull_ready() == PIECE
    red = stores[0].red_view(0)
    assert (red[:PIECE] == 5).all() and (red[PIECE : 3 * PIECE] == 0).all()


def test_holder_fails_when_a_network_peer_dies_mid_transfer(tmp_path: Path) -> None:
    topo = Topology(num_dp=2, ranks_per_node=1)
    layouts = group_layouts(topo, Redundancy.parse("xor:2"), {0: 4 * PIECE, 1: 4 * PIECE})
    transports = LocalTransport.group(2, timeout_s=5.0)
    ex = RedundancyExchange(layouts[0], 0, transports[0], PIECE)
    data = torch.zeros(4 * PIECE, dtype=torch.uint8)
    red = torch.zeros(layouts[0].redundancy_nbytes(0), dtype=torch.uint8)
    ex.begin(data, red, 1)
    sender = RedundancyExchange(layouts[1], 1, transports[1], PIECE)
    sender.begin(torch.ones(4 * PIECE, dtype=torch.uint8), torch.zeros_like(red), 1)
    for p in sender.take_sends(PIECE):  # one piece arrives, then the sender dies
        sender.send_now(p)
    transports[1].fail()
    with pytest.raises(PeerFailed, match="peer rank 1 failed"):
        ex.finish()


def _holder_of_half_v4(tmp: Path, timeout_s: float) -> tuple[RedundancyExchange, list]:
    """Rank 0 holding v4's redundancy of its same-host sender, rank 1, which has published
    half of its shard as final."""
    layouts, stores = _xor2_stores(tmp, 2 * PIECE)
    ex = RedundancyExchange(
        layouts[0],
        0,
        LocalTransport.group(2)[0],
        PIECE,
        peers={1: PeerStore(stores[1].path, 1)},
        timeout_s=timeout_s,
    )
    ex.begin(torch.from_numpy(stores[0].data_view(0)), torch.from_numpy(stores[0].red_view(0)), 4)
    stores[1].publish(4, 0, PIECE)
    return ex, stores


def test_holder_times_out_when_a_same_host_peer_stops(tmp_path: Path) -> None:
    ex, _ = _holder_of_half_v4(tmp_path, timeout_s=0.05)  # half done, then frozen
    with pytest.raises(TimeoutError, match=r"same-host peers \[1\] did not finish v4"):
        ex.finish()
    assert ex.bytes_pulled == PIECE


def test_holder_gives_up_when_a_same_host_peers_store_is_removed(tmp_path: Path) -> None:
    """A sender's store wiped mid-version (the ``delete`` fault, a lost node's memory) will
    publish nothing more of it: the holder says so at once (the engine then votes the version
    incomplete and goes on), instead of waiting out the timeout and failing the job."""
    ex, stores = _holder_of_half_v4(tmp_path, timeout_s=5.0)
    assert ex.pull_ready() == PIECE
    shutil.rmtree(stores[1].path)  # the rest of v4 never comes
    with pytest.raises(PeerStoreGone, match=r"peer\(s\) \[1\] was removed while v4"):
        ex.finish()
    assert ex.bytes_pulled == PIECE
