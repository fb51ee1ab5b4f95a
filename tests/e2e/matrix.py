"""The configuration x fault matrix, generated (pure: no processes, no files).

Dimensions a user controls, crossed with the faults that come from outside. Every case
is one cell; :func:`pairwise` picks a deterministic set of valid cases in which every
pair of values of any two dimensions appears at least once, and so does each host loss
of :data:`REQUIRED` in a job of two agents (greedy all-pairs over the valid cases: no
randomness, the same list on every machine). :data:`SMOKE` is the handful the default
suite runs.

``launch`` is how the job runs: ``inprocess`` (the default a user gets: ``torchrun ... -m
baft.inprocess``, ``baft train``), where a per-rank supervisor replaces a failed training
process while the others re-enter ``main()``, or ``group`` (torchrun restarts every
process, ``baft train --no-inprocess``).
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, fields
from functools import cache

LAYOUTS = {  # name -> (dp, pp, tp)
    "pp2": (1, 2, 1),
    "pp4": (1, 4, 1),
    "dp2pp2": (2, 2, 1),
    "pp2tp2": (1, 2, 2),
    "dp2pp2tp2": (2, 2, 2),
    "pp2dps2": (1, 2, 1),  # x dp_shard=2 (DP_SHARD): `baft train --dp-shard 2`, FSDP2 stages
}
DP_SHARD = {"pp2dps2": 2}
"""FSDP2 degree of a layout (1 when absent): ``baft train --dp-shard``, gpt only."""
DIMENSIONS: dict[str, tuple[str, ...]] = {
    # gpt: `baft train`'s reference GPT (stage FQNs unique); user-*: tests/e2e/user_script.py,
    # a fresh nn.Sequential per stage (FQNs repeat across stages) or wrapped as stage{s}.
    # fsdp2: examples/fsdp2_pipeline.py, torchtitan-shaped (unique FQNs, FSDP2 over the
    # layout's dp as dp_shard, TP inside blocks when tp > 1)
    "app": ("gpt", "user-repeated", "user-unique", "fsdp2"),
    "layout": tuple(LAYOUTS),
    "schedule": ("gpipe", "1f1b", "interleaved-1f1b"),
    "full_every": ("1", "3", "auto"),
    "redundancy": ("xor", "rs", "replicate"),
    "persist": ("on", "off"),
    # one: one torchrun agent, two declared nodes; hostid / nohostid: two agents (one per
    # declared node, own store roots) with / without BAFT_HOST_ID
    "hosts": ("one", "hostid", "nohostid"),
    # inprocess first: the default launch
    "launch": ("inprocess", "group"),
    # node: the declared node / host without rank 0 lost; node0: rank 0's (under
    # inprocess its supervisor hosts the control store)
    "fault": ("kill", "node", "node0", "power", "sigterm", "hang"),
}
REDUNDANCY = {"xor": "xor:2", "rs": "rs:1+1", "replicate": "replicate:1"}
"""Spellings: every case has two failure domains (declared nodes)."""


@dataclass(frozen=True, slots=True)
class Case:
    app: str
    layout: str
    schedule: str
    full_every: str
    redundancy: str
    persist: str
    hosts: str
    launch: str
    fault: str

    @property
    def id(self) -> str:
        return "-".join(getattr(self, f.name) for f in fields(self))

    @property
    def dims(self) -> tuple[int, int, int]:
        return LAYOUTS[self.layout]

    @property
    def dp_shard(self) -> int:
        return DP_SHARD.get(self.layout, 1)

    @property
    def world(self) -> int:
        dp, pp, tp = self.dims
        return dp * self.dp_shard * pp * tp

    @property
    def seed(self) -> int:
        """Drives the fault's moment and victim: stable per case id."""
        return zlib.crc32(self.id.encode())


def valid(case: Case) -> bool:
    """The user script is pipeline x data parallel, one stage per rank; the FSDP2 example
    shards over dp (> 1), with or without TP, one stage per rank; a dp_shard layout is
    the reference app's (``baft train --dp-shard``: the example's own dp is its shard)."""
    if case.dp_shard > 1 and case.app != "gpt":
        return False
    if case.app == "fsdp2":
        return case.dims[0] > 1 and case.schedule != "interleaved-1f1b"
    if case.app != "gpt":
        return case.dims[2] == 1 and case.schedule != "interleaved-1f1b"
    return True


