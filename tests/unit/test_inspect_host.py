"""``baft inspect`` over a store root: every job's stores listed (size, last write, live,
recoverable), and ``--free`` removing only those no live process holds and nobody wrote
to lately, with the lock and idle checks a restore applies (``reclaim.why_kept``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from baft.cli import main
from baft.cli.inspect import _size
from baft.store import reclaim
from baft.store.coding import Redundancy
from baft.store.shm import SnapshotStore
from baft.topology import Topology
from tests.unit.test_store_support import open_stores, random_shards, shard_sizes, write_version

T4 = Topology(num_dp=4, ranks_per_node=1)
HOUR_AGO = 7200.0

_HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from baft.store.shm import SnapshotStore
    store = SnapshotStore(Path(sys.argv[1]), "live", 0, 0, 1 << 22)
    store.allocate(1 << 16, 0)
    store.data_view(store.begin(1))[:] = 7
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["inspect", *argv])
    return rc, capsys.readouterr().out


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc, out = _cli(capsys, *argv, "--json")
    assert rc == 0, out
    return json.loads(out)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for f in path.rglob("*"):
        os.utime(f, (then, then))


def _du(path: Path) -> int:
    """Allocated bytes of every file under ``path`` (what ``du`` counts)."""
    return sum(
        os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs
    )


def _tree(path: Path) -> dict[str, tuple[int, float, bytes]]:
    """Every file under ``path`` with its size, mtime and contents."""
    return {
        str(f.relative_to(path)): (f.stat().st_size, f.stat().st_mtime, f.read_bytes())
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def _ended_job(root: Path, job: str) -> int:
    """A job whose process ended after writing one incomplete version: its stores stay,
    unheld, and hold nothing recoverable. Returns their bytes as the stores count them."""
    total = 0
    for node, rank in ((0, 0), (0, 1)):
        store = SnapshotStore(root, job, node, rank, 1 << 22)
        store.allocate(3000, 0)
        store.data_view(store.begin(1))[:] = 5
        total += store.host_bytes()
        store.close()
    return total


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process holding the store of job ``live`` (its progress lock) until killed."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)


@pytest.mark.timeout(60)
def test_a_job_held_by_a_live_process_is_listed_live_and_never_freed(
    tmp_path: Path, holder: subprocess.Popen[bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    _age(tmp_path / "live", HOUR_AGO)  # idle for long: only the lock keeps it
    before = _tree(tmp_path / "live")
    (job,) = _json(capsys, "--root", str(tmp_path))["jobs"]
    assert (job["job"], job["num_stores"], job["live"]) == ("live", 1, True)
    assert job["host_bytes"] == _du(tmp_path / "live") > 0
    assert job["recoverable"] is False  # v1 never completed
    for argv in (["--idle-s", "0"], ["--idle-s", "0", "--dry-run"]):
        got = _json(capsys, str(tmp_path), "--free", *argv)
        assert got["freed"] == [] and got["freed_bytes"] == 0
        assert [(k["job"], k["live"], k["reason"]) for k in got["kept"]] == [
            ("live", True, "held by a live process")
        ]
    assert _tree(tmp_path / "live") == before  # not a byte or an mtime changed
    nbytes = _du(tmp_path / "live")
    rc, out = _cli(capsys, str(tmp_path), "--free", "--idle-s", "0")
    assert rc == 0
    assert out.splitlines() == [
        f"kept live (1 rank store(s), {nbytes:,} B, last write 2.0 h ago): held by a live process",
        f"freed 0 job(s), 0 B (0 B) under {tmp_path}; kept 1 (idle threshold 0 s)",
    ]
    # kill -9 the job: the kernel drops its lock, the stores are an ended job's now
    holder.send_signal(signal.SIGKILL)
    assert holder.wait(timeout=30) == -signal.SIGKILL
    assert [j["live"] for j in _json(capsys, "--root", str(tmp_path))["jobs"]] == [False]
    got = _json(capsys, "--root", str(tmp_path), "--free", "--idle-s", "0")
    assert [(f["job"], f["host_bytes"]) for f in got["freed"]] == [("live", nbytes)]
    assert got["kept"] == [] and got["freed_bytes"] == nbytes
    assert not (tmp_path / "live").exists()


def test_free_removes_idle_unheld_jobs_and_keeps_recent_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _ended_job(tmp_path, "old")
    _age(tmp_path / "old", HOUR_AGO)
    recent = _ended_job(tmp_path, "recent")  # a job between torchrun restarts: no lock
    assert old == _du(tmp_path / "old") > 0 and recent == _du(tmp_path / "recent") > 0
    (tmp_path / "notes").mkdir()  # not a job store: never touched
    (tmp_path / "notes" / "x.txt").write_text("mine")
    got = _json(capsys, str(tmp_path), "--free")
    assert (got["idle_s"], got["dry_run"]) == (3600.0, False)
    assert [(f["job"], f["num_stores"], f["host_bytes"]) for f in got["freed"]] == [("old", 2, old)]
    assert got["freed_bytes"] == old and got["freed"][0]["age_s"] >= HOUR_AGO
    (kept,) = got["kept"]
    assert (kept["job"], kept["host_bytes"], kept["live"]) == ("recent", recent, False)
    assert re.fullmatch(r"written \d+ s ago \(< idle 3600 s\)", kept["reason"]), kept["reason"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "recent"]
    assert (tmp_path / "notes" / "x.txt").read_text() == "mine"
    # in text, with a shorter idle threshold: the recent one goes too
    _age(tmp_path / "recent", 60)
    rc, out = _cli(capsys, "--root", str(tmp_path), "--free", "--idle-s", "30")
    assert rc == 0
    line, total = out.splitlines()
    assert re.fullmatch(
        rf"freed recent \(2 rank store\(s\), {recent:,} B, last write \d+ s ago\)", line
    )
    assert total == (
        f"freed 1 job(s), {recent:,} B ({_size(recent)}) under {tmp_path}; "
        "kept 0 (idle threshold 30 s)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_dry_run_frees_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _ended_job(tmp_path, "old")
    _age(tmp_path / "old", HOUR_AGO)
    before = _tree(tmp_path)
    got = _json(capsys, str(tmp_path), "--free", "--idle-s", "0", "--dry-run")
    assert got["dry_run"] is True
    assert [(f["job"], f["host_bytes"]) for f in got["freed"]] == [("old", old)]
    assert _tree(tmp_path) == before
    rc, out = _cli(capsys, str(tmp_path), "--free", "--dry-run")
    assert rc == 0 and out.startswith(f"would free old (2 rank store(s), {old:,} B, last write ")
    assert _tree(tmp_path) == before


def test_listing_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A running job (its stores open in this process, as the engine holds them) with a
    committed version is live and recoverable; an ended job's incomplete one is neither."""
    sizes = shard_sizes(T4)
    stores, layouts = open_stores(tmp_path, T4, Redundancy.parse("rs:2+2"), sizes, job="run")
    write_version(stores, layouts, T4, 1, random_shards(sizes, 1))
    write_version(stores, layouts, T4, 2, random_shards(sizes, 2))
    run_bytes = sum(s.host_bytes() for s in stores.values())
    ended = _ended_job(tmp_path, "ended")
    _age(tmp_path / "ended", HOUR_AGO)
    got = _json(capsys, "--root", str(tmp_path))
    assert got["root"] == str(tmp_path)
    ended_job, run = got["jobs"]
    assert (run["job"], run["num_stores"], run["host_bytes"]) == ("run", 4, run_bytes)
    assert run_bytes == _du(tmp_path / "run")
    assert (run["live"], run["recoverable"], run["recovery"]["version"]) == (True, True, 2)
    assert run["committed"] == 2 and run["age_s"] < HOUR_AGO
    assert (ended_job["job"], ended_job["num_stores"], ended_job["host_bytes"]) == (
        "ended",
        2,
        ended,
    )
    assert (ended_job["live"], ended_job["recoverable"]) == (False, False)
    assert ended_job["age_s"] >= HOUR_AGO
    assert ended_job["recovery"]["reason"] == "no complete manifest: topology unknown"
    rc, out = _cli(capsys, str(tmp_path))
    assert rc == 0
    assert out.startswith(f"2 job(s), {run_bytes + ended:,} B (")
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert re.search(r"│ 2 .*│ 2\.0 h ago .*│ no .*│ no ", rows["ended"]), rows["ended"]
    assert re.search(r"│ 4 .*│ yes \(held by a live process\) │ v=2 from memory", rows["run"])
    for s in stores.values():
        s.close()  # the job ends: nothing holds its stores any more
    assert [j["live"] for j in _json(capsys, str(tmp_path))["jobs"]] == [False, False]


