"""The configuration x fault matrix (issue 28): every pair of user-visible choices meets
every fault at least once, each case ending bit-identical to the unprotected run.

Cases come from :mod:`tests.e2e.matrix` (deterministic greedy all-pairs over app x
layout x schedule x full_every x redundancy x persist x hosts x launch x fault, 40
cases); each launches the job with torchrun as a user would (``launch``: under ``-m
baft.inprocess``, the default, or the plain group restart), delivers the fault from
outside at a seeded random moment (kill -9 of a training process, node loss with its
store wiped (the node without rank 0, or rank 0's), power loss and relaunch, SIGTERM
flush and relaunch, kill -STOP of a training process) and compares losses and every
rank's final state with the same training without baft. Kill, node loss and hang must
recover from memory; under ``inprocess`` kill and hang in-process (the survivors keep
their processes), while a lost node may fall back to the group restart; a watchdog
names no rank but the one killed or frozen; power loss and SIGTERM from DCP (power loss
without DCP must refuse loudly). A failing case prints the commands that reproduce it.

``test_smoke`` (default suite) runs :data:`~tests.e2e.matrix.SMOKE`; ``test_pairwise`` is
the slow tier. ``BAFT_MATRIX_CASE=<id>`` runs one case by id, any id of the cross product
(``.venv/bin/pytest tests/e2e/test_matrix.py -k test_case``).
"""

from __future__ import annotations

import os
from itertools import combinations, product
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import jobs
from tests.e2e.matrix import DIMENSIONS, REQUIRED, SMOKE, Case, from_id, pairwise, valid

pytestmark = pytest.mark.timeout(900)

_REFERENCES: dict[tuple[str, str, str], dict[str, Any]] = {}


def _reference(case: Case, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The unprotected run of the case's training (shared by cases that train the same)."""
    key = (case.app, case.layout, case.schedule)
    if key not in _REFERENCES:
        _REFERENCES[key] = jobs.reference(case, tmp_path_factory.mktemp("ref"))
    return _REFERENCES[key]


def _run(case: Case, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    ref = _reference(case, tmp_path_factory)
    problems, described = jobs.run_case(case, tmp_path, ref)
    if problems:
        pytest.fail(f"case {case.id}: " + "\n".join(problems) + f"\n{described}", pytrace=False)


def test_pairwise_covers_every_pair_of_every_valid_case() -> None:
    """The generator's contract (pure, about a second): deterministic, valid cases only,
    and every pair of values that some valid case holds is in some chosen case."""
    cases = pairwise()
    assert cases == pairwise.__wrapped__()  # the same list when computed again
    assert len(cases) == 40 and len(set(cases)) == 40
    assert all(valid(c) for c in cases) and all(from_id(c.id) == c for c in cases)
    names = list(DIMENSIONS)

    def pairs(c: Case) -> set[tuple[str, str, str, str]]:
        return {(x, getattr(c, x), y, getattr(c, y)) for x, y in combinations(names, 2)}

    every = [Case(*v) for v in product(*DIMENSIONS.values())]
    wanted = set().union(*(pairs(c) for c in every if valid(c)))
    assert set().union(*(pairs(c) for c in cases)) == wanted
    # what valid() rules out is what the user script cannot do (TP, several stages a rank)
    assert ("app", "user-repeated", "layout", "pp2tp2") not in wanted
    # a lost host of a two-agent job, rank 0's and the other, under either launch
    lost = {(c.launch, c.fault) for c in cases if c.hosts != "one"}
    assert set(REQUIRED) <= lost
    assert {launch for launch, fault in REQUIRED if fault == "node0"} == set(DIMENSIONS["launch"])


def test_smoke_cells() -> None:
    """The default suite's cells are valid, mostly the default (in-process) launch, one
    killed from outside among them, and keep the group restart."""
    assert all(valid(c) and from_id(c.id) == c for c in SMOKE)
    inprocess = [c for c in SMOKE if c.launch == "inprocess"]
    assert len(inprocess) >= 3 and any(c.fault == "kill" for c in inprocess)
    assert any(c.launch == "group" for c in SMOKE)
    assert DIMENSIONS["launch"][0] == "inprocess"


@pytest.mark.parametrize("case", SMOKE, ids=lambda c: c.id)
def test_smoke(case: Case, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    _run(case, tmp_path, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", pairwise(), ids=lambda c: c.id)
def test_pairwise(case: Case, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    _run(case, tmp_path, tmp_path_factory)


@pytest.mark.skipif("BAFT_MATRIX_CASE" not in os.environ, reason="set BAFT_MATRIX_CASE=<id>")
def test_case(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One case by id (what a failing case's message says to run)."""
    _run(from_id(os.environ["BAFT_MATRIX_CASE"]), tmp_path, tmp_path_factory)
