"""Refusals (no restart can cure them) are told apart from failures (a restart may)."""

from __future__ import annotations

from baft.errors import Refusal, is_refusal, refusal
from baft.recover.coordinator import TopologyMismatchError
from baft.recover.differential import RestoreError
from baft.recover.identity import ShardIdentityError


def test_refusals_are_marked_and_failures_are_not() -> None:
    assert is_refusal(refusal(RestoreError("refusing to start over silently")))
    assert is_refusal(TopologyMismatchError("pp=2 then, pp=4 now"))
    assert is_refusal(ShardIdentityError("0.weight: shape (4,) then, (8,) now"))
    marked = refusal(ValueError("the state was saved with optimizer AdamW, this run uses Adam"))
    assert is_refusal(marked) and type(marked) is ValueError  # the type users catch
    assert not is_refusal(RestoreError("rank 1: cannot read store"))  # a restart may help
    assert not is_refusal(RuntimeError("Connection closed by peer"))
    assert not is_refusal(ValueError("a ValueError of the user's own"))


def test_a_refusal_raised_from_is_a_refusal() -> None:
    try:
        try:
            raise ShardIdentityError("changed model")
        except ValueError as inner:
            raise RuntimeError("restore failed") from inner
    except RuntimeError as outer:
        assert is_refusal(outer)
    assert isinstance(Refusal(), Exception)