def test_one_job_in_detail_and_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ended = _ended_job(tmp_path, "ended")
    rc, out = _cli(capsys, "--root", str(tmp_path), "--job", "ended")
    assert rc == 0
    head, summary = out.splitlines()[:2]
    assert head == f"job ended  ({tmp_path / 'ended'})"
    assert re.fullmatch(
        rf"  2 rank store\(s\), {ended:,} B, last write \d+ s ago, held by no live process", summary
    ), summary
    assert out.splitlines()[-1] == "  recovery now: no complete manifest: topology unknown"
    (job,) = _json(capsys, str(tmp_path / "ended"))["jobs"]
    assert (job["job"], job["host_bytes"]) == ("ended", ended)
    assert _cli(capsys, str(tmp_path), "--job", "nope") == (
        2,
        f"baft inspect: no stores of job nope under {tmp_path}\n",
    )
    assert _cli(capsys, str(tmp_path), "--root", str(tmp_path / "x"))[0] == 2
    assert _cli(capsys, str(tmp_path), "--idle-s", "0") == (
        2,
        "baft inspect: --idle-s and --dry-run go with --free\n",
    )
    assert _cli(capsys, str(tmp_path / "ended"), "--job", "other")[0] == 2
    assert (tmp_path / "ended").is_dir()


