"""CheckpointPolicy validation/parsing and the cost model's exact arithmetic."""

from __future__ import annotations

import pytest

from baft.plan.cost import CostModel, cut_sizes, slot_bytes, tail_bytes
from baft.plan.types import BubbleMap, CheckpointPolicy, Slot, StateLayout, TaskKind, TensorSpec

MiB = 1 << 20


def test_policy_defaults_and_parse() -> None:
    p = CheckpointPolicy()
    assert (p.every, p.redundancy, p.persist_every, p.keep_latest, p.on_overflow) == (
        1,
        "xor:2",
        50,
        2,
        "spill",
    )
    q = CheckpointPolicy.parse("every=3, redundancy=rs:4+2,persist=0,keep=3,overflow=stretch")
    assert (q.every, q.redundancy, q.persist_every, q.keep_latest, q.on_overflow) == (
        3,
        "rs:4+2",
        0,
        3,
        "stretch",
    )
    assert CheckpointPolicy.parse("") == CheckpointPolicy()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("every=0", "every=0 must be >= 1"),
        ("redundancy=raid5", "use none, replicate:k, xor:g or rs:k"),
        ("overflow=drop", "use 'spill' or 'stretch'"),
        ("speed=3", "keys every, redundancy"),
        ("every=two", "not a valid int"),
        ("persist=-1", "persist_every=-1"),
        ("max_chunk=100,min_chunk=60", "max_chunk_bytes=100 must be >= 2"),
    ],
)
def test_policy_errors_name_the_fix(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointPolicy.parse(text)


def test_layout_and_bubble_helpers() -> None:
    lay = StateLayout(
        rank=0,
        tensors=(TensorSpec(name="a", nbytes=3), TensorSpec(name="b", nbytes=5)),
        replicas=(0,),
    )
    assert lay.nbytes == 8
    bm = BubbleMap(
        rank=0,
        slots=(
            Slot(slot_id="w0", idle_s=0.25),
            Slot(slot_id="pre_step", idle_s=0.5, kind="pre_step"),
        ),
        iteration_s=2.0,
    )
    assert bm.capacity_s() == 0.75


def test_cost_seconds_exact() -> None:
    c = CostModel(
        copy_Bps=2.0**20,
        net_Bps=2.0**19,
        encode_Bps=2.0**21,
        persist_Bps=2.0**18,
        task_overhead_s=0.25,
    )
    assert c.seconds(TaskKind.SNAPSHOT, MiB) == 1.25
    assert c.seconds(TaskKind.SEND, MiB) == 2.25
    assert c.seconds(TaskKind.RECV, MiB) == 2.25
    assert c.seconds(TaskKind.ENCODE, MiB) == 0.75
    assert c.seconds(TaskKind.PERSIST, MiB) == 4.25
    assert c.seconds(TaskKind.SNAPSHOT, 0) == 0.0
    assert c.per_byte_s(TaskKind.SNAPSHOT, MiB) == 2.0**-20 + 0.25 / MiB


def test_cost_validation_and_measurements() -> None:
    with pytest.raises(ValueError, match="copy_Bps=0"):
        CostModel(copy_Bps=0)
    c = CostModel.from_measurements({"copy_Bps": 5e9, "hash_Bps": 1.0, "interference": 0.4})
    assert (c.copy_Bps, c.interference, c.net_Bps) == (5e9, 0.4, 1e9)


def test_slot_bytes_full_chunks_and_remainder() -> None:
    rate, o, mx, mn = 2.0**20, 0.25, MiB, 64 << 10
    # 1 full chunk costs 1.25 s; 3 s hold 2 full chunks (2.5 s) + 0.5 s -> 0.25 s of bytes.
    assert slot_bytes(3.0, rate, o, mx, mn) == 2 * MiB + MiB // 4
    # remainder below min but a full chunk present: still usable (last two cut evenly)
    assert slot_bytes(1.25 + 0.25 + 0.01, rate, o, mx, mn) == MiB + int(0.01 * rate)
    # no full chunk and remainder below min: nothing
    assert slot_bytes(0.25 + 0.01, rate, o, mx, mn) == 0
    assert slot_bytes(0.0, rate, o, mx, mn) == 0
    assert tail_bytes(0.26, rate, o) == 10485  # int(0.01 s * 1 MiB/s)


def test_cut_sizes() -> None:
    assert cut_sizes(0, 10, 3) == []
    assert cut_sizes(7, 10, 3) == [7]
    assert cut_sizes(2, 10, 3) == [2]
    assert cut_sizes(25, 10, 3) == [10, 10, 5]
    assert cut_sizes(21, 10, 3) == [10, 6, 5]
    assert cut_sizes(30, 10, 3) == [10, 10, 10]