def from_id(case_id: str) -> Case:
    values = case_id.split("-")
    # app values contain a dash ("user-repeated"), schedule may ("interleaved-1f1b")
    if values[0] == "user":
        values = [f"{values[0]}-{values[1]}", *values[2:]]
    if values[2] == "interleaved":
        values = [*values[:2], f"{values[2]}-{values[3]}", *values[4:]]
    names = [f.name for f in fields(Case)]
    if len(values) != len(names):
        raise ValueError(f"case id {case_id!r}: want {'-'.join(names)}")
    case = Case(*values)
    for name, value in zip(names, values, strict=True):
        if value not in DIMENSIONS[name]:
            raise ValueError(f"case id {case_id!r}: {name}={value!r} not one of {DIMENSIONS[name]}")
    return case


REQUIRED = tuple((launch, fault) for launch in DIMENSIONS["launch"] for fault in ("node", "node0"))
"""Beyond pairs: a host lost (its agent, every process under it and its store) in a job
of two agents, for each launch and for either host, rank 0's included."""


def coverage(case: Case) -> set[tuple[str, ...]]:
    """What ``case`` covers: every pair of (dimension, value)s, and the :data:`REQUIRED`
    host loss it is."""
    names = list(DIMENSIONS)
    out: set[tuple[str, ...]] = {
        (x, getattr(case, x), y, getattr(case, y)) for x, y in itertools.combinations(names, 2)
    }
    if case.hosts != "one" and (case.launch, case.fault) in REQUIRED:
        out.add(("two-agent host loss", case.launch, case.fault))
    return out


@cache
def pairwise() -> tuple[Case, ...]:
    """Greedy all-pairs: repeatedly take the valid case that covers the most items (pairs,
    :data:`REQUIRED` host losses) not yet covered (the first in enumeration order on
    ties) until every item that some valid case holds is covered."""
    candidates = [Case(*values) for values in itertools.product(*DIMENSIONS.values())]
    candidates = [c for c in candidates if valid(c)]
    bit: dict[tuple[str, ...], int] = {}
    covers = []  # each candidate's items as a bit set
    for c in candidates:
        mask = 0
        for item in coverage(c):
            mask |= 1 << bit.setdefault(item, len(bit))
        covers.append(mask)
    todo = (1 << len(bit)) - 1
    chosen: list[Case] = []
    while todo:
        best = max(range(len(candidates)), key=lambda k: (covers[k] & todo).bit_count())
        chosen.append(candidates[best])
        todo &= ~covers[best]
    return tuple(chosen)


SMOKE = (
    # `baft train`'s default launch, a training process kill -9ed from outside: replaced
    # in-process, the survivors keep their pids
    Case("gpt", "dp2pp2", "1f1b", "1", "xor", "off", "one", "inprocess", "kill"),
    Case("user-unique", "pp2", "gpipe", "3", "replicate", "on", "one", "group", "power"),
    # rank 0's host lost under in-process recovery (its supervisor hosts the control
    # store): the group restarts when the replacement host joins, restored from memory
    Case("gpt", "pp2", "interleaved-1f1b", "1", "rs", "off", "hostid", "inprocess", "node0"),
    # a differential restore from memory that replays the user script's SGD-nesterov
    # records in restarted processes, two agents without host ids (exited 0 with wrong
    # momentum before 0fce952)
    Case("user-unique", "pp2", "1f1b", "3", "rs", "off", "nohostid", "group", "kill"),
    # FSDP2 x PP (issue 30): local shards restored with differential versions by default,
    # the survivors re-entering main() in their processes
    Case("fsdp2", "dp2pp2", "1f1b", "auto", "xor", "off", "one", "inprocess", "kill"),
    # `baft train --dp-shard 2 --pp 2` (issue 30): the reference app's FSDP2 stages, local
    # shards restored from memory after kill -9 of a training process
    Case("gpt", "pp2dps2", "1f1b", "auto", "xor", "off", "one", "inprocess", "kill"),
)
"""The default suite's cells: each fault path of a different kind, four of them under
the default in-process launch and two under torchrun's group restart."""
