r"""Numbers for choosing δ: the scale of a curvature, and where gradient matching is its own method.

**Scale.** A curvature's diagonal entries H_ii (a diagonal's values; Σ_k diag(G_k) ⊗ diag(A_k)
for a K-FAC layer, whose entry for W[o, i] is Σ_k G_k[o, o]·A_k[i, i]; the matrix diagonal of a
dense block; the sum of its terms' diagonals for a lazy sum) summarised by percentiles and the
fraction of exact zeros (:class:`Scale`). For K-FAC each factor's spectrum range
[λ_min, λ_max] is computed too (:func:`factor_spectra`): the layer's eigenvalues are the
products of its factors' (one term), so they span [λ_min(A)·λ_min(G), λ_max(A)·λ_max(G)].

**The δ window.** With a prior H_0 = δ·I and diagonal curvatures, gradient matching (Eq. 6)
gives task t, on coordinate i, the weight

.. math::

    \frac{\alpha_t(\delta + h_{t,i})}{\delta + H_i}
    = s_i\,\alpha_t + (1 - s_i)\,\frac{\alpha_t h_{t,i}}{H_i},
    \qquad H_i = \sum_t \alpha_t h_{t,i}, \quad s_i = \frac{\delta}{\delta + H_i},

exactly: the task-arithmetic weight α_t mixed with the Fisher-averaging weight α_t h_{t,i}/H_i
by the prior's share s_i. Gradient matching is neither of the two where s_i is neither ≈ 0 nor
≈ 1. :func:`delta_window` gives the δ interval in which ρ ≤ s_i ≤ 1 − ρ (default ρ = 10⁻³)
on every coordinate between the 10th and 90th percentile of the positive H_i:

    δ ≥ ρ/(1 − ρ) · H_p90   and   δ ≤ (1 − ρ)/ρ · H_p10.

Below it gradient matching is Fisher averaging to within ρ of the mixing on ≥ 90 % of those
coordinates, above it task arithmetic; coordinates with H_i = 0 get task arithmetic at every
δ > 0. The window is empty when H_p90/H_p10 > ((1 − ρ)/ρ)². For K-FAC and dense curvatures the
diagonal entries stand in for the spectrum (they lie within it; the same algebra holds in the
eigenbasis of a single Kronecker term).

Percentiles are exact: those ``numpy.percentile`` computes on the concatenated entries (linear
interpolation between order statistics), found in bounded memory by a selection over a few
passes (:mod:`gradmerge.curvature.quantiles`), so a file larger than memory is summarised too.

Example:
    >>> import torch, gradmerge as gm
    >>> from gradmerge.curvature.summary import diagonal_values, scale_of, delta_window
    >>> K = gm.KFAC({"fc": (torch.diag(torch.tensor([1.0, 2.0])), torch.diag(torch.tensor([3.0])))})
    >>> diagonal_values(K)
    {'fc.weight': tensor([[3., 6.]])}
    >>> s = scale_of([torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])])
    >>> s.zeros, s.percentiles["p50"]
    (0.2, 2.0)
    >>> low, high = delta_window(torch.tensor([1.0, 1.0]))
    >>> round(low, 6), round(high, 1)
    (0.001001, 999.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradmerge.curvature.base import Curvature
from gradmerge.curvature.blocks import Blocks
from gradmerge.curvature.dense import Dense
from gradmerge.curvature.diagonal import Diagonal
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.curvature.kfac import EXACT_EIG_MAX_SIZE, KFAC
from gradmerge.curvature.lazy import Sum
from gradmerge.curvature.quantiles import OrderStatistics, order_statistics
from gradmerge.errors import ArgumentError

PERCENTILES = {"min": 0.0, "p1": 0.01, "p10": 0.1, "p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0}
RHO = 1e-3
"""The prior share s that counts as "gradient matching differs" (see the module docstring)."""


@dataclass(frozen=True)
class Scale:
    """Percentiles of a set of curvature entries (``PERCENTILES`` keys → value), the fraction
    of exact zeros, the smallest positive entry and how many entries."""

    percentiles: dict[str, float]
    zeros: float
    min_positive: float | None
    entries: int

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values."""
        return {
            **self.percentiles,
            "zeros": self.zeros,
            "min_positive": self.min_positive,
            "entries": self.entries,
        }


