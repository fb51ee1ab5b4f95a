"""Like-for-like arms of ``baft bench overhead`` without running them: what each engine
mode changes, the transport each reports, the cadence flags, the memory helpers, the
copy-thread stand-in, and the facts attached to the summary."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from baft_bench.aggregate import EXTRA_MODE_KEYS, merge_extra, with_facts
from baft_bench.cli import add_bench_parser, command_line, config_from_args
from baft_bench.facts import MODE_FIELDS, mode_note
from baft_bench.memory import MemoryTracker, allocated_bytes, per_rank, rss_bytes
from baft_bench.modes import ALL_MODES, ENGINE_ARMS, ENGINE_MODES, resolve_modes
from baft_bench.overhead import OverheadConfig
from baft_bench.peers import ThreadCopier, peer_versions


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "overhead", *argv])


def test_engine_arms_differ_in_one_thing_each() -> None:
    cfg = OverheadConfig(modes=["none", *ENGINE_MODES], persist_every=4, block_iters=4)
    cfg.validate()
    ck = {m: cfg.engine_checkpoint(m) for m in ENGINE_MODES}
    assert {m: c.exchange.paths for m, c in ck.items()} == {
        **{m: "network" for m in ENGINE_MODES},
        "baft-shm": "auto",
    }
    assert {m: c.policy.full_every for m, c in ck.items()} == {
        "naive-async": 1,
        "baft-full": 1,
        "baft": 0,
        "baft-shm": 0,
        "baft-noreplica": 0,
        "baft-persist": 0,
        "baft-persist-proc": 0,
        "baft-gloo-normal": 0,
        "baft-mem2x": 0,
        "baft-mem3x": 0,
        "baft-mem4x": 0,
        "baft-mem6x": 0,
    }
    # the priority and budget arms differ only where they are built (the budget needs the
    # rank's state, the priority is read as the threads start): their arm says so
    assert {m: a.priority for m, a in ENGINE_ARMS.items() if a.priority} == {
        "baft-gloo-normal": "threads"
    }
    assert {m: a.budget_x for m, a in ENGINE_ARMS.items() if a.budget_x} == {
        "baft-mem2x": 2.0,
        "baft-mem3x": 3.0,
        "baft-mem4x": 4.0,
        "baft-mem6x": 6.0,
    }
    assert ck["baft-noreplica"].policy.redundancy == "none"
    assert ck["baft"].policy.redundancy == "xor:2"
    assert ck["baft-persist"].policy.persist_every == 4
    assert ck["baft-persist-proc"].policy.persist_every == 4
    assert {m: c.persist.writer for m, c in ck.items()} == {
        **{m: "thread" for m in ENGINE_MODES},
        "baft-persist-proc": "process",
    }
    assert ck["baft"].policy.persist_every == 0
    assert all(c.store.keep_on_close for c in ck.values())  # read by the restore check
    assert {m: cfg.transport(m) for m in ("none", "bare", "checkfreq", *ENGINE_MODES)} == {
        "none": "n/a",
        "bare": "n/a",
        "checkfreq": "n/a",
        "naive-async": "network",
        "baft-full": "network",
        "baft": "network",
        "baft-shm": "shm",
        "baft-noreplica": "n/a",
        "baft-persist": "network",
        "baft-persist-proc": "network",
        "baft-gloo-normal": "network",
        **{f"baft-mem{n}x": "network" for n in (2, 3, 4, 6)},
    }
    assert cfg.transport("lm-resiliency") == "network"
    assert cfg.transport("dlrover-flash") == "n/a"


def test_engine_exchange_option_leaves_the_shm_arm_alone() -> None:
    cfg = OverheadConfig(modes=["none", "baft", "baft-shm"], engine="exchange=auto")
    assert cfg.engine_checkpoint("baft").exchange.paths == "auto"
    cfg.engine = "exchange=network"
    assert cfg.engine_checkpoint("baft-shm").exchange.paths == "auto"


def test_interval_and_persist_every_set_each_mode_s_cadence() -> None:
    cfg = OverheadConfig(modes=["none", "baft", "checkfreq"], interval=5, block_iters=10)
    cfg.validate()
    assert cfg.engine_checkpoint("baft").policy.every == 5
    assert (cfg.cadence("baft"), cfg.cadence("checkfreq"), cfg.cadence("lm-resiliency")) == (
        5,
        5,
        5,
    )
    cfg.persist_every = 2
    assert (cfg.cadence("baft"), cfg.cadence("baft-persist"), cfg.cadence("dcp-async")) == (
        5,
        10,
        10,
    )
    cfg.validate()
    cfg.block_iters = 5
    with pytest.raises(ValueError, match="multiple of the longest checkpoint cadence, 10"):
        cfg.validate()
    cfg = OverheadConfig(modes=["none", "baft"], interval=2, checkpoint="every=3")
    with pytest.raises(ValueError, match="every=3 and --interval 2 differ"):
        cfg.engine_checkpoint("baft")


def test_mode_names_old_and_aliases() -> None:
    assert resolve_modes(["none", "baft-network", "baft-nored"]) == [
        "none",
        "baft",
        "baft-noreplica",
    ]
    with pytest.raises(ValueError, match="unknown mode"):
        resolve_modes(["none", "baft-fast"])
    assert {"none", "bare", "baft", "baft-shm", "baft-noreplica", "baft-persist"} <= set(ALL_MODES)
    cfg = OverheadConfig(modes=["none", "baft-net"])
    cfg.validate()
    assert cfg.modes == ["none", "baft"]


def test_cli_flags_reach_the_config_and_the_command_line() -> None:
    a = _parse("--modes", "none,baft", "--interval", "5", "--persist-every", "2")
    a.block_iters = 10
    cfg = config_from_args(a)
    assert (cfg.interval, cfg.persist_every, cfg.restore_check) == (5, 2, True)
    line = command_line(a)
    assert "--interval 5 --persist-every 2" in line and "--no-restore-check" not in line
    a = _parse("--modes", "none", "--no-restore-check")
    assert config_from_args(a).restore_check is False
    assert command_line(a).endswith("--no-restore-check")


def test_allocated_bytes_counts_what_files_hold(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 8192)
    (tmp_path / "b").write_bytes(b"y" * 4096)
    sparse = tmp_path / "d" / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(1 << 20)  # apparent 1 MiB, nothing allocated
    assert allocated_bytes([tmp_path / "d", tmp_path / "b"]) == 8192 + 4096
    assert allocated_bytes([tmp_path / "missing"]) == 0


def test_memory_tracker_counts_what_a_mode_holds_and_its_peak() -> None:
    tracker = MemoryTracker()
    tracker.held_start("m")
    held = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    tracker.held_stop("m")
    assert tracker.rss_held["m"] >= 48 << 20
    tracker.switched_on("m")
    tracker.switched_off("m")
    assert tracker.rss_peak["m"] >= rss_bytes() - (16 << 20)
    row = tracker.mode_memory("m", shm_bytes=5, record_bytes=None)
    assert row["cuda_peak_bytes"] is None and row["shm_bytes"] == 5
    assert per_rank([row, {**row, "shm_bytes": 7}])["shm_bytes"] == [5, 7]
    assert per_rank([row, row])["record_bytes"] is None
    del held


def test_thread_copier_copies_off_the_calling_thread() -> None:
    src = [torch.arange(10.0), torch.ones(3, 3)]
    dst = [torch.zeros(10), torch.zeros(3, 3)]
    copier = ThreadCopier()
    copier.start_copy(src, dst)
    assert copier.in_flight
    with pytest.raises(RuntimeError, match="still in flight"):
        copier.start_copy(src, dst)
    copier.wait()
    assert not copier.in_flight and copier.is_complete()
    assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))


def test_facts_reach_the_summary_and_notes_say_what_differs() -> None:
    raw = {
        "modes": {"none": {"iter_s": [[0.1]]}, "baft": {"iter_s": [[0.1]]}},
        "mode_facts": {
            "baft": {"transport": "network", "k": 4, "restores": "yes", "memory": {"a": [1]}},
        },
        "peer_versions": {"lm-resiliency": "0.2.0"},
        "memory_method": "vmhwm",
    }
    modes = with_facts(raw)["modes"]
    assert modes["baft"]["k"] == 4 and modes["baft"]["iter_s"] == [[0.1]]
    assert "restores" not in modes["none"]  # no facts: nothing invented
    assert set(MODE_FIELDS) <= set(EXTRA_MODE_KEYS)  # every fact survives summarize
    assert merge_extra("restores", ["yes", "no"]) == "no"  # one failed launch: "no"
    assert mode_note("lm-resiliency", "real") == (
        "synchronous fallback, not its GPU behaviour (copy_ on the training thread)"
    )
    assert "copy thread" in (mode_note("lm-resiliency", "emulated") or "")
    assert "StagingOptions" in (mode_note("dcp-async", "emulated") or "")
    assert mode_note("baft", "real") is None
    assert set(peer_versions()) == {"lm-resiliency", "dlrover-flash"}
