"""``baft bench`` is registered by baft's command line and run by the harness package
``baft_bench`` (``benchmarks/``): with it, the subcommands and flags are the harness's;
without it, every ``baft bench ...`` says how to install it and exits with code 2."""

from __future__ import annotations

import sys

import pytest

import baft_bench
from baft.cli import build_parser, main
from baft.cli.bench import NOT_INSTALLED


def test_the_harness_subcommands_hang_under_baft_bench() -> None:
    from baft_bench.cli import run_bench
    from baft_bench.recovery import run_recovery

    args = build_parser().parse_args(["bench", "overhead", "--pp", "3", "--modes", "none"])
    assert args.func is run_bench and args.bench_command == "overhead" and args.pp == 3
    assert build_parser().parse_args(["bench", "recovery"]).func is run_recovery


def test_bench_without_a_benchmark_names_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 2
    assert "choose a benchmark: overhead, recovery, scale" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["bench"], ["bench", "--help"], ["bench", "overhead", "--pp", "2"], ["bench", "--pp", "2"]],
)
def test_without_the_harness_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    monkeypatch.setitem(sys.modules, "baft_bench", None)  # import baft_bench fails
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"baft: error: {NOT_INSTALLED}\n"
    assert "pip install -e benchmarks" in err and "baft-bench" in err


def test_without_the_harness_the_other_commands_still_parse(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "baft_bench", None)
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "pip install -e" in out and "plan" in out and "train" in out


def test_a_broken_harness_raises_its_own_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed harness whose import fails is not reported as missing."""
    monkeypatch.delattr(baft_bench, "cli", raising=False)
    monkeypatch.setitem(sys.modules, "baft_bench.cli", None)
    with pytest.raises(ModuleNotFoundError) as exc:
        build_parser()
    assert exc.value.name == "baft_bench.cli"
