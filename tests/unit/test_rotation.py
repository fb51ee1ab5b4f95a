"""Rotation of full-state slices: assignment, windows, rebuildability, choice of K."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from baft.plan.rotation import (
    TensorGroup,
    assign_slices,
    base_version,
    choose_full_every,
    has_record,
    newest_rebuildable,
    payload_nbytes,
    rebuildable,
    retained_nbytes,
    slice_for_version,
    slice_nbytes,
    slices_in_payload,
    window,
)


def _groups(*sizes: int) -> list[TensorGroup]:
    return [TensorGroup(name=f"g{i}", nbytes=n) for i, n in enumerate(sizes)]


def test_assign_slices_greedy_largest_first() -> None:
    groups = _groups(10, 40, 30, 20, 5)
    # 40 -> s0, 30 -> s1, 20 -> s2, 10 -> s2 (20 < 30), 5 -> s1 (30 < 40 and 30)
    assert assign_slices(groups, 3) == (2, 0, 1, 2, 1)
    assert slice_nbytes(groups, assign_slices(groups, 3), 3) == (40, 35, 30)


def test_assign_slices_k1_and_ties_are_deterministic() -> None:
    groups = _groups(7, 7, 7, 7)
    assert assign_slices(groups, 1) == (0, 0, 0, 0)
    assert assign_slices(groups, 2) == (0, 1, 0, 1)
    assert assign_slices(groups, 2) == assign_slices(list(groups), 2)


def test_assign_slices_zero_byte_groups_still_fill_every_slice() -> None:
    groups = _groups(0, 0, 0, 8)
    a = assign_slices(groups, 4)
    assert sorted(a) == [0, 1, 2, 3]


def test_assign_slices_more_slices_than_groups_and_errors() -> None:
    assert assign_slices(_groups(3, 5), 4) == (1, 0)
    assert assign_slices([], 3) == ()
    with pytest.raises(ValueError, match=">= 1"):
        assign_slices(_groups(1), 0)
    with pytest.raises(ValueError, match="unique"):
        assign_slices([TensorGroup("a", 1), TensorGroup("a", 2)], 2)
    with pytest.raises(ValueError, match=">= 0"):
        assign_slices(_groups(-1), 1)


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.integers(1, 12))
def test_assign_slices_properties(sizes: list[int], k: int) -> None:
    groups = _groups(*sizes)
    a = assign_slices(groups, k)
    assert all(0 <= j < k for j in a)
    if k <= len(groups):
        assert set(a) == set(range(k))
    loads = slice_nbytes(groups, a, k)
    assert sum(loads) == sum(sizes)
    # LPT bound: no slice exceeds the mean by more than the largest group
    assert max(loads) <= sum(sizes) / k + max(sizes)


def test_slice_for_version_and_payload_contents() -> None:
    assert [slice_for_version(v, 3) for v in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert slices_in_payload(5, 3, first_version=5) == (2,)
    assert slices_in_payload(5, 3, first_version=5, anchor=True) == (0, 1, 2)
    assert slices_in_payload(6, 3, first_version=5, anchor=True) == (0,)
    assert not has_record(5, 3, first_version=5)
    assert has_record(6, 3, first_version=5)
    assert not has_record(6, 1, first_version=5)  # k=1: full snapshots, no record
    with pytest.raises(ValueError, match="older than first_version"):
        slices_in_payload(4, 3, first_version=5)


def test_base_version_and_window_without_an_anchor() -> None:
    k = 3
    assert [base_version(j, 7, k) for j in range(k)] == [6, 7, 5]
    assert list(window(7, k)) == [5, 6, 7]
    # version 1 of a fresh run: slice 2 has no copy yet, so nothing is rebuildable
    assert [base_version(j, 1, k) for j in range(k)] == [0, 1, None]
    with pytest.raises(ValueError, match="completes at version 2"):
        window(1, k)
    assert list(window(2, k)) == [0, 1, 2]
    # a rotation started at 10 (after a restore from DCP) completes at 12
    assert [base_version(j, 11, k, first_version=10) for j in range(k)] == [None, 10, 11]
    assert list(window(12, k, first_version=10)) == [10, 11, 12]
    assert list(window(9, 1)) == [9]


def test_base_version_and_window_with_an_anchor() -> None:
    k = 3
    # version 1: slice 0 at 0 (the anchor holds every slice), slice 1 at 1, slice 2 anchor
    assert [base_version(j, 1, k, anchor=True) for j in range(k)] == [0, 1, 0]
    assert list(window(1, k, anchor=True)) == [0, 1]
    assert [base_version(j, 10, k, first_version=10, anchor=True) for j in range(k)] == [10] * 3
    assert [base_version(j, 11, k, first_version=10, anchor=True) for j in range(k)] == [
        10,
        10,
        11,
    ]
    assert list(window(11, k, first_version=10, anchor=True)) == [10, 11]
    assert list(window(20, k, first_version=10, anchor=True)) == [18, 19, 20]


@given(st.integers(0, 50), st.integers(0, 30), st.integers(1, 9), st.booleans())
def test_window_is_exactly_what_the_bases_need(
    first: int, offset: int, k: int, anchor: bool
) -> None:
    v = first + offset
    if not rebuildable(v, k, first, anchor=anchor):
        assert not anchor and v < first + k - 1
        assert any(base_version(j, v, k, first) is None for j in range(k))
        return
    bases = [base_version(j, v, k, first, anchor=anchor) for j in range(k)]
    for j, b in enumerate(bases):
        assert b is not None and first <= b <= v
        assert b % k == j or (anchor and b == first)
        # the copy taken at b is carried by payload b, and no newer payload refreshes j
        assert j in slices_in_payload(b, k, first, anchor=anchor)
        later = range(b + 1, v + 1)
        assert all(j not in slices_in_payload(u, k, first, anchor=anchor) for u in later)
    # window = the oldest base .. v: slices at the bases plus records b+1..v (steps b..v-1)
    oldest = min(b for b in bases if b is not None)
    assert window(v, k, first, anchor=anchor) == range(oldest, v + 1)
    assert k == 1 or all(has_record(u, k, first) for u in range(oldest + 1, v + 1))


def test_rebuildable_needs_a_whole_rotation_and_the_whole_window() -> None:
    assert not rebuildable(0, 4) and not rebuildable(2, 4) and rebuildable(3, 4)
    assert rebuildable(0, 4, anchor=True) and rebuildable(0, 1)
    assert not rebuildable(3, 4, first_version=5, anchor=True)
    committed = {3, 4, 5, 6, 7}
    assert rebuildable(7, 4, available=committed)
    assert not rebuildable(7, 4, available=committed - {5})
    assert not rebuildable(7, 4, first_version=6, available={6, 7})
    assert rebuildable(7, 4, first_version=6, available={6, 7}, anchor=True)
    assert newest_rebuildable({0, 1, 2, 4, 5, 6}, 3) == 6  # 6 needs 4..6 only
    assert newest_rebuildable({0, 1, 2, 4, 6}, 3) == 2  # 6 needs 5, 4 needs 3
    assert newest_rebuildable({0, 1, 2, 3, 4, 6}, 3) == 4
    assert newest_rebuildable({0, 1}, 3) is None  # the first rotation is not complete
    assert newest_rebuildable({0, 1}, 3, anchor=True) == 1
    assert newest_rebuildable({5}, 3) is None  # needs 3, 4
    assert newest_rebuildable({5}, 3, first_version=5, anchor=True) == 5


def test_payload_and_retained_bytes() -> None:
    assert payload_nbytes(100, (1000,)) == 1000  # k=1: no record
    assert payload_nbytes(100, (400, 350, 250)) == 500
    assert retained_nbytes(100, (1000,)) == 2000
    # k+1 payloads: 1000 + 400 + 4*100 = 1800; padded: 4 * 500
    assert retained_nbytes(100, (400, 350, 250)) == 1800
    assert retained_nbytes(100, (400, 350, 250), padded=True) == 2000
    # right after an anchor: 2000 + 3*100 = 2300
    assert retained_nbytes(100, (400, 350, 250), anchor=True) == 2300
    # large record: steady 1000 + 400 + 4*1000 = 5400 > 2000 + 3*1000
    assert retained_nbytes(1000, (400, 350, 250), anchor=True) == 5400


def test_choose_full_every_smallest_k_that_fits() -> None:
    groups = [100] * 8  # 800 bytes of state, record 50
    k, reason = choose_full_every(50, groups, capacity_nbytes_per_iter=1000)
    assert (k, reason.startswith("full_every=1: the whole state")) == (1, True)
    k, reason = choose_full_every(50, groups, capacity_nbytes_per_iter=300)
    # k=2: 50 + 400; k=3: 50 + 300 (slices 300/300/200) = 350; k=4: 50 + 200 = 250
    assert k == 4
    assert "250 B per iteration fits" in reason and "k=3 needs 350 B" in reason


def test_choose_full_every_spills_with_the_least_bytes() -> None:
    k, reason = choose_full_every(500, [100, 100, 100], capacity_nbytes_per_iter=200)
    # k=1: 300, k=2: 700, k=3: 600 -> the whole state is the least
    assert k == 1
    assert "spills" in reason and "100 B spills" in reason
    k, _ = choose_full_every(10, [1000, 10, 10], capacity_nbytes_per_iter=5, max_k=3)
    assert k == 2  # k=2 and k=3 both need 1010; the smaller k wins


def test_choose_full_every_memory_budget() -> None:
    groups = [100] * 8
    # capacity alone picks k=4 (250 B); with an anchor its store needs
    # max(800 + 200 + 5*50, 1600 + 4*50) = 1800, without one 1250
    sizes4 = slice_nbytes(_groups(*groups), assign_slices(_groups(*groups), 4), 4)
    assert retained_nbytes(50, sizes4, anchor=True) == 1800
    assert retained_nbytes(50, sizes4) == 1250
    assert choose_full_every(50, groups, 300, memory_budget_nbytes=1250)[0] == 4
    assert choose_full_every(50, groups, 300, memory_budget_nbytes=1800, anchor=True)[0] == 4
    # anchor, 1700: k=1 (1600) and k=2 (1700) stay; neither fits 300 B, k=2 (450 B) least
    k, reason = choose_full_every(50, groups, 300, memory_budget_nbytes=1700, anchor=True)
    assert k == 2
    assert "150 B spills" in reason and "refused by the memory budget" in reason
    k, reason = choose_full_every(50, groups, 300, memory_budget_nbytes=1000)
    assert k == 1 and "refused" in reason
    assert choose_full_every(0, [], 10) == (1, "no tensors to protect: full_every=1")
