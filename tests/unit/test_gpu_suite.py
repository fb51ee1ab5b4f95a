"""benchmarks/gpu_suite.sh's CPU-visible parts: the plan and its flags, the error without a
GPU, a step's timeout, and the page from synthetic step results (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
pytest.importorskip("baft_bench")

import gpu_suite as g  # noqa: E402
from baft_bench.cli import add_bench_parser, config_from_args  # noqa: E402


def _steps(argv: list[str], gpus: int) -> dict[str, g.Step]:
    return {s.name: s for s in g.plan(g.parse_args(argv), gpus)}


def test_layout_per_gpu_count() -> None:
    assert g.layout(1) == {"pp": 1, "train_pp": 1, "redundancy": "none"}
    assert g.layout(2) == {"pp": 2, "train_pp": 2, "redundancy": "xor:2"}
    assert g.layout(3)["pp"] == 2
    assert g.layout(8)["pp"] == 8 and g.layout(16)["pp"] == 8 and g.layout(8)["train_pp"] == 2


def test_minutes_share_the_budget() -> None:
    steps = _steps(["--minutes", "8", "--python", "py"], 4)
    assert list(steps) == ["env", "copy", "hash", "overhead", "restore-ref", "restore-kill"]
    assert sum(s.timeout_s for s in steps.values()) <= 8 * 60
    assert steps["overhead"].timeout_s == 240
    long = _steps(["--minutes", "16", "--python", "py"], 4)
    assert long["overhead"].timeout_s == 480
    tiny = _steps(["--minutes", "0.1", "--python", "py"], 4)
    assert min(s.timeout_s for s in tiny.values()) == g.MIN_STEP_S


def _parse_bench(words: list[str]) -> object:
    import argparse

    parser = argparse.ArgumentParser(prog="baft")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(words)


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_overhead_step_is_a_valid_bench_command(gpus: int) -> None:
    step = _steps(["--python", "py", "--out", "O", "--blocks", "6"], gpus)["overhead"]
    assert step.argv[:5] == ["py", "-m", "baft.cli", "bench", "overhead"]
    a = _parse_bench(step.argv[3:])
    cfg = config_from_args(a)  # type: ignore[arg-type]
    assert cfg.num_pp == g.layout(gpus)["pp"] and cfg.num_blocks == 6
    assert cfg.compute == "real" and a.json and a.results_dir == "O/overhead"  # type: ignore[attr-defined]
    assert float(a.timeout) < step.timeout_s  # type: ignore[attr-defined]


def test_restore_steps_kill_one_rank_and_compare() -> None:
    steps = _steps(["--python", "py", "--run-dir", "R"], 2)
    ref, kill = steps["restore-ref"].argv, steps["restore-kill"].argv
    assert "--no-checkpoint" in ref and ref[ref.index("--out") + 1] == "R/ref"
    assert kill[kill.index("--inject") + 1] == f"kill:rank=1,iter={g.KILL_AT}"
    assert "redundancy=xor:2" in kill[kill.index("--checkpoint") + 1]
    # same model and schedule in both runs
    assert ref[: ref.index("--no-checkpoint")] == kill[: kill.index("--checkpoint")]


def _suite(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PY": sys.executable, "PATH": "/usr/bin:/bin"}  # no nvidia-smi
    return subprocess.run(["bash", str(ROOT / "benchmarks/gpu_suite.sh"), *args], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip


@pytest.mark.skipif(g.detect_gpus() > 0, reason="a GPU is present")
def test_no_gpu_is_a_clear_error_but_dry_run_plans(tmp_path: Path) -> None:
    r = _suite("--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "no NVIDIA GPU" in r.stderr
    assert not (tmp_path / "o").exists()
    r = _suite("--dry-run", "--out", str(tmp_path / "o"), "--minutes", "5", "--gpus", "2")
    assert r.returncode == 0, r.stderr
    assert "2 GPU(s)" in r.stdout and f"{tmp_path}/o/gpu-suite.md" in r.stdout
    assert "bench overhead --pp 2" in r.stdout and "kill:rank=1" in r.stdout
    assert "(limit 150 s)" in r.stdout  # the overhead's half of 5 minutes
    assert not (tmp_path / "o").exists()


def test_bad_flags_are_rejected() -> None:
    with pytest.raises(SystemExit):
        g.parse_args(["--minutes", "0"])
    with pytest.raises(SystemExit):
        g.parse_args(["--gpus", "0"])


def test_step_timeout_and_failure_are_reported(tmp_path: Path) -> None:
    slow = g.Step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1)
    r = g.run_step(slow, tmp_path)
    assert r.timed_out and not r.ok and r.seconds < 20
    bad = g.Step("bad", [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], 30)  # fmt: skip
    r = g.run_step(bad, tmp_path)
    assert r.rc == 3 and r.tail == ["boom"]
    good = g.Step("good", [sys.executable, "-c", "print('{\"a\": 1}')"], 30, stdout="good.json")
    assert g.run_step(good, tmp_path).ok and json.loads((tmp_path / "good.json").read_text()) == {"a": 1}  # fmt: skip
    assert g.run_step(g.Step("skip", ["false"], 5, skip="why"), tmp_path).rc is None


def _summary(path: Path, digest: str, recoveries: list[dict]) -> None:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"final_state_digest": digest, "recoveries": recoveries}))  # fmt: skip


def test_restore_check(tmp_path: Path) -> None:
    rec = [{"source": "memory", "restored_version": 13, "lost_iterations": 1, "reason": "x"}]
    _summary(tmp_path / "ref", "abc", [])
    _summary(tmp_path / "kill", "abc", rec)
    ok = g.restore_check(tmp_path / "ref", tmp_path / "kill")
    assert ok["bit_exact"] and ok["recoveries"] == [{"source": "memory", "restored_version": 13, "lost_iterations": 1}]  # fmt: skip
    _summary(tmp_path / "kill2", "abd", rec)
    assert not g.restore_check(tmp_path / "ref", tmp_path / "kill2")["bit_exact"]
    _summary(tmp_path / "kill3", "abc", [])  # no recovery happened: not a check
    assert not g.restore_check(tmp_path / "ref", tmp_path / "kill3")["bit_exact"]
    assert not ok["inprocess"]  # no generation recorded: a group restart
    _summary(tmp_path / "kill4", "abc", [dict(rec[0], attempt=0, inprocess={"generation": 1})])
    assert g.restore_check(tmp_path / "ref", tmp_path / "kill4")["inprocess"]
    _summary(tmp_path / "kill5", "abc", [dict(rec[0], attempt=1, inprocess={"generation": 1})])
    assert not g.restore_check(tmp_path / "ref", tmp_path / "kill5")["inprocess"]
    assert "error" in g.restore_check(tmp_path / "ref", tmp_path / "missing")


def test_page_from_synthetic_results() -> None:
    results = [
        g.StepResult("env", "sh -c nvidia-smi", 20, rc=0, seconds=1.0),
        g.StepResult("copy", "py cuda_copy.py", 57, rc=0, seconds=30.0),
        g.StepResult("hash", "py hash_speed.py", 24, skip="crc32c missing"),
        g.StepResult(
            "overhead",
            "py -m baft.cli bench overhead",
            240,
            rc=1,
            seconds=12.0,
            tail=["Traceback", "RuntimeError: x"],
        ),  # fmt: skip
        g.StepResult("restore-kill", "py -m baft.cli train", 81, seconds=81.0, timed_out=True),
    ]
    data = {
        "machine": "NVIDIA H100 80GB HBM3, 81559 MiB, 550.54",
        "copy": {
            "copy_shm": {
                "copy_gb_per_s": 54.6,
                "start_ms": 2.3,
                "copied_ms": 39.1,
                "hashed_ms": 45.9,
                "checksums_right": True,
            },  # fmt: skip
            "matmul_slowdown": 1.02,
            "tflops_alone": 790.0,
            "bytes_equal": True,
            "host_xxh3_gb_per_s_8_threads": 60.7,
        },  # fmt: skip
        "hash": "",
        "overhead": {
            "config": {
                "num_pp": 2,
                "num_dp": 1,
                "schedule": "1f1b",
                "d_model": 1024,
                "checkpoint": "every=1",
            },  # fmt: skip
            "state_bytes_per_rank": [2**30],
            "modes": {
                "baft": {
                    "median_iter_s": 0.0412,
                    "paired_wall_ratio_vs_none": 1.013,
                    "ci_low": 1.0,
                    "ci_high": 1.03,
                    "restores": "yes",
                    "bytes_per_iter": 2**29,
                }
            },  # fmt: skip
            "skipped": {"dlrover-flash": "import failed"},
        },
        "restore": {
            "bit_exact": True,
            "ref_digest": "abc",
            "kill_digest": "abc",
            "recoveries": [{"source": "memory"}],
        },  # fmt: skip
    }
    page = g.render_page(date="2026-12-06", argv="bash benchmarks/gpu_suite.sh", gpus=2, results=results, data=data)  # fmt: skip
    assert page.startswith("# GPU suite (2026-12-06)")
    assert "- steps: 2 ok, 2 failed, 1 skipped" in page
    assert "| hash | skipped: crc32c missing | 0.0 | 24 |" in page
    assert "| overhead | FAILED (exit 1) | 12.0 | 240 |" in page
    assert "| restore-kill | TIMED OUT | 81.0 | 81 |" in page
    assert "RuntimeError: x" in page and "NVIDIA H100 80GB HBM3" in page
    assert "- **yes**: final state digest without checkpoints `abc`" in page
    assert "- shm: 54.6 GB/s D2H" in page and "8 threads 60.7 GB/s" in page
    assert "| baft | 41.2 | 1.013 | [1.000, 1.030] | yes | 512.0 |" in page
    assert "- skipped `dlrover-flash`: import failed" in page
    empty = g.render_page(date="d", argv="a", gpus=1, results=[], data={"restore": {"error": "no summary.json"}})  # fmt: skip
    assert "- not checked: no summary.json" in empty and "no overhead JSON" in empty
