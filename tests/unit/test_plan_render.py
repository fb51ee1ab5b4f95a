"""Plan rendering: exact text table, task summaries and JSON-ready dicts."""

from __future__ import annotations

import json

from baft.plan import CheckpointPolicy, CostModel, plan, plan_table, plan_to_dict
from baft.plan.render import bubble_table, bubbles_to_dict, fmt_bytes, summarize_tasks
from baft.plan.types import BubbleMap, Slot, StateLayout, Task, TaskKind, TensorSpec

MiB = 1 << 20
UNIT = CostModel(copy_Bps=2.0**20, net_Bps=2.0**20, task_overhead_s=0.0)


def instance() -> tuple[dict, dict]:
    slots = (
        Slot(slot_id="w0", idle_s=1.5),
        Slot(slot_id="w1", idle_s=0.0),
        Slot(slot_id="pre_step", idle_s=0.5, kind="pre_step"),
    )
    bubbles = {0: BubbleMap(rank=0, slots=slots, iteration_s=10.0)}
    layouts = {
        0: StateLayout(rank=0, tensors=(TensorSpec(name="w", nbytes=3 * MiB),), replicas=(0,))
    }
    return bubbles, layouts


def test_plan_table_exact_text() -> None:
    bubbles, layouts = instance()
    policy = CheckpointPolicy(max_chunk_bytes=MiB, min_chunk_bytes=1024, persist_every=0)
    p = plan(bubbles, layouts, UNIT, policy, transfers={0: ((3, MiB // 2),)})
    text = plan_table(p, bubbles)
    assert text.splitlines() == [
        "checkpoint every 1 iteration(s); predicted exposed 1500.000 ms/iter "
        "(lower bound 1500.000 ms)",
        "",
        "rank 0: owns bytes 0..3145728 (3.0 MiB, 4 chunks); exposed 1500.000 ms/iter",
        "  slot      kind       idle ms   work ms      bytes  tasks",
        "  w0        p2p       1500.000  1500.000    1.5 MiB  snapshot x2 (c0-c1)",
        "  w1        p2p          0.000     0.000",
        "  pre_step  pre_step   500.000   500.000  512.0 KiB  send x1 ->3 lag1",
        "  spill     sync                1500.000    1.5 MiB  snapshot x2 (c2-c3)",
    ]
    assert "sends 512.0 KiB in 1 pieces (1 in the next iteration), spills 1.5 MiB" in p.reason


def test_summaries_and_json() -> None:
    tasks = (
        Task(kind=TaskKind.SNAPSHOT, chunk_id=4, nbytes=1, est_s=0.1),
        Task(kind=TaskKind.SNAPSHOT, chunk_id=5, nbytes=1, est_s=0.1),
        Task(kind=TaskKind.SEND, chunk_id=0, nbytes=1, est_s=0.1, lag=1, stream=1),
    )
    assert summarize_tasks(tasks, (9, 17)) == "snapshot x2 (c4-c5), send x1 ->17 lag1"
    assert summarize_tasks(tasks) == "snapshot x2 (c4-c5), send x1 lag1"
    assert (
        fmt_bytes(0) == "0 B" and fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(3 << 30) == "3.0 GiB"
    )
    bubbles, layouts = instance()
    p = plan(bubbles, layouts, UNIT, CheckpointPolicy(max_chunk_bytes=MiB, min_chunk_bytes=1024))
    d = json.loads(json.dumps(plan_to_dict(p)))
    assert d["interval_iters"] == 1 and d["ranks"]["0"]["owned"][0] == [0, 0, MiB]
    assert d["ranks"]["0"]["tasks"]["w0"][0]["kind"] == "snapshot"
    b = json.loads(json.dumps(bubbles_to_dict(bubbles)))
    assert b["0"]["capacity_s"] == 2.0 and b["0"]["slots"][2]["kind"] == "pre_step"
    assert (
        bubble_table(bubbles)
        == "rank 0: iteration 10000.0 ms, idle 2000.0 ms in 2 slots: w0=1500.00 pre_step=500.00"
    )
