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

Percentiles are exact (linear interpolation between order statistics, as ``numpy.quantile``)
over at most :data:`EXACT` entries per tensor; a larger tensor contributes a strided sample of
EXACT entries, each weighted by its stride, and the summary says ``sampled``.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradmerge.curvature.base import Curvature
from gradmerge.curvature.blocks import Blocks
from gradmerge.curvature.dense import Dense
from gradmerge.curvature.diagonal import Diagonal
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.curvature.kfac import KFAC
from gradmerge.curvature.lazy import Sum
from gradmerge.errors import ArgumentError

PERCENTILES = {"min": 0.0, "p1": 0.01, "p10": 0.1, "p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0}
EXACT = 1 << 22
"""Entries per tensor above which a strided sample of this many stands in for the tensor."""
RHO = 1e-3
"""The prior share s that counts as "gradient matching differs" (see the module docstring)."""


@dataclass(frozen=True)
class Scale:
    """Percentiles of a set of curvature entries (``PERCENTILES`` keys → value), the fraction
    of exact zeros, the smallest positive entry, how many entries, and whether a strided sample
    stood in for some tensor."""

    percentiles: dict[str, float]
    zeros: float
    min_positive: float | None
    entries: int
    sampled: bool

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values."""
        return {
            **self.percentiles,
            "zeros": self.zeros,
            "min_positive": self.min_positive,
            "entries": self.entries,
            "sampled": self.sampled,
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


def _sample(values: Tensor) -> tuple[np.ndarray, float, bool]:
    """(entries as float64, the weight of each, whether it is a strided sample)."""
    flat = values.detach().reshape(-1)
    if flat.numel() <= EXACT:
        return flat.double().cpu().numpy(), 1.0, False
    stride = math.ceil(flat.numel() / EXACT)
    part = flat[::stride]
    return part.double().cpu().numpy(), flat.numel() / part.numel(), True


def scale_of(tensors: Iterable[Tensor]) -> Scale:
    """The :class:`Scale` of the entries of ``tensors`` together (each tensor counts by its
    number of entries; see the module docstring for sampling)."""
    parts, weights, sampled = [], [], False
    entries = zeros = 0
    min_positive: float | None = None
    for t in tensors:
        if t.numel() == 0:
            continue
        entries += t.numel()
        zeros += int((t == 0).sum())
        positive = t[t > 0]
        if positive.numel():
            low = float(positive.min())
            min_positive = low if min_positive is None else min(min_positive, low)
        values, weight, was = _sample(t)
        parts.append(values)
        weights.append(np.full(values.shape, weight))
        sampled |= was
    if not parts:
        raise ArgumentError("no curvature entries to summarise")
    values, w = np.concatenate(parts), np.concatenate(weights)
    return Scale(
        {k: _weighted_quantile(values, w, q) for k, q in PERCENTILES.items()},
        zeros / entries,
        min_positive,
        entries,
        sampled,
    )


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """numpy.quantile's linear interpolation, generalised to integer-like weights: each value
    stands for ``weight`` equal entries (with weights 1 it equals ``numpy.quantile``)."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    ends = np.cumsum(w)  # the entry positions 0..n−1 covered: [ends − w, ends − 1]
    position = q * (ends[-1] - 1)
    below, frac = math.floor(position), position - math.floor(position)
    lo = v[np.searchsorted(ends, below, side="right")]
    hi = v[min(np.searchsorted(ends, below + 1, side="right"), len(v) - 1)]
    return float(lo + frac * (hi - lo))


def factor_spectra(kfac: KFAC) -> dict[str, list[dict[str, float]]]:
    """Per K-FAC layer and Kronecker term, the range of each factor's eigenvalues
    (``a_min``, ``a_max``, ``g_min``, ``g_max``; float64 ``eigvalsh``)."""
    out = {}
    for name, terms in kfac.terms.items():
        rows = []
        for a, g in terms:
            ea = torch.linalg.eigvalsh(a.double())
            eg = torch.linalg.eigvalsh(g.double())
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


def kfac_parts(curvature: Curvature) -> list[KFAC]:
    """The K-FAC blocks of ``curvature`` (itself, or those of a :class:`Blocks`)."""
    if isinstance(curvature, KFAC):
        return [curvature]
    if isinstance(curvature, Blocks):
        return [k for b in curvature.blocks for k in kfac_parts(b)]
    return []


def delta_window(total: Tensor | Iterable[Tensor], *, rho: float = RHO) -> tuple[float, float]:
    """The δ interval in which gradient matching is neither Fisher averaging nor task arithmetic
    (module docstring) for the summed curvature entries ``total`` (H_i = Σ_t α_t h_{t,i}):
    [ρ/(1 − ρ)·H_p90, (1 − ρ)/ρ·H_p10] over the positive entries. Empty (low > high) when they
    span more than ((1 − ρ)/ρ)².

    Raises:
        ArgumentError: no positive entry, or ρ outside (0, 0.5).
    """
    check_rho(rho)
    tensors = [total] if isinstance(total, Tensor) else list(total)
    positive = [p for t in tensors if (p := t[t > 0]).numel()]
    if not positive:
        raise ArgumentError(
            "the curvature has no positive entry: every δ > 0 gives task arithmetic"
        )
    scale = scale_of(positive)
    return (
        rho / (1 - rho) * scale.percentiles["p90"],
        (1 - rho) / rho * scale.percentiles["p10"],
    )


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


def summed_diagonals(curvatures: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Σ_t of per-parameter diagonal entries (the same parameters in each), float64."""
    total: dict[str, Tensor] = {}
    for values in curvatures:
        for k, v in values.items():
            total[k] = total[k] + v.double() if k in total else v.double().clone()
    return total
