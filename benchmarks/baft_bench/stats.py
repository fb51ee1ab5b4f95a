"""Statistics of ``baft bench overhead``: the order of the modes in each round and
confidence intervals over rounds. Pure functions (numpy), no processes.

**Design.** Each round runs one block of every mode. The order of the modes per round
follows a Williams design (:func:`williams_design`): every round holds each mode once, and
over a full design (``n`` rounds for an even number of modes ``n``, ``2n`` for an odd one)
every mode is immediately preceded by every other mode equally often, so what a mode
inherits from its predecessor (page cache, allocator state, a neighbour's leftover work)
is spread evenly over all modes (first-order carry-over balance). Fewer rounds than a full
design, or a number that is not a multiple of it, leave the design unbalanced
(:func:`design_summary` says how much).

**Uncertainty.** The unit of measurement is the round: a mode's block and the reference's
block of the same round share the machine's load at that time. :func:`bootstrap_ci` gives
a percentile bootstrap interval of any statistic of per-round values: it resamples rounds
with replacement (within each launch when several launches are pooled, so every launch
keeps its number of rounds), seeded, ``RESAMPLES`` times. The statistics themselves
(:func:`median_of_ratios`, :func:`ratio_of_means`, :func:`ratio_of_medians`) work on the
resampled arrays, round axis second to last or last. A difference is *inside the noise*
(:func:`inside_noise`) when the interval of the ratio contains 1.0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

RESAMPLES = 2000
"""Bootstrap resamples per interval."""
SEED = 0
"""Seed of the bootstrap: the same rounds are drawn for every ratio, and reruns agree."""
LEVEL = 0.95
"""Coverage of the intervals."""


# ------------------------------------------------------------------ the design
def williams_design(n: int) -> list[list[int]]:
    """The rounds of a Williams design for ``n`` modes: one list per round, a permutation
    of ``range(n)`` each. ``n`` rounds for even ``n`` (one balanced Latin square), ``2n``
    for odd ``n`` (the square and its rows reversed); one round for ``n == 1``, none for
    ``n == 0``. Over all rounds each ordered pair of different modes occurs as immediate
    neighbours (a then b) once (even ``n``) or twice (odd ``n``)."""
    if n <= 1:
        return [list(range(n))] if n == 1 else []
    first, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: differences hit every residue
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [r[::-1] for r in rows]
    return rows


def design_rounds(n: int) -> int:
    """Rounds of one full Williams design for ``n`` modes (``n`` even, ``2n`` odd)."""
    return len(williams_design(n))


MIN_ROUNDS = 8
"""Rounds per launch by default at least: the default is the smallest whole number of full
designs that reaches it (8 for 2, 4 or 8 modes, 12 for 3, 18 for 9)."""


def default_rounds(n: int, requested: int | None = None) -> tuple[int, str | None]:
    """Rounds per launch for ``n`` modes and a note when they are not balanced.

    Without a request: the smallest multiple of the full design with at least
    :data:`MIN_ROUNDS` rounds (no note). With one: the request as it is, and a note
    (:func:`design_summary`) when it is not a whole number of full designs."""
    full = max(1, design_rounds(n))
    if requested is None:
        return full * -(-MIN_ROUNDS // full), None
    summary = design_summary(n, requested)
    return requested, None if summary["balanced"] or n < 2 else summary["note"]


def round_order(modes: Sequence[str], round_index: int) -> list[str]:
    """The order of ``modes`` in round ``round_index`` (the design repeats after a full
    design)."""
    rows = williams_design(len(modes))
    return [modes[i] for i in rows[round_index % len(rows)]] if rows else []


def neighbour_pairs(rounds: Sequence[Sequence[Any]]) -> Counter[tuple[Any, Any]]:
    """How often each ordered pair (predecessor, successor) of immediate neighbours occurs
    within the given rounds."""
    return Counter((r[i - 1], r[i]) for r in rounds for i in range(1, len(r)))


def design_summary(n: int, rounds: int) -> dict[str, Any]:
    """Balance of ``rounds`` rounds of the design for ``n`` modes: the full design's
    length, whether ``rounds`` is a whole number of full designs (``balanced``), how many
    of the ``n(n-1)`` ordered neighbour pairs occur and the least and most often one
    occurs, and a sentence for the page."""
    full = design_rounds(n)
    rows = williams_design(n)
    used = [rows[i % full] for i in range(rounds)] if full else []
    pairs = neighbour_pairs(used)
    possible = n * (n - 1)
    counts = [pairs.get((a, b), 0) for a in range(n) for b in range(n) if a != b]
    balanced = full > 0 and rounds > 0 and rounds % full == 0
    if n < 2:
        note = f"{rounds} rounds of {n} mode(s): nothing to balance"
    elif balanced:
        note = (
            f"{rounds} rounds = {rounds // full} full Williams design(s) of {full} rounds for "
            f"{n} modes: balanced, every mode follows every other {min(counts)} time(s)"
        )
    else:
        note = (
            f"{rounds} rounds, not a multiple of the {full}-round Williams design for {n} "
            f"modes: NOT balanced ({sum(c > 0 for c in counts)} of {possible} ordered "
            f"neighbour pairs occur, {min(counts)} to {max(counts)} times); use "
            f"--blocks {full * max(1, -(-rounds // full))}"
        )
    return {
        "modes": n,
        "rounds": rounds,
        "design_rounds": full,
        "balanced": balanced,
        "pairs_present": sum(c > 0 for c in counts),
        "pairs_possible": possible,
        "pair_count_min": min(counts, default=0),
        "pair_count_max": max(counts, default=0),
        "note": note,
    }


# ------------------------------------------------------------------ the bootstrap
def resample_rounds(
    strata: Sequence[int], resamples: int = RESAMPLES, seed: int = SEED
) -> np.ndarray:
    """Indices of ``resamples`` bootstrap samples of the rounds, shape
    ``(resamples, sum(strata))``: the rounds are numbered launch after launch, ``strata``
    gives each launch's number of rounds, and each launch's rounds are drawn with
    replacement from that launch only."""
    if not strata or min(strata) < 1:
        raise ValueError(f"every launch needs at least one round, got {list(strata)}")
    rng = np.random.default_rng(seed)
    parts, start = [], 0
    for size in strata:
        parts.append(start + rng.integers(0, size, size=(resamples, size)))
        start += size
    return np.concatenate(parts, axis=1)


Statistic = Callable[..., np.ndarray]
"""A statistic of arrays whose first axis is the bootstrap sample and whose second is the
round (further axes: values within a round); returns one value per sample."""


def bootstrap_ci(
    stat: Statistic,
    *per_round: Sequence[Any],
    strata: Sequence[int] | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    level: float = LEVEL,
) -> tuple[float, float]:
    """Percentile bootstrap interval ``(low, high)`` of ``stat`` over rounds.

    ``per_round`` are arrays with one entry per round (the same rounds, in the same order,
    e.g. a mode's block walls and the reference's); ``strata`` the rounds per launch (one
    launch when None). Every array is resampled with the same round indices, so paired
    values stay paired."""
    arrays = [np.asarray(a, dtype=float) for a in per_round]
    num = len(arrays[0])
    if any(len(a) != num for a in arrays):
        raise ValueError(f"per-round arrays differ in length: {[len(a) for a in arrays]}")
    strata = list(strata) if strata is not None else [num]
    if sum(strata) != num:
        raise ValueError(f"strata {strata} add up to {sum(strata)}, not {num} rounds")
    idx = resample_rounds(strata, resamples, seed)
    estimates = np.asarray(stat(*(a[idx] for a in arrays)), dtype=float)
    tail = (1.0 - level) / 2
    low, high = np.quantile(estimates, [tail, 1.0 - tail])
    return float(low), float(high)


def point(stat: Statistic, *per_round: Sequence[Any]) -> float:
    """``stat`` of the rounds as measured (no resampling)."""
    return float(stat(*(np.asarray(a, dtype=float)[None, ...] for a in per_round))[0])


def median_of_ratios(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Median over rounds of ``num / den`` per round (the paired ratio)."""
    return np.asarray(np.median(num / den, axis=1))