def test_why_kept_is_the_one_predicate() -> None:
    """Listing, ``--free`` and a restore's reclaim all decide by it."""
    job = reclaim.JobStores("j", Path("/x/j"), 2, 8192, last_write=1000.0, held=True)
    assert reclaim.why_kept(job, 3600, now=1012.4) == (
        "held by a live process; written 12 s ago (< idle 3600 s)"
    )
    assert reclaim.why_kept(job, 0, now=1012.4) == "held by a live process"
    idle = reclaim.JobStores("j", Path("/x/j"), 2, 8192, last_write=1000.0, held=False)
    assert reclaim.why_kept(idle, 3600, now=1000.0 + 3600) is None
    assert reclaim.why_kept(idle, 3600, now=1000.0 + 3599) == ("written 3599 s ago (< idle 3600 s)")


def test_a_store_opened_during_a_liveness_probe_still_takes_its_lock(tmp_path: Path) -> None:
    """The probe holds the exclusive lock for a moment; a rank allocating its store then
    waits it out instead of running unlocked (a later --free would delete a live store)."""
    import fcntl
    import threading

    from baft.store.paths import PROGRESS_FILE
    from baft.store.reclaim import _locked
    from baft.store.shm import SnapshotStore

    store = SnapshotStore(tmp_path, "job", 0, 0, 1 << 30)
    store.allocate(4096, 0)
    store.close()
    path = store.path / PROGRESS_FILE
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a probe in progress
    threading.Timer(0.05, lambda: os.close(fd)).start()  # ... that ends 50 ms later
    again = SnapshotStore(tmp_path, "job", 0, 0, 1 << 30)
    again.allocate(4096, 0)
    assert _locked(path)  # the reopened store holds its lock
    again.close()
    assert not _locked(path)
