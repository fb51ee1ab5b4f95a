"""CheckpointConfig grouped by owner: a script written against the flat fields of before
gets an error that says where each one moved; the groups round-trip through JSON."""

from __future__ import annotations

import json

import pytest

from baft.config import (
    MOVED,
    CheckpointConfig,
    ExchangeConfig,
    MovedFieldError,
    PersistConfig,
    StoreConfig,
    TimeoutConfig,
)
from baft.train.config import TrainConfig


@pytest.mark.parametrize(
    ("old", "where"),
    [
        ("store_root", "store=StoreConfig(root=...)"),
        ("keep_stores_on_close", "store=StoreConfig(keep_on_close=...)"),
        ("persist_dir", "persist=PersistConfig(dir=...)"),
        ("timeout_s", "timeouts=TimeoutConfig(collective_s=...)"),
        ("flush_timeout_s", "timeouts=TimeoutConfig(flush_s=...)"),
        ("host_work", "exchange=ExchangeConfig(host_work=...)"),
        ("inject", "ft.inject([...]) before ft.restore()"),
        ("max_restarts", "torchrun --max-restarts"),
    ],
)
def test_old_field_names_say_where_they_moved(old: str, where: str) -> None:
    with pytest.raises(TypeError, match=f"CheckpointConfig.{old} moved") as e:
        CheckpointConfig(**{old: 1})
    assert where in str(e.value)
    ck = CheckpointConfig()
    with pytest.raises(AttributeError, match=f"CheckpointConfig.{old} moved"):
        getattr(ck, old)
    with pytest.raises(MovedFieldError, match=f"CheckpointConfig.{old} moved"):
        setattr(ck, old, 1)
    with pytest.raises(TypeError, match=f"CheckpointConfig.{old} moved"):
        CheckpointConfig.parse("every=1", **{old: 1})


def test_every_moved_field_is_gone_and_unknown_names_stay_plain_errors() -> None:
    fields = set(CheckpointConfig.__dataclass_fields__)
    assert not fields & set(MOVED)
    with pytest.raises(AttributeError) as e:
        CheckpointConfig().no_such_field  # noqa: B018
    assert not isinstance(e.value, MovedFieldError)


def test_groups_round_trip_and_are_checked() -> None:
    ck = CheckpointConfig(
        store=StoreConfig(root="/tmp/x", job_id="j", budget_bytes=123, keep_on_close=True),
        persist=PersistConfig(dir="/tmp/p", flush_on_sigterm=False),
        exchange=ExchangeConfig(paths="network", host_work="always", snapshot_copy="thread"),
        timeouts=TimeoutConfig(collective_s=5.0, flush_s=2.0),
    )
    ck.validate()
    assert CheckpointConfig.from_dict(json.loads(json.dumps(ck.to_dict()))) == ck
    cfg = TrainConfig(checkpoint=ck, inject=["kill:rank=1,iter=5"], max_restarts=7)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="use exchange=ExchangeConfig"):
        CheckpointConfig(exchange="network").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exchange paths must be auto or network"):
        CheckpointConfig(exchange=ExchangeConfig(paths="ib")).validate()
    with pytest.raises(ValueError, match="timeouts.collective_s=0"):
        CheckpointConfig(timeouts=TimeoutConfig(collective_s=0)).validate()
    with pytest.raises(ValueError, match="store.keep_on_close must be true or false"):
        CheckpointConfig(store=StoreConfig(keep_on_close="yes")).validate()  # type: ignore[arg-type]
