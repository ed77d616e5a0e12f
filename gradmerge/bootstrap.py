"""Paired bootstrap intervals for the difference between two models scored on the same examples.

Two models A and B are scored on the same K data sets (strata). On stratum k, example i gives each
model a value and a weight: for accuracy the correct count c_i and the scored positions p_i (1 per
example for a classifier, the predicted tokens for a causal LM), for the mean loss the summed loss
ℓ_i and p_i. A model's statistic on stratum k is the ratio of sums

    m_k = Σ_i x_i / Σ_i w_i      (accuracy = correct / positions, mean loss = loss / positions),

the difference on stratum k is d_k = m_k(A) − m_k(B), and the pooled statistic is the MEAN OVER
STRATA of the differences,

    d̄ = (1/K) Σ_k d_k            (e.g. the mean over data sets of accuracy, the usual number of
                                   merging papers: every data set counts alike, whatever its size).

The paired bootstrap resamples examples with replacement, the same indices for A and B (so that
what the two models have in common — which examples are hard — cancels), within each stratum
separately (stratified: every resample keeps each stratum's size n_k), R times. Resample r draws
n_k indices uniformly from stratum k for every k, computes d_k^(r) with those indices, and
d̄^(r) = (1/K) Σ_k d_k^(r). The 95% interval of d_k (and of d̄) is the percentile interval: the
2.5% and 97.5% quantiles of the R resampled values (``numpy.quantile``, linear interpolation).

Draws: stratum k's indices come from ``numpy.random.default_rng([seed, k])``, R rows at a time
(in chunks of at most 2**22 indices), so they depend only on (seed, k, n_k, R): two calls with
the same seed on the same strata (accuracy, then loss) resample the same examples, and adding a
stratum leaves the other strata's intervals as they were. Examples whose weight is 0 for both
models (a sequence with no scored position) are left out before resampling: they are no
observation of the statistic.

Example:
    >>> from gradmerge.bootstrap import paired_bootstrap
    >>> a = [[1, 1, 0, 1], [1, 0, 1]]          # model A correct or not, on two data sets
    >>> b = [[1, 0, 0, 1], [0, 0, 1]]          # model B, the same examples in the same order
    >>> result = paired_bootstrap(a, b, resamples=2000, seed=0)
    >>> [round(d.estimate, 4) for d in result.strata], round(result.pooled.estimate, 4)
    ([0.25, 0.3333], 0.2917)
    >>> result.pooled.low <= result.pooled.estimate <= result.pooled.high
    True

References:
    B. Efron and R. J. Tibshirani, "An Introduction to the Bootstrap", Chapman & Hall, 1993
    (ch. 6 and 13: the bootstrap and its percentile interval; ch. 8: stratified resampling).
    P. Koehn, "Statistical Significance Tests for Machine Translation Evaluation", EMNLP 2004
    (the paired bootstrap over test examples, for comparing two systems in NLP).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradmerge.errors import ArgumentError, NonFiniteError, StructureError

CHUNK = 2**22
"""At most this many indices are drawn at once (memory: 8 bytes each)."""


@dataclass(frozen=True)
class Difference:
    """A difference d = statistic(A) − statistic(B) and its bootstrap interval [low, high]."""

    estimate: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float | list[float]]:
        """``{"difference": d, "interval": [low, high]}``."""
        return {"difference": self.estimate, "interval": [self.low, self.high]}


@dataclass(frozen=True)
class PairedBootstrap:
    """What :func:`paired_bootstrap` computed (module docstring).

    Attributes:
        strata: d_k with its interval, per stratum, in the order given.
        pooled: d̄ = the mean over strata of d_k, with its interval.
        resamples: R. seed: the seed of the draws. level: the interval's coverage (0.95).
        distribution: the R resampled values of d̄ (``distribution[r]`` = d̄^(r)).
        stratum_distributions: the R resampled values of each d_k.
    """

    strata: tuple[Difference, ...]
    pooled: Difference
    resamples: int
    seed: int
    level: float
    distribution: np.ndarray
    stratum_distributions: tuple[np.ndarray, ...]


Values = Sequence[float] | np.ndarray


def paired_bootstrap(
    a: Sequence[Values],
    b: Sequence[Values],
    *,
    a_weights: Sequence[Values] | None = None,
    b_weights: Sequence[Values] | None = None,
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> PairedBootstrap:
    """Stratified paired bootstrap of d̄ = (1/K) Σ_k [m_k(A) − m_k(B)] (module docstring).

    Args:
        a: per stratum, model A's value x_i of each example (e.g. correct counts or losses).
        b: model B's values on the same examples, in the same order.
        a_weights, b_weights: per stratum, each example's weight w_i for A and for B (e.g.
            scored positions); ``None``: 1 per example, so that m_k is the mean of the values.
        resamples: R, at least 1.
        seed: the seed of the draws, ≥ 0 (the same seed draws the same indices).
        level: coverage of the percentile interval, in (0, 1).

    Returns:
        A :class:`PairedBootstrap`.

    Raises:
        ArgumentError: no stratum, a stratum without examples (or without weight), R < 1, a
            negative seed, a level outside (0, 1), negative weights.
        StructureError: A and B (or a weight list) differ in their number of strata or of a
            stratum's examples: a paired bootstrap needs the same examples.
        NonFiniteError: a NaN or infinite value or weight.
    """
    if resamples < 1:
        raise ArgumentError(f"resamples must be at least 1, got {resamples}")
    if seed < 0:
        raise ArgumentError(f"seed must be a non-negative integer, got {seed}")
    if not 0.0 < level < 1.0:
        raise ArgumentError(f"level must lie in (0, 1), got {level}")
    if len(a) == 0:
        raise ArgumentError("no stratum to resample: give at least one data set's values")
    strata = [
        _stratum(k, a, b, a_weights, b_weights)
        for k in range(_count(len(a), b, a_weights, b_weights))
    ]
    distributions = []
    differences = []
    tail = (1.0 - level) / 2.0
    for k, (xa, wa, xb, wb) in enumerate(strata):
        estimate = xa.sum() / wa.sum() - xb.sum() / wb.sum()
        distribution = _resample(k, seed, resamples, xa, wa, xb, wb)
        distributions.append(distribution)
        differences.append(_difference(float(estimate), distribution, tail))
    pooled = np.mean(distributions, axis=0)
    estimate = math.fsum(d.estimate for d in differences) / len(differences)
    return PairedBootstrap(
        strata=tuple(differences),
        pooled=_difference(estimate, pooled, tail),
        resamples=resamples,
        seed=seed,
        level=level,
        distribution=pooled,
        stratum_distributions=tuple(distributions),
    )


def _count(k: int, *others: Sequence[Values] | None) -> int:
    for name, other in zip(("b", "a_weights", "b_weights"), others, strict=True):
        if other is not None and len(other) != k:
            raise StructureError(
                f"a has {k} strata but {name} has {len(other)}: give every model's values on "
                "the same data sets, in the same order"
            )
    return k


def _array(values: Values, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(array).all():
        raise NonFiniteError(f"{what} holds NaN or infinite values: nothing to resample")
    return array


def _stratum(
    k: int,
    a: Sequence[Values],
    b: Sequence[Values],
    a_weights: Sequence[Values] | None,
    b_weights: Sequence[Values] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stratum k's (x_A, w_A, x_B, w_B), checked, without the examples of weight 0 for both."""
    xa, xb = _array(a[k], f"a[{k}]"), _array(b[k], f"b[{k}]")
    wa = np.ones_like(xa) if a_weights is None else _array(a_weights[k], f"a_weights[{k}]")
    wb = np.ones_like(xb) if b_weights is None else _array(b_weights[k], f"b_weights[{k}]")
    sizes = {len(xa), len(xb), len(wa), len(wb)}
    if len(sizes) > 1:
        raise StructureError(
            f"stratum {k}: A has {len(xa)} values (weights {len(wa)}), B {len(xb)} (weights "
            f"{len(wb)}): a paired bootstrap needs both models' values on the same examples"
        )
    if (wa < 0).any() or (wb < 0).any():
        raise ArgumentError(f"stratum {k}: a negative weight; weights count scored positions")
    kept = (wa > 0) | (wb > 0)
    xa, wa, xb, wb = xa[kept], wa[kept], xb[kept], wb[kept]
    if len(xa) == 0 or wa.sum() == 0 or wb.sum() == 0:
        raise ArgumentError(
            f"stratum {k} has no example with a positive weight: there is no statistic to "
            "compare (an empty data set?)"
        )
    return xa, wa, xb, wb


def _resample(
    k: int,
    seed: int,
    resamples: int,
    xa: np.ndarray,
    wa: np.ndarray,
    xb: np.ndarray,
    wb: np.ndarray,
) -> np.ndarray:
    """d_k^(r) for r = 1..R: the same n_k indices for A and B in each resample."""
    rng = np.random.default_rng([seed, k])
    n = len(xa)
    rows = max(1, CHUNK // n)
    out = np.empty(resamples, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        for start in range(0, resamples, rows):
            count = min(rows, resamples - start)
            index = rng.integers(0, n, size=(count, n))
            out[start : start + count] = xa[index].sum(1) / wa[index].sum(1) - xb[index].sum(
                1
            ) / wb[index].sum(1)
    if not np.isfinite(out).all():  # a resample of examples weighing 0 for one model only
        raise ArgumentError(
            f"stratum {k}: a resample holds no scored position of one model (too few examples "
            "with a positive weight); give more examples"
        )
    return out


def _difference(estimate: float, distribution: np.ndarray, tail: float) -> Difference:
    low, high = np.quantile(distribution, [tail, 1.0 - tail])
    return Difference(estimate=estimate, low=float(low), high=float(high))


__all__ = ["Difference", "PairedBootstrap", "paired_bootstrap"]