def ratio_of_means(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Mean over rounds of ``num`` over the mean over rounds of ``den``."""
    return np.asarray(num.mean(axis=1) / den.mean(axis=1))


def ratio_of_medians(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Median over all values of the rounds (rounds x values per round) of ``num`` over
    that of ``den`` (the ratio of per-iteration medians)."""
    flat_num = num.reshape(num.shape[0], -1)
    flat_den = den.reshape(den.shape[0], -1)
    return np.asarray(np.median(flat_num, axis=1) / np.median(flat_den, axis=1))


def inside_noise(low: float | None, high: float | None) -> bool | None:
    """Whether the interval contains 1.0 (no difference resolved); None without one."""
    if low is None or high is None:
        return None
    return low <= 1.0 <= high


def format_ci(value: float | None, low: float | None, high: float | None) -> str:
    """``1.015x [1.004, 1.027]``; ``-`` without a value, the value alone without an
    interval."""
    if value is None:
        return "-"
    if low is None or high is None:
        return f"{value:.3f}x"
    return f"{value:.3f}x [{low:.3f}, {high:.3f}]"


def noise_words(low: float | None, high: float | None) -> str:
    """The interval in words: inside the noise, or which way the difference goes."""
    inside = inside_noise(low, high)
    if inside is None:
        return "no interval"
    if inside:
        return f"inside the noise (the {LEVEL:.0%} CI contains 1.0)"
    assert low is not None
    side = "slower, beyond the noise (the {:.0%} CI lies above 1.0)"
    if low < 1.0:
        side = "faster, beyond the noise (the {:.0%} CI lies below 1.0)"
    return side.format(LEVEL)
