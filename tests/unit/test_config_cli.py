"""Config validation and CLI error messages: one line with the fix, exit code 2."""

from __future__ import annotations

import pytest

from baft.cli import main
from baft.model.config import ModelConfig
from baft.model.gpt import split_layers
from baft.topology import Topology
from baft.train.config import ParallelConfig, TrainConfig


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--dp", "3", "--batch", "16"], "must split evenly"),
        (["train", "--pp", "4", "--layers", "2"], "--layers >= 4"),
        (["train", "--d-model", "100", "--heads", "3"], "multiple of --heads"),
        (["train", "--tp", "3", "--heads", "4", "--d-model", "96"], "multiple of --tp"),
        (["train", "--dp", "0"], "--dp must be >= 1"),
        (
            ["train", "--schedule", "interleaved-1f1b", "--microbatches", "3", "--batch", "12"],
            "divisible by --pp",
        ),
        (["demo", "--kill-at", "2"], "need 3 < --kill-at < --node-loss-at < --iterations"),
        (["train", "--elastic", "3"], "between 1 and the run's 2 hosts"),
        (["train", "--elastic", "1", "--dp-shard", "2"], "not FSDP2's shards"),
        (["train", "--elastic", "1", "--lose-host", "1:9:4"], "BACK after ITER"),
        (["train", "--elastic", "1", "--lose-host", "h1:9"], "HOST:ITER[:BACK]"),
        (["train", "--lose-host", "1:9"], "--lose-host needs --elastic"),
        (["train", "--elastic", "1", "--no-checkpoint"], "need checkpointing on"),
    ],
)
def test_bad_input_is_one_line_error(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("baft: error:")
    assert needle in err
    assert "\n" not in err and "Traceback" not in err


def test_unknown_schedule_rejected_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--schedule", "nope"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_train_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--dp",
        "--pp",
        "--tp",
        "--schedule",
        "--microbatches",
        "--iterations",
        "--seed",
        "--out",
        "--layers",
        "--d-model",
        "--heads",
        "--seq-len",
    ):
        assert flag in out


def test_defaults_are_valid_and_four_ranks() -> None:
    cfg = TrainConfig()
    cfg.validate()
    assert cfg.parallel.world_size == 4
    assert (cfg.parallel.num_dp, cfg.parallel.num_pp) == (2, 2)


def test_roundtrip_dict() -> None:
    cfg = TrainConfig(model=ModelConfig(num_layers=6), parallel=ParallelConfig(num_tp=2), seed=3)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_split_layers_even_and_uneven() -> None:
    assert split_layers(8, 2) == [(0, 4), (4, 8)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError):
        split_layers(2, 3)


def test_topology_coords_roundtrip_and_nodes() -> None:
    t = Topology(num_pp=2, num_dp=2, num_tp=2, ranks_per_node=4)
    assert t.world_size == 8 and t.num_nodes == 2
    for r in range(8):
        c = t.coords(r)
        assert t.rank_of(c.pp, c.dp, c.tp) == r
    assert t.coords(5) == t.coords(5).__class__(pp=1, dp=0, tp=1)
    assert t.replicas(5) == (5, 7)
    assert t.ranks_on_node(1) == (4, 5, 6, 7)
    assert t.node_of(6) == 1
    with pytest.raises(ValueError, match="must divide"):
        Topology(num_pp=3, ranks_per_node=2)