def diagonal_values(curvature: Curvature) -> dict[str, Tensor]:
    """The diagonal entries H_ii of ``curvature``, parameter name → tensor of its shape
    (module docstring); empty for δ·I, which has no layout."""
    if isinstance(curvature, Diagonal):
        return {k: v for k, v in curvature.values.items()}
    if isinstance(curvature, ScaledIdentity):
        return {}
    if isinstance(curvature, Dense):
        flat = curvature.matrix.diagonal()
        out, start = {}, 0
        for key, shape in curvature.layout:
            n = shape.numel()
            out[key] = flat[start : start + n].reshape(shape)
            start += n
        return out
    if isinstance(curvature, KFAC):
        out = {}
        for name, terms in curvature.terms.items():
            m = sum(torch.outer(g.diagonal(), a.diagonal()) for a, g in terms)
            assert isinstance(m, Tensor)
            curvature._split(name, m, out)
        return out
    if isinstance(curvature, Blocks):
        out = {}
        for block in curvature.blocks:
            out.update(diagonal_values(block))
        return out
    if isinstance(curvature, Sum):
        total: dict[str, Tensor] = {}
        for term in curvature.terms:
            if isinstance(term, ScaledIdentity):
                continue
            for k, v in diagonal_values(term).items():
                total[k] = total[k] + v if k in total else v.clone()
        identity = sum(t.delta for t in curvature.terms if isinstance(t, ScaledIdentity))
        return {k: v + identity for k, v in total.items()} if identity else total
    raise ArgumentError(f"no diagonal for a {type(curvature).__name__}")


def scale_of(tensors: Iterable[Tensor], *, dtype: torch.dtype = torch.float64) -> Scale:
    """The :class:`Scale` of the entries of ``tensors`` together (each tensor counts by its
    number of entries), exact (:func:`gradmerge.curvature.quantiles.order_statistics`; the
    tensors are read once per pass).

    Raises:
        ArgumentError: no entry at all.
        NonFiniteError: a NaN or infinite entry.
    """
    return scale_from(order_statistics(tensors, PERCENTILES, dtype=dtype))


def scale_from(stats: OrderStatistics) -> Scale:
    """The :class:`Scale` of completed order statistics over ``PERCENTILES``.

    Raises:
        ArgumentError: they saw no entry.
    """
    if stats.count == 0:
        raise ArgumentError("no curvature entries to summarise")
    return Scale(stats.percentiles, stats.zeros / stats.count, stats.min_positive, stats.count)


def factor_spectra(kfac: KFAC) -> dict[str, list[dict[str, float]]]:
    """Per K-FAC layer and Kronecker term, the range of each factor's eigenvalues
    (``a_min``, ``a_max``, ``g_min``, ``g_max``; in the factors' dtype, each factor
    decomposed once per operator: :meth:`KFAC.min_eigenvalue` reuses them)."""
    out = {}
    for name, terms in kfac.terms.items():
        rows = []
        for a, g in terms:
            ea, eg = kfac._eigenvalues(a), kfac._eigenvalues(g)
            rows.append(
                {
                    "a_min": float(ea[0]),
                    "a_max": float(ea[-1]),
                    "g_min": float(eg[0]),
                    "g_max": float(eg[-1]),
                }
            )
        out[name] = rows
    return out


def max_eigenvalue(curvature: Curvature) -> tuple[float, bool]:
    """λ_max of ``curvature``, or an upper bound, and whether it is exact: the counterpart of
    :meth:`Curvature.min_eigenvalue`, exact where that is (a diagonal's largest entry, δ of δ·I,
    a dense block's top eigenvalue, a one-term K-FAC layer's largest product λ(G)·λ(A), a small
    multi-term layer's dense sum); Weyl's bound Σ_k λ_max(term k) for a lazy sum and for the
    large multi-term K-FAC layers; +∞ (a bound) for a structure without a spectrum here.

    Example:
        >>> import torch, gradmerge as gm
        >>> max_eigenvalue(gm.Diagonal({"w": torch.tensor([2.0, 5.0])}) + 1.0)
        (6.0, True)
    """
    if isinstance(curvature, Diagonal):
        return max(float(v.max()) for v in curvature.values.values() if v.numel()), True
    if isinstance(curvature, ScaledIdentity):
        return float(curvature.delta), True
    if isinstance(curvature, Dense):
        m = curvature.matrix.double()
        return float(torch.linalg.eigvalsh((m + m.T) / 2)[-1]), True
    if isinstance(curvature, KFAC):
        high = -math.inf
        for terms in curvature.terms.values():
            a0, g0 = terms[0]
            if len(terms) > 1 and a0.shape[0] * g0.shape[0] <= EXACT_EIG_MAX_SIZE:
                dense = sum(torch.kron(g, a) for a, g in terms)
                assert isinstance(dense, Tensor)
                high = max(high, float(torch.linalg.eigvalsh(dense)[-1]))
                continue
            layer = sum(
                float(torch.outer(curvature._eigenvalues(g), curvature._eigenvalues(a)).max())
                for a, g in terms
            )
            high = max(high, layer)
        return high, curvature.min_eigenvalue_exact
    if isinstance(curvature, Blocks):
        parts = [max_eigenvalue(b) for b in curvature.blocks]
        return max(v for v, _ in parts), all(e for _, e in parts)
    if isinstance(curvature, Sum):
        parts = [max_eigenvalue(t) for t in curvature.terms]
        return sum(v for v, _ in parts), len(parts) == 1 and parts[0][1]
    return math.inf, False


