"""Fault spec grammar: parsing, normalised round trip, targeting, records (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from baft.faults.spec import (
    GRAMMAR,
    KINDS,
    POINTS,
    FaultRecord,
    FaultSpec,
    parse_records,
    parse_specs,
)
from baft.topology import Topology

TOPO = Topology(num_pp=2, num_dp=2, ranks_per_node=2)  # nodes: {0, 1}, {2, 3}


@pytest.mark.parametrize(
    ("text", "fields", "normal"),
    [
        ("kill:rank=1,iter=7", dict(kind="kill", rank=1, iteration=7, point="step"), None),
        (
            "kill:1,iter=7,at=snapshot",
            dict(rank=1, point="snapshot"),
            "kill:rank=1,iter=7,at=snapshot",
        ),
        (" kill : rank = 3 , iter = 0 ", dict(rank=3, iteration=0), "kill:rank=3,iter=0"),
        ("node:1,iter=12", dict(kind="node", node=1, rank=None, iteration=12), None),
        ("node:node=1,iter=12,at=step", dict(node=1), "node:1,iter=12"),
        (
            "node:iter=3,node=0,at=recovery",
            dict(node=0, point="recovery"),
            "node:0,iter=3,at=recovery",
        ),
        ("corrupt:rank=1,iter=5", dict(kind="corrupt", target="data"), None),
        (
            "corrupt:rank=1,iter=5,target=red",
            dict(target="redundancy"),
            "corrupt:rank=1,iter=5,target=redundancy",
        ),
        ("delete:rank=2,iter=5,at=transfer", dict(kind="delete", rank=2, point="transfer"), None),
        ("power:iter=20", dict(kind="power", rank=None, node=None, iteration=20), None),
        ("power:iter=20,at=persist", dict(point="persist"), None),
        ("hang:rank=1,iter=9,at=iteration", dict(kind="hang", point="iteration"), None),
        ("slow:rank=1,iter=9,s=0.5", dict(kind="slow", seconds=0.5, num_iters=1), None),
        (
            "slow:rank=1,iter=9,s=2.0,iters=3",
            dict(seconds=2.0, num_iters=3),
            "slow:rank=1,iter=9,s=2,iters=3",
        ),
        ("slow:0,iters=1,s=1e-3,iter=4", dict(rank=0, seconds=0.001), "slow:rank=0,iter=4,s=0.001"),
    ],
)
def test_parse_good(text: str, fields: dict, normal: str | None):
    spec = FaultSpec.parse(text)
    for key, value in fields.items():
        assert getattr(spec, key) == value, key
    assert str(spec) == (normal or text)
    assert spec.spec_id == str(spec)
    assert spec.text == text.strip()
    again = FaultSpec.parse(str(spec))
    assert again == spec and again.spec_id == spec.spec_id


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "unknown kind ''"),
        ("explode:rank=1,iter=2", "unknown kind 'explode'"),
        ("kill", "kill needs rank, iter"),
        ("kill:rank=1", "kill needs iter"),
        ("kill:iter=3", "kill needs rank"),
        ("node:iter=3", "node needs node"),
        ("slow:rank=1,iter=2", "slow needs s"),
        ("kill:rank=-1,iter=2", "rank=-1 must be >= 0"),
        ("kill:rank=1,iter=-2", "iter=-2 must be >= 0"),
        ("slow:rank=1,iter=2,s=-0.5", "s=-0.5 must be a finite number >= 0"),
        ("slow:rank=1,iter=2,s=nan", "finite"),
        ("slow:rank=1,iter=2,s=1,iters=0", "iters=0 must be >= 1"),
        ("kill:rank=one,iter=2", "rank='one' is not an integer"),
        ("kill:rank=1.5,iter=2", "not an integer"),
        ("slow:rank=1,iter=2,s=fast", "not a number of seconds"),
        ("kill:rank=1,iter=2,at=lunch", "at='lunch' is not one of iteration, snapshot"),
        ("corrupt:rank=1,iter=2,target=parity", "target='parity' is not one of data, redundancy"),
        ("kill:rank=1,iter=2,target=data", "kill takes keys rank, iter, at, not 'target'"),
        ("slow:rank=1,iter=2,s=1,at=step", "not 'at'"),
        ("power:rank=1,iter=2", "not 'rank'"),
        ("power:3,iter=2", "'3' needs the form key=value"),
        ("kill:rank=1,2", "'2' needs the form key=value"),
        ("kill:rank=1,iter=2,rank=3", "rank given twice"),
        ("kill:1,rank=1,iter=2", "rank given twice"),
        ("kill:rank=,iter=2", "rank has no value"),
        ("kill:rank=1,,iter=2", "needs the form key=value"),
    ],
)
def test_parse_bad_says_why_and_shows_grammar(text: str, match: str):
    with pytest.raises(ValueError, match=match) as err:
        FaultSpec.parse(text)
    assert GRAMMAR in str(err.value)


def test_parse_rejects_non_string():
    with pytest.raises(ValueError, match="a fault spec is a string"):
        FaultSpec.parse(7)  # type: ignore[arg-type]


@st.composite
def specs(draw: st.DrawFn) -> FaultSpec:
    kind = draw(st.sampled_from(KINDS))
    iteration = draw(st.integers(0, 10**6))
    if kind == "slow":
        return FaultSpec(
            kind=kind,
            iteration=iteration,
            rank=draw(st.integers(0, 999)),
            seconds=draw(st.floats(0, 1e4, allow_nan=False, allow_infinity=False)),
            num_iters=draw(st.integers(1, 100)),
        )
    point = draw(st.sampled_from(POINTS))
    if kind == "node":
        node = draw(st.integers(0, 99))
        return FaultSpec(kind=kind, iteration=iteration, node=node, point=point)
    if kind == "power":
        return FaultSpec(kind=kind, iteration=iteration, point=point)
    target = draw(st.sampled_from(("data", "redundancy"))) if kind == "corrupt" else "data"
    rank = draw(st.integers(0, 999))
    return FaultSpec(kind=kind, iteration=iteration, rank=rank, point=point, target=target)


@given(specs())
def test_round_trip_property(spec: FaultSpec):
    again = FaultSpec.parse(str(spec))
    assert again == spec
    assert str(again) == str(spec)


def test_targets_rank_node_and_power():
    kill = FaultSpec.parse("kill:rank=1,iter=7")
    node = FaultSpec.parse("node:1,iter=7")
    power = FaultSpec.parse("power:iter=7")
    slow = FaultSpec.parse("slow:rank=3,iter=7,s=1")
    assert [r for r in range(4) if kill.targets(r, TOPO)] == [1]
    assert [r for r in range(4) if node.targets(r, TOPO)] == [2, 3]
    assert [r for r in range(4) if power.targets(r, TOPO)] == [0, 1, 2, 3]
    assert [r for r in range(4) if slow.targets(r, TOPO)] == [3]
    one_per_node = Topology(num_pp=2, num_dp=2, ranks_per_node=1)
    assert [r for r in range(4) if node.targets(r, one_per_node)] == [1]


def test_matches_point_and_first_iteration_at_or_after():
    kill = FaultSpec.parse("kill:rank=1,iter=7,at=snapshot")
    assert not kill.matches("snapshot", 6)
    assert kill.matches("snapshot", 7)
    assert kill.matches("snapshot", 9)  # first time reached after a later resume
    assert not kill.matches("step", 7)
    rec = FaultSpec.parse("hang:rank=0,iter=5,at=recovery")
    assert [i for i in range(8) if rec.matches("recovery", i)] == [5, 6, 7]
    slow = FaultSpec.parse("slow:rank=1,iter=9,s=0.5,iters=3")
    assert not any(slow.matches(p, 9) for p in POINTS)
    assert [i for i in range(15) if slow.slows(i)] == [9, 10, 11]
    assert not kill.slows(7)


def test_terminal_kinds():
    terminal = {k for k in KINDS if FaultSpec(kind=k, iteration=0, rank=0, node=0).terminal}
    assert terminal == {"kill", "node", "power", "hang", "freeze"}


def test_check_against_topology():
    FaultSpec.parse("kill:rank=3,iter=1").check(TOPO)
    FaultSpec.parse("node:1,iter=1").check(TOPO)
    with pytest.raises(ValueError, match=r"rank 4 does not exist; ranks are 0\.\.3"):
        FaultSpec.parse("kill:rank=4,iter=1").check(TOPO)
    with pytest.raises(ValueError, match=r"node 2 does not exist; nodes are 0\.\.1"):
        FaultSpec.parse("node:2,iter=1").check(TOPO)


def test_parse_specs_duplicates_and_topology():
    got = parse_specs(["kill:rank=1,iter=7", "node:1,iter=9"], TOPO)
    assert [str(s) for s in got] == ["kill:rank=1,iter=7", "node:1,iter=9"]
    assert parse_specs([]) == ()
    with pytest.raises(ValueError, match="repeats 'kill:rank=1,iter=7'"):
        parse_specs(["kill:rank=1,iter=7", "kill:1,iter=7,at=step"])
    with pytest.raises(ValueError, match="rank 9 does not exist"):
        parse_specs(["kill:rank=9,iter=7"], TOPO)
    assert parse_specs(["kill:rank=9,iter=7"])[0].rank == 9  # no topology: no range check


def test_record_json_round_trip_and_torn_lines():
    rec = FaultRecord(
        spec="kill:rank=1,iter=7", rank=1, time=1700000000.25, iteration=7, point="step"
    )
    line = rec.to_json()
    assert line == (
        '{"spec":"kill:rank=1,iter=7","rank":1,"time":1700000000.25,"iteration":7,"point":"step"}\n'
    )
    assert FaultRecord.from_json(line) == rec
    with pytest.raises(ValueError, match="not a fault record"):
        FaultRecord.from_json('{"spec": "x"}')
    text = line + "\n" + '{"spec":"kill:ra' + "\n" + line.replace('"rank":1', '"rank":2')
    assert [r.rank for r in parse_records(text)] == [1, 2]
