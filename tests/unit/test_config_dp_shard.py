"""``baft train --dp-shard N`` (FSDP2 stages): the config's sizes, its validation (one
line with the fix), the flag, and which slice of a batch each rank reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from baft.cli import main
from baft.cli.train import add_train_parser, config_from_args
from baft.config import CheckpointConfig
from baft.topology import Coords
from baft.train.config import ParallelConfig, TrainConfig
from baft.train.trainer import Trainer


def test_sizes_count_the_shards() -> None:
    par = ParallelConfig(num_dp=2, num_dp_shard=3, num_pp=2, num_tp=2)
    assert par.world_size == 24
    assert par.num_data_ranks == 6  # replicas x FSDP2 shards read different data
    assert par.num_shard == 6  # FSDP2 x TP: baft's shard axis
    assert ParallelConfig().num_dp_shard == 1 and ParallelConfig().world_size == 4


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--dp-shard", "0"], "--dp-shard must be >= 1"),
        (
            ["train", "--dp", "1", "--dp-shard", "3", "--batch", "16"],
            "into dp=1 replicas x dp_shard=3 shards x 4 microbatches: use a multiple of 12",
        ),
        (
            ["train", "--dp", "2", "--dp-shard", "2", "--batch", "8", "--microbatches", "4"],
            "use a multiple of 16",
        ),
    ],
)
def test_bad_dp_shard_is_one_line_error(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("baft: error:") and needle in err
    assert "\n" not in err


def test_emulated_compute_refuses_fsdp2() -> None:
    cfg = TrainConfig(
        parallel=ParallelConfig(num_dp=1, num_dp_shard=2),
        global_batch=8,
        compute="emulated",
        emulated_times={"fwd": [0.0, 0.0], "bwd": [0.0, 0.0]},
    )
    with pytest.raises(ValueError, match="compute=emulated does not run FSDP2 stages"):
        cfg.validate()


def test_checkpoint_topology_counts_shard_ranks() -> None:
    """pp=2 x dp_shard=2 is 4 ranks, 2 declared nodes of 2: xor:2 fits (with the shard
    ranks left out of the count there would be one node, and xor:2 refused)."""
    cfg = TrainConfig(
        parallel=ParallelConfig(num_dp=1, num_dp_shard=2, num_pp=2, ranks_per_node=2),
        global_batch=8,
        checkpoint=CheckpointConfig.parse("redundancy=xor:2"),
    )
    cfg.validate()
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_flag_reaches_the_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    a = parser.parse_args(["train", "--dp", "1", "--dp-shard", "2", "--batch", "8"])
    cfg = config_from_args(a)
    assert (cfg.parallel.num_dp, cfg.parallel.num_dp_shard) == (1, 2)
    assert cfg.parallel.world_size == 4


@pytest.mark.parametrize(
    "dp, shard, expect",
    [
        (0, 0, 0),
        (0, 1, 0),  # TP ranks of one FSDP2 shard read the same slice
        (0, 2, 1),
        (0, 3, 1),
        (1, 0, 2),
        (1, 3, 3),
    ],
)
def test_data_rank_is_replica_then_fsdp_shard(dp: int, shard: int, expect: int) -> None:
    """baft's shard coordinate folds (dp_shard, tp) with tp fastest; the data slice is
    ``dp * dp_shard + dp_shard_index``, one per replica and FSDP2 shard."""
    par = ParallelConfig(num_dp=2, num_dp_shard=2, num_tp=2)
    fake = SimpleNamespace(
        mesh=SimpleNamespace(coords=Coords(pp=0, dp=dp, tp=shard)),
        cfg=SimpleNamespace(parallel=par),
    )
    assert Trainer.data_rank.fget(fake) == expect  # type: ignore[attr-defined]
