"""Sec. 1.4 (lines 47-54): the influence-function removal of Koh & Liang (2017).

Printed (line 48): ``θ̂_\\t = θ_LLM + H̄_\\t⁻¹ g_t`` with ``g_t = ∇ℓ̄_t(θ_LLM)``,
``H̄_\\t = δI + B``, ``B = ∇²ℓ̄_\\t(θ_LLM)``; ``α_t`` is the weight of task ``t`` in the LLM's
objective (Eq. 9).

Lines 49-50 claim Eq. 11 recovers it when the Taylor step of Eq. 12 is skipped (line 25's Taylor
step for ``ℓ̄_\\t`` and the fine-tune condition, Eq. 10 second line, are kept). It gives
``θ_LLM + α_t H̄_\\t⁻¹ g_t``: the printed form lacks ``α_t`` and is recovered only for ``α_t = 1``
(the case of Sec. 1.4, where Eq. 13 is used with ``α_t = 1``). The same ``α_t`` is needed for the
formula to be the exact refit of a linear model trained with weight ``α_t`` (Eq. 9).
Gradients are free symbol vectors, as in :mod:`gradmerge.theory.symbolic.removal`.
"""

from __future__ import annotations

import sympy as sp

from gradmerge.theory.symbolic._check import SymbolicCheck
from gradmerge.theory.symbolic._util import at, decide, grad, inv, sqnorm, sym, vec
from gradmerge.theory.symbolic.removal import _S as _RemovalSymbols

D = 2


def _from_eq11(with_alpha: bool) -> bool:
    """Eq. 11 + line 25 + Eq. 10 (2nd line), no Eq. 12: does θ_\\t = θ_LLM + [α_t] H̄_\\t⁻¹ g_t?"""
    s = _RemovalSymbols()
    line25 = dict(zip(s.e, s.a + s.b_hess * (s.thr - s.thl), strict=True))
    fine_tune = dict(zip(s.c, -s.h0 * (s.tht - s.thl), strict=True))
    res = s.res11().subs({**line25, **fine_tune}, simultaneous=True)  # s.b = g_t stays free
    weight = s.al if with_alpha else sp.Integer(1)
    candidate = s.thl + weight * inv(s.delta * s.eye + s.b_hess) * s.b
    return decide(at(res, s.thr, candidate))


def _exact_linear(alpha: sp.Expr, with_alpha: bool) -> bool:
    """Quadratic losses, LLM trained on ℓ̄_\\t + α ℓ̄_t + (δ/2)‖θ‖²: is θ_LLM + [α] H̄_\\t⁻¹ g_t
    exact?

    ``ℓ̄_\\t(θ) = ½θᵀBθ − rᵀθ`` (linear regression: ``B = X_\\tᵀX_\\t``),
    ``ℓ̄_t = ½θᵀH_tθ − b_tᵀθ``; ``θ_LLM`` free and ``r`` eliminated by Eq. 9's stationarity
    condition.
    """
    b, ht = sym("B", D), sym("Ht", D)
    thl, bt, theta = vec("thL", D), vec("bt", D), vec("theta", D)
    delta = sp.Symbol("delta", positive=True)
    r = (b + alpha * ht + delta * sp.eye(D)) * thl - alpha * bt
    loss_r = sqnorm(theta, b) / 2 - (r.T * theta)[0, 0]
    loss_t = sqnorm(theta, ht) / 2 - (bt.T * theta)[0, 0]
    g_t = at(grad(loss_t, theta), theta, thl)
    weight = alpha if with_alpha else sp.Integer(1)
    candidate = thl + weight * inv(b + delta * sp.eye(D)) * g_t
    obj8 = loss_r + delta * sqnorm(theta) / 2
    return decide(at(grad(obj8, theta), theta, candidate))


def kl_exact_alpha1() -> bool:
    """α_t = 1: θ_LLM + H̄_\\t⁻¹ g_t is the exact refit for linear regression."""
    return _exact_linear(sp.Integer(1), with_alpha=False)


def kl_exact_printed() -> bool:
    """Generic α_t: θ_LLM + H̄_\\t⁻¹ g_t (no α_t) is the exact refit."""
    return _exact_linear(sp.Symbol("alpha", real=True), with_alpha=False)


def kl_exact_corrected() -> bool:
    """Generic α_t: θ_LLM + α_t H̄_\\t⁻¹ g_t is the exact refit."""
    return _exact_linear(sp.Symbol("alpha", real=True), with_alpha=True)


def kl_from_eq11_printed() -> bool:
    return _from_eq11(with_alpha=False)


def kl_from_eq11_corrected() -> bool:
    return _from_eq11(with_alpha=True)


def kl_from_eq11_alpha1() -> bool:
    """With α_t = 1 the printed form is recovered."""
    s = _RemovalSymbols()
    line25 = dict(zip(s.e, s.a + s.b_hess * (s.thr - s.thl), strict=True))
    fine_tune = dict(zip(s.c, -s.h0 * (s.tht - s.thl), strict=True))
    res = s.res11().subs({**line25, **fine_tune, s.al: 1}, simultaneous=True)
    candidate = s.thl + inv(s.delta * s.eye + s.b_hess) * s.b
    return decide(at(res, s.thr, candidate))


CHECKS: list[SymbolicCheck] = [
    SymbolicCheck(
        "koh-liang-exact-linear",
        "line 48 (α_t = 1)",
        "θ_LLM + H̄_\\t⁻¹ g_t is the exact refit for linear regression when α_t = 1",
        True,
        kl_exact_alpha1,
    ),
    SymbolicCheck(
        "koh-liang-exact-linear-alpha-printed",
        "line 48",
        "θ_LLM + H̄_\\t⁻¹ g_t is the exact refit for linear regression, any α_t (Eq. 9)",
        False,
        kl_exact_printed,
    ),
    SymbolicCheck(
        "koh-liang-exact-linear-alpha-corrected",
        "line 48",
        "θ_LLM + α_t H̄_\\t⁻¹ g_t is the exact refit for linear regression, any α_t (Eq. 9)",
        True,
        kl_exact_corrected,
    ),
    SymbolicCheck(
        "koh-liang-from-eq11-printed",
        "lines 49-50",
        "Eq. 11 without Eq. 12 gives θ_\\t = θ_LLM + H̄_\\t⁻¹ g_t for any α_t",
        False,
        kl_from_eq11_printed,
    ),
    SymbolicCheck(
        "koh-liang-from-eq11-corrected",
        "lines 49-50",
        "Eq. 11 without Eq. 12 gives θ_\\t = θ_LLM + α_t H̄_\\t⁻¹ g_t, for any loss",
        True,
        kl_from_eq11_corrected,
    ),
    SymbolicCheck(
        "koh-liang-from-eq11-alpha1",
        "lines 49-50 (α_t = 1)",
        "with α_t = 1, Eq. 11 without Eq. 12 gives the printed θ_LLM + H̄_\\t⁻¹ g_t",
        True,
        kl_from_eq11_alpha1,
    ),
]
