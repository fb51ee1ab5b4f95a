"""Peer modes of ``baft bench overhead`` without running them: a missing library fails
with the install command, the page says what each copy survives, the shm cleanup."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import baft_bench.peers as peers
from baft_bench.aggregate import summarize
from baft_bench.cli import add_bench_parser, config_from_args
from baft_bench.command import render_markdown
from baft_bench.overhead import ALL_MODES, OverheadConfig


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "overhead", *argv])


@pytest.fixture
def no_dlrover(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(peers._IMPORTS, "dlrover-flash", ("baft_no_such_module_xyz",))


def test_named_missing_peer_fails_with_the_install_command(no_dlrover: None) -> None:
    with pytest.raises(ValueError) as err:
        config_from_args(_parse("--modes", "none,lm-resiliency,dlrover-flash"))
    assert str(err.value) == (
        "--modes names dlrover-flash, not installed: pip install -e 'benchmarks[peers]'"
    )


def test_default_modes_leave_a_missing_peer_out(
    no_dlrover: None, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _parse()
    cfg = config_from_args(a)
    assert cfg.modes == [m for m in ALL_MODES if m != "dlrover-flash"]
    assert a.modes == ",".join(cfg.modes)  # the page's command shows what ran
    assert "leaving out dlrover-flash (not installed: pip install -e 'benchmarks[peers]')" in (
        capsys.readouterr().err
    )


def test_page_says_what_each_copy_survives() -> None:
    modes = ["none", "baft", "lm-resiliency", "dlrover-flash"]
    zeros = {f: [[0.0, 0.0]] for f in ("exposed_s", "in_bubble_s", "bytes")}
    raw = {
        "config": OverheadConfig(modes=modes).to_dict(),
        "snapshot_s": [0.01, 0.01],
        "state_bytes": [10, 10],
        "modes": {m: {"iter_s": [[0.1, 0.1]], **zeros} for m in modes},
    }
    page = render_markdown(summarize(raw), command="c", date="d", plot=None)
    assert f"  - `lm-resiliency`: {peers.PROTECTS['lm-resiliency']}" in page
    assert f"  - `dlrover-flash`: {peers.PROTECTS['dlrover-flash']}" in page
    assert "  - `baft`: process crash: yes" in page


def test_clean_dlrover_removes_only_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "SHM_DIR", tmp_path / "shm")
    monkeypatch.setattr(peers, "SOCKET_DIR", tmp_path / "sock")
    run = peers.dlrover_run_id("runs/x")
    other = peers.dlrover_run_id("runs/y")
    for name in (f"{run}_ckpt_shm_0", f"{run}_ckpt_shm_1", f"{other}_ckpt_shm_0"):
        (tmp_path / "shm").mkdir(exist_ok=True)
        (tmp_path / "shm" / name).write_bytes(b"x")
    (tmp_path / "sock" / run).mkdir(parents=True)
    (tmp_path / "sock" / run / "sharedlock_shm_lock_0.sock").write_bytes(b"")
    removed = peers.clean_dlrover(run)
    assert [Path(p).name for p in removed] == [f"{run}_ckpt_shm_0", f"{run}_ckpt_shm_1", run]
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == [f"{other}_ckpt_shm_0"]
    assert not (tmp_path / "sock" / run).exists()
    assert peers.clean_dlrover(run) == []
