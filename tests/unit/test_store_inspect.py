"""``baft inspect``: text and JSON reports over real stores, and a clear 'not a store'."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from baft.cli.inspect import add_inspect_parser
from baft.recover.inspect import inspect_job, inspect_stores
from baft.store.coding import Redundancy
from baft.store.inspect import newest_manifest, rank_report, read_inventories, stores_by_job
from baft.topology import Topology
from tests.unit.test_store_support import (
    open_stores,
    random_shards,
    shard_sizes,
    shm_dir,
    write_version,
)

T4 = Topology(num_dp=4, ranks_per_node=1)


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="baft")
    add_inspect_parser(parser.add_subparsers())
    args = parser.parse_args(["inspect", *argv])
    return args.func(args)


@pytest.fixture
def store_root():
    red = Redundancy.parse("rs:2+2")
    sizes = shard_sizes(T4)
    with shm_dir() as root:
        stores, layouts = open_stores(root, T4, red, sizes)
        write_version(stores, layouts, T4, 1, random_shards(sizes, 1))
        slots = write_version(stores, layouts, T4, 2, random_shards(sizes, 2))
        for s in stores.values():
            s.begin(3)
        stores[1].destroy()
        stores[3].red_view(slots[3])[0] ^= 1
        yield root


def test_inspect_text(store_root: Path, capsys):
    assert _run([str(store_root), "--job", "job"]) == 0
    out = capsys.readouterr().out
    assert "topology pp=1 dp=4 tp=1, 1 ranks/node, redundancy rs:2+2; committed v=2" in out
    assert "rank 1: store missing" in out
    assert "slot 1 v2 complete: shard 1,000 B [0, 1000) in 16 chunks ok; redundancy 1,120 B" in out
    assert "1,120 B in 2 regions CORRUPT regions [5]" in out
    assert "! rank 3 slot 1 v2: redundancy region 5 checksum mismatch" in out
    assert (
        "v3: NOT recoverable: v=3 (newer than committed v=2) was incomplete on ranks 0,2,3 (writing)"
        in out
    )
    assert (
        "v2: recoverable: ranks 0,2,3 local; rank 1 (store lost with node 1) rebuilt from rs:2+2 "
        "parity using ranks 0,2,3" in out
    )
    assert "recovery now: v=2 from memory" in out


def test_inspect_json_on_job_dir(store_root: Path, capsys):
    assert _run([str(store_root / "job"), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert job["topology"]["missing_ranks"] == [1]
    assert [r["rank"] for r in job["ranks"]] == [0, 2, 3]
    v2 = job["ranks"][2]["versions"][1]
    assert (v2["version"], v2["data_ok"], v2["bad_regions"], v2["owned"]) == (
        2,
        True,
        [5],
        [0, 1111],
    )
    assert [(v["version"], v["recoverable"]) for v in job["versions"]] == [(3, False), (2, True)]
    assert job["recovery"]["version"] == 2 and job["recovery"]["source"] == "memory"


def test_inspect_not_a_store(tmp_path: Path, capsys):
    (tmp_path / "something").mkdir()
    assert _run([str(tmp_path)]) == 2
    assert "is not a baft snapshot store; expected a store root" in capsys.readouterr().out
    assert _run([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().out


def test_store_side_and_recovery_side_split(store_root: Path):
    """The store lists and inventories (no coordinator); recover.inspect assesses."""
    jobs = stores_by_job(store_root)
    assert list(jobs) == ["job"] and sorted(a.rank for a in jobs["job"]) == [0, 2, 3]
    invs = read_inventories(jobs["job"])
    manifest = newest_manifest(invs)
    assert manifest is not None and manifest.version == 2 and manifest.redundancy == "rs:2+2"
    assert [v["version"] for v in rank_report(invs[0])["versions"]] == [3, 2]
    (report,) = inspect_stores(store_root)
    assert report == inspect_job(jobs["job"])
    assert report["committed"] == 2 and report["recovery"]["version"] == 2
    assert inspect_stores(store_root / "nope") == []