def kfac_parts(curvature: Curvature) -> list[KFAC]:
    """The K-FAC blocks of ``curvature`` (itself, or those of a :class:`Blocks` or the terms of
    a lazy :class:`Sum`)."""
    if isinstance(curvature, KFAC):
        return [curvature]
    if isinstance(curvature, (Blocks, Sum)):
        parts = curvature.blocks if isinstance(curvature, Blocks) else curvature.terms
        return [k for b in parts for k in kfac_parts(b)]
    return []


def delta_window(total: Tensor | Iterable[Tensor], *, rho: float = RHO) -> tuple[float, float]:
    """The δ interval in which gradient matching is neither Fisher averaging nor task arithmetic
    (module docstring) for the summed curvature entries ``total`` (H_i = Σ_t α_t h_{t,i}):
    the bounds (ρ/(1 − ρ)·H_p90, (1 − ρ)/ρ·H_p10) over the positive entries, the window between
    them. Empty when the entries span more than ((1 − ρ)/ρ)² (then the first bound exceeds the
    second: no δ satisfies both; :func:`window_json` reports it as empty, never as an interval).

    Raises:
        ArgumentError: no positive entry, or ρ outside (0, 0.5).
    """
    tensors = [total] if isinstance(total, Tensor) else list(total)
    return window_from(order_statistics(tensors, {}, positive=WINDOW), rho=rho)


WINDOW = {"p10": 0.1, "p90": 0.9}
"""The percentiles of the positive entries that bound the δ window."""


def window_json(
    not_fisher_from: float | None, not_arithmetic_up_to: float | None
) -> dict[str, Any]:
    """The δ window as JSON values, from its two bounds: δ ≥ ``not_fisher_from`` keeps gradient
    matching from Fisher averaging and δ ≤ ``not_arithmetic_up_to`` from task arithmetic (each on
    90% of the coordinates). ``low`` ≤ ``high`` are the window's ends where the bounds leave an
    interval, ``None`` where they do not (``empty``: no δ satisfies both; the bounds are kept
    under their own names): a reader never meets an inverted interval.

    Example:
        >>> window_json(1.0, 3.0)["low"], window_json(3.0, 1.0)["low"], window_json(3.0, 1.0)["empty"]
        (1.0, None, True)
    """
    ordered = None not in (not_fisher_from, not_arithmetic_up_to) and (
        not_fisher_from <= not_arithmetic_up_to  # type: ignore[operator]
    )
    return {
        "low": not_fisher_from if ordered else None,
        "high": not_arithmetic_up_to if ordered else None,
        "empty": not ordered,
        "not_fisher_from": not_fisher_from,
        "not_arithmetic_up_to": not_arithmetic_up_to,
    }


def window_from(stats: OrderStatistics, *, rho: float = RHO) -> tuple[float, float]:
    """:func:`delta_window` from completed order statistics whose ``positive`` quantiles hold
    :data:`WINDOW` (the summed entries H_i streamed through them).

    Raises:
        ArgumentError: no positive entry, or ρ outside (0, 0.5).
    """
    check_rho(rho)
    p = stats.positive_percentiles
    if not p:
        raise ArgumentError(
            "the curvature has no positive entry: every δ > 0 gives task arithmetic"
        )
    return rho / (1 - rho) * p["p90"], (1 - rho) / rho * p["p10"]


def check_rho(rho: float) -> None:
    """ρ, the prior share counted as a difference, must lie in (0, 0.5): at 0 every δ counts,
    from 0.5 on the window's ends cross (NaN is refused too).

    Raises:
        ArgumentError: ρ outside (0, 0.5).
    """
    if not 0 < rho < 0.5:
        raise ArgumentError(
            f"rho (--rho) must be in (0, 0.5), got {rho!r}: the share of the prior counted as a "
            "difference, e.g. 1e-3"
        )


