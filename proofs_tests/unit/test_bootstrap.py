"""gradmerge.bootstrap.paired_bootstrap against the exact bootstrap distribution, by enumeration.

On strata of 3 and 4 examples every resample can be listed (3³ and 4⁴ index tuples, each as
likely), so the exact distribution of d_k and of d̄ = mean over strata of d_k is computed here
independently (plain Python over itertools.product, ratio of sums by hand). The Monte-Carlo
bootstrap's R draws must then agree with it within the Dvoretzky-Kiefer-Wolfowitz band: with
probability at least 1 − 2·exp(−2Rε²) (here 1 − 4e-7) the empirical CDF of R independent draws
lies within ε of the exact one, so each percentile endpoint lies between the exact quantiles at
q ∓ (ε + 1/R). Then the exact properties (paired, stratified, seeded) and bad input, as cases.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from gradmerge import bootstrap
from gradmerge.bootstrap import paired_bootstrap
from gradmerge.errors import ArgumentError, NonFiniteError, StructureError

R = 20_000
EPS = 0.02  # DKW: P(sup |F_R - F| > EPS) <= 2 exp(-2 R EPS^2) = 2 exp(-16)

CASES = [
    # (name, a, b, a_weights, b_weights): per stratum, 3 and 4 examples
    ("classifier accuracy", [[1, 0, 1], [1, 1, 0, 1]], [[0, 0, 1], [1, 0, 1, 0]], None, None),
    ("losses", [[0.2, 1.5, 0.1], [0.3, 0.9, 2.0, 0.4]], [[0.7, 0.6, 0.1], [1.3, 0.2, 0.5, 0.4]],
     None, None),
    ("token accuracy (ratio of sums)", [[3, 0, 2], [1, 4, 0, 2]], [[2, 1, 2], [0, 4, 1, 1]],
     [[4, 1, 3], [2, 5, 1, 3]], [[4, 1, 3], [2, 5, 1, 3]]),
]  # fmt: skip


def _exact(xa, xb, wa, wb):
    """Every resample of one stratum's indices (n^n of them, equally likely): d_k's values."""
    n = len(xa)
    wa = wa or [1] * n
    wb = wb or [1] * n
    values = []
    for index in itertools.product(range(n), repeat=n):
        ma = Fraction(sum(Fraction(xa[i]) for i in index)) / sum(Fraction(wa[i]) for i in index)
        mb = Fraction(sum(Fraction(xb[i]) for i in index)) / sum(Fraction(wb[i]) for i in index)
        values.append(ma - mb)
    return values


def _exact_cdf(values):
    """(sorted support, cumulative probability) of a list of equally likely exact values."""
    counts = Counter(values)
    support = sorted(counts)
    cdf = np.cumsum([counts[x] for x in support]) / len(values)
    return np.array([float(x) for x in support]), cdf


def _quantile(support, cdf, p):
    """The exact distribution's generalised inverse F⁻¹(p) = min {x : F(x) >= p}, p clipped."""
    p = min(max(p, 0.0), 1.0)
    return support[min(np.searchsorted(cdf, p - 1e-12), len(support) - 1)]


def _check_against_exact(draws, exact, interval):
    support, cdf = _exact_cdf(exact)
    # the empirical CDF of the draws against the exact one, at every support point (draws
    # within 1e-9 of a point are that point: float sums of the same fractions)
    empirical = np.searchsorted(np.sort(draws), support + 1e-9, side="right") / len(draws)
    assert np.max(np.abs(empirical - cdf)) <= EPS
    low, high = interval
    for value, q in ((low, 0.025), (high, 0.975)):
        assert _quantile(support, cdf, q - EPS - 1 / R) <= value + 1e-9
        assert value - 1e-9 <= _quantile(support, cdf, q + EPS + 1 / R)