class PriorShare:
    r"""The δ window and the prior's share of a configured prior H_0 = δ·I + C, streamed.

    With a prior curvature C (its diagonal c_i, already times its ``scale``) the prior's share
    on coordinate i is s_i = (δ + c_i)/(δ + c_i + H_i), H_i = Σ_t α_t h_{t,i} (module
    docstring: gradient matching weighs task t by s_i·α_t + (1 − s_i)·α_t h_{t,i}/H_i), and

    .. math::

        \rho \le s_i \iff \delta \ge \tfrac{\rho}{1-\rho} H_i - c_i, \qquad
        s_i \le 1 - \rho \iff \delta \le \tfrac{1-\rho}{\rho} H_i - c_i .

    The window is [the 90th percentile of the first bound, the 10th of the second] over the
    coordinates with H_i > 0: inside it s_i ∈ [ρ, 1 − ρ] on at least 80% of them, as for
    :func:`delta_window`, which is the case c = 0. Besides, at the configured δ: the share's
    percentiles over those coordinates, how many have s_i < ρ (Fisher averaging there) and
    s_i > 1 − ρ (task arithmetic there), and how many have H_i = 0 (task arithmetic) or
    H_i < 0 (a negative α). Every percentile is exact (:class:`OrderStatistics`).

    Use: ``while share.wants_pass: (add every coordinate's H and c); share.end_pass()``.

    Example:
        >>> import torch
        >>> share = PriorShare(delta=1.0, rho=0.1)
        >>> while share.wants_pass:
        ...     share.add(torch.tensor([1.0, 3.0, 0.0]), None)
        ...     share.end_pass()
        >>> share.to_json()["share"]["p50"], share.to_json()["no_curvature"]
        (0.375, 1)
    """

    def __init__(self, *, delta: float, rho: float = RHO) -> None:
        check_rho(rho)
        self.delta, self.rho = delta, rho
        self._low = OrderStatistics({"p90": 0.9})
        self._high = OrderStatistics({"p10": 0.1})
        self._share = OrderStatistics(PERCENTILES)
        self._first = True
        self.fisher = self.arithmetic = self.flat = self.negative = 0

    @property
    def _parts(self) -> tuple[OrderStatistics, ...]:
        return self._low, self._high, self._share

    @property
    def wants_pass(self) -> bool:
        """Whether another pass over the coordinates is needed."""
        return any(p.wants_pass for p in self._parts)

    def add(self, h: Tensor, c: Tensor | None) -> None:
        """Take the coordinates of one tensor: H (Σ_t α_t h_t) and c (the prior curvature's
        diagonal times its scale; None: no prior curvature there)."""
        h = h.detach().reshape(-1).double()
        c = None if c is None else c.detach().reshape(-1).double()
        positive = h > 0
        hp = h[positive]
        cp = 0.0 if c is None else c[positive]
        rho = self.rho
        if self._low.wants_pass:
            self._low.add(rho / (1 - rho) * hp - cp)
        if self._high.wants_pass:
            self._high.add((1 - rho) / rho * hp - cp)
        if self._share.wants_pass or self._first:
            prior = self.delta + cp
            share = prior / (prior + hp)
            if self._share.wants_pass:
                self._share.add(share)
            if self._first:
                self.fisher += int((share < rho).sum())
                self.arithmetic += int((share > 1 - rho).sum())
                self.negative += int((h < 0).sum())
                self.flat += h.numel() - hp.numel() - int((h < 0).sum())

    def end_pass(self) -> None:
        """Close the current pass."""
        for p in self._parts:
            if p.wants_pass:
                p.end_pass()
        self._first = False

    def to_json(self) -> dict[str, Any]:
        """The window (:func:`window_json`: ``low`` ≤ ``high``, or None with ``empty``; its
        bounds ``not_fisher_from``, ``not_arithmetic_up_to``, None without a positive H), the
        share's percentiles and the counts, as plain JSON values."""
        curved = self._share.count
        out: dict[str, Any] = {"rho": self.rho, "delta": self.delta, "coordinates": curved}
        if curved:
            low, high = self._low.percentiles["p90"], self._high.percentiles["p10"]
            out.update(window_json(max(low, 0.0), high))
        else:
            out.update(window_json(None, None))
        out.update(
            share=self._share.percentiles if curved else None,
            fisher_like=self.fisher,
            arithmetic_like=self.arithmetic,
            no_curvature=self.flat,
            negative=self.negative,
        )
        return out