@pytest.mark.parametrize("chunk", [bootstrap.CHUNK, 5], ids=["one chunk", "chunks of 5"])
@pytest.mark.parametrize(("name", "a", "b", "wa", "wb"), CASES, ids=[c[0] for c in CASES])
def test_the_distribution_is_the_exact_bootstrap(monkeypatch, chunk, name, a, b, wa, wb):
    monkeypatch.setattr(bootstrap, "CHUNK", chunk)
    result = paired_bootstrap(a, b, a_weights=wa, b_weights=wb, resamples=R, seed=7)
    per_stratum = []
    for k in range(2):
        exact = _exact(a[k], b[k], wa and wa[k], wb and wb[k])
        per_stratum.append(exact)
        d = result.strata[k]
        by_hand = sum(a[k]) / sum(wa[k] if wa else [1] * len(a[k])) - sum(b[k]) / sum(
            wb[k] if wb else [1] * len(b[k])
        )
        assert math.isclose(d.estimate, by_hand, rel_tol=1e-12, abs_tol=1e-15)
        _check_against_exact(result.stratum_distributions[k], exact, (d.low, d.high))
    # the pooled statistic: strata resampled independently, d̄ = (d_1 + d_2) / 2
    pooled = [(x + y) / 2 for x, y in itertools.product(*per_stratum)]
    assert math.isclose(
        result.pooled.estimate,
        (result.strata[0].estimate + result.strata[1].estimate) / 2,
        rel_tol=1e-12,
        abs_tol=1e-15,
    )
    _check_against_exact(result.distribution, pooled, (result.pooled.low, result.pooled.high))
    np.testing.assert_allclose(
        result.distribution, np.mean(result.stratum_distributions, axis=0), rtol=0, atol=1e-15
    )


def test_paired_seeded_and_stratified():
    g = np.random.default_rng(0)
    a = [g.integers(0, 2, 50), g.integers(0, 2, 30)]
    b = [g.integers(0, 2, 50), g.integers(0, 2, 30)]
    first = paired_bootstrap(a, b, resamples=500, seed=3)
    again = paired_bootstrap(a, b, resamples=500, seed=3)
    np.testing.assert_array_equal(first.distribution, again.distribution)
    other = paired_bootstrap(a, b, resamples=500, seed=4)
    assert not np.array_equal(first.distribution, other.distribution)
    # B against A: the same draws, every value negated
    swapped = paired_bootstrap(b, a, resamples=500, seed=3)
    np.testing.assert_array_equal(swapped.distribution, -first.distribution)
    assert (swapped.pooled.low, swapped.pooled.high) == pytest.approx(
        (-first.pooled.high, -first.pooled.low), abs=1e-15
    )
    # a model against itself: no difference in any resample
    same = paired_bootstrap(a, a, resamples=200, seed=3)
    assert not same.distribution.any() and same.pooled.low == same.pooled.high == 0.0
    # a stratum's draws depend on its own seed stream: adding a stratum leaves the others alone
    more = paired_bootstrap([*a, g.integers(0, 2, 9)], [*b, g.integers(0, 2, 9)], resamples=500,
                            seed=3)  # fmt: skip
    for k in range(2):
        np.testing.assert_array_equal(more.stratum_distributions[k], first.stratum_distributions[k])
    # a stratum whose difference is the same on every example: its d_k never varies
    constant = paired_bootstrap([[1, 1, 1, 1], a[0]], [[0, 0, 0, 0], b[0]], resamples=300)
    assert set(constant.stratum_distributions[0].tolist()) == {1.0}


def test_examples_with_no_scored_position_are_no_observation():
    with_empty = paired_bootstrap([[2, 0, 1]], [[1, 0, 1]], a_weights=[[2, 0, 3]],
                                  b_weights=[[2, 0, 3]], resamples=300, seed=1)  # fmt: skip
    without = paired_bootstrap([[2, 1]], [[1, 1]], a_weights=[[2, 3]], b_weights=[[2, 3]],
                               resamples=300, seed=1)  # fmt: skip
    np.testing.assert_array_equal(with_empty.distribution, without.distribution)


BAD = [
    # (name, call, error, message)
    ("no strata", lambda: paired_bootstrap([], []), ArgumentError, "no stratum"),
    ("B has fewer strata", lambda: paired_bootstrap([[1], [0]], [[1]]), StructureError,
     "has 1"),
    ("different examples", lambda: paired_bootstrap([[1, 0, 1]], [[1, 0]]), StructureError,
     "same examples"),
    ("empty stratum", lambda: paired_bootstrap([[]], [[]]), ArgumentError, "no example"),
    ("NaN loss", lambda: paired_bootstrap([[0.1, math.nan]], [[0.2, 0.3]]), NonFiniteError,
     "NaN"),
    ("no resamples", lambda: paired_bootstrap([[1]], [[0]], resamples=0), ArgumentError,
     "at least 1"),
    ("negative seed", lambda: paired_bootstrap([[1]], [[0]], seed=-1), ArgumentError,
     "non-negative"),
    ("level 1", lambda: paired_bootstrap([[1]], [[0]], level=1.0), ArgumentError, "(0, 1)"),
    ("negative weight", lambda: paired_bootstrap([[1, 1]], [[0, 1]], a_weights=[[1, -1]],
                                                 b_weights=[[1, 1]]), ArgumentError, "negative"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "error", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_input(name, call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()
