"""Sec. 1.2 (lines 10-16, Eq. 3-6): the gradient-matching merge rule.

Notation: ``θ_LLM`` = base, ``θ_t`` = fine-tuned, ``H_0`` = prior precision, ``H_t`` = task
curvature (both generic symmetric), ``α_t`` = weights, ``H̄ = H_0 + Σ_t α_t H_t``,
``H_{0+t} = H_0 + H_t``. Sizes ``d = 2``, ``T = 2``; ``θ`` stands for ``θ_{1:T}`` and is a free
vector, so "Eq. A ⇔ Eq. B" is shown as an identity between the residuals (LHS − RHS) of the two
equations for every ``θ``.

Premise (line 11, Taylor; Eq. 21 at ``θ_{1:T}``): the gradient mismatch
``∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t) := H_t(θ_{1:T} − θ_t)``. For quadratic losses
(``ℓ̄_t(θ) = ½θᵀH_tθ − b_tᵀθ``, which includes linear regression ``½‖y_t − X_tθ‖²``) there is no
premise and Eq. 6 is the exact ``θ_{1:T}``.

Note (cross-reference, not a mathematical statement): line 14 says the result is "the second
expression in Eq. 3", but Eq. 3 has a single expression; the equation obtained is Eq. 5.
"""

from __future__ import annotations

import sympy as sp

from gradmerge.theory.symbolic._check import SymbolicCheck
from gradmerge.theory.symbolic._util import (
    D,
    MergeSymbols,
    T,
    all_hold,
    at,
    decide,
    grad,
    hessian,
    inv,
    msum,
    sqnorm,
    vec,
)

COL = (D, 1)


class _S(MergeSymbols):
    """Generic symbols of Sec. 1.2."""

    def __init__(self) -> None:
        super().__init__()
        self.x = vec("thm", D)  # θ_{1:T}, free
        self.hbar = self.h0 + msum((self.al[t] * self.h[t] for t in range(T)), (D, D))

    def ta_step(self) -> sp.Matrix:
        return msum((self.al[t] * (self.th[t] - self.thl) for t in range(T)), COL)

    def eq6(self) -> sp.Matrix:
        hb_inv = inv(self.hbar)
        terms = (
            self.al[t] * hb_inv * (self.h0 + self.h[t]) * (self.th[t] - self.thl) for t in range(T)
        )
        return self.thl + msum(terms, COL)


def _res2_taylor(s: _S) -> sp.Matrix:
    """Residual of Eq. 2 after the premise mismatch := H_t(θ − θ_t)."""
    h0i = inv(s.h0)
    mism = msum((s.al[t] * h0i * s.h[t] * (s.x - s.th[t]) for t in range(T)), COL)
    return s.x - (s.thl + s.ta_step() - mism)


def _res3(s: _S) -> sp.Matrix:
    h0i = inv(s.h0)
    last = msum((s.al[t] * h0i * (s.h[t] * (s.x - s.th[t])) for t in range(T)), COL)
    return (s.x - s.thl) - (s.ta_step() - last)


def _res4(s: _S) -> sp.Matrix:
    h0i = inv(s.h0)
    last = msum(
        (s.al[t] * h0i * (s.h[t] * (s.x - s.thl) - s.h[t] * (s.th[t] - s.thl)) for t in range(T)),
        COL,
    )
    return (s.x - s.thl) - (s.ta_step() - last)


def _res5(s: _S, x: sp.Matrix | None = None) -> sp.Matrix:
    x = s.x if x is None else x
    rhs = msum((s.al[t] * s.h0 * (s.th[t] - s.thl) for t in range(T)), COL) + msum(
        (s.al[t] * s.h[t] * (s.th[t] - s.thl) for t in range(T)), COL
    )
    return s.hbar * (x - s.thl) - rhs


def eq3_from_eq2() -> bool:
    """Eq. 2 with the Taylor premise substituted is Eq. 3 (same residual for every θ)."""
    s = _S()
    return decide(_res2_taylor(s) - _res3(s))


def eq4_equiv_eq3() -> bool:
    """Adding and subtracting θ_LLM (line 13): Eq. 3 and Eq. 4 have the same residual."""
    s = _S()
    return decide(_res3(s) - _res4(s))


def eq5_first_line() -> bool:
    """H_0 × (Eq. 4 residual) = Eq. 5 (first line) residual, for every θ."""
    s = _S()
    return decide(s.h0 * _res4(s) - _res5(s))


def eq5_second_line() -> bool:
    """Σ α_t H_0(θ_t − θ_LLM) + Σ α_t H_t(θ_t − θ_LLM) = Σ α_t (H_0 + H_t)(θ_t − θ_LLM)."""
    s = _S()
    a = msum((s.al[t] * s.h0 * (s.th[t] - s.thl) for t in range(T)), COL)
    b = msum((s.al[t] * s.h[t] * (s.th[t] - s.thl) for t in range(T)), COL)
    c = msum((s.al[t] * (s.h0 + s.h[t]) * (s.th[t] - s.thl) for t in range(T)), COL)
    return decide(a + b - c)


def eq6_solves_eq5() -> bool:
    """Eq. 6 (θ̂ = θ_LLM + Σ α_t H̄⁻¹ H_{0+t}(θ_t − θ_LLM)) satisfies Eq. 5."""
    s = _S()
    return decide(_res5(s, s.eq6()))


def eq6_exact_quadratic() -> bool:
    """For quadratic ℓ̄_t, Eq. 6 is a stationary point of Σ α_t ℓ̄_t + ½‖θ − θ_LLM‖²_{H_0}.

    ``ℓ̄_t(θ) = ½θᵀH_tθ − b_tᵀθ`` with generic symmetric ``H_t`` and free ``b_t`` (linear
    regression is ``H_t = X_tᵀX_t``, ``b_t = X_tᵀy_t``, up to a constant). ``θ_t`` is free and
    ``b_t`` is eliminated by the fine-tune condition (Eq. 15 / line 5, 2nd):
    ``H_t θ_t − b_t = −H_0(θ_t − θ_LLM)``. The objective's Hessian is H̄, so for H̄ ≻ 0 the
    stationary point is the unique minimiser.
    """
    s = _S()
    theta = vec("theta", D)
    bs = [s.h[t] * s.th[t] + s.h0 * (s.th[t] - s.thl) for t in range(T)]
    losses = [sqnorm(theta, s.h[t]) / 2 - (bs[t].T * theta)[0, 0] for t in range(T)]
    objective = sum(s.al[t] * losses[t] for t in range(T)) + sqnorm(theta - s.thl, s.h0) / 2
    hess_ok = decide(hessian(objective, theta) - s.hbar)
    return all_hold([hess_ok, decide(at(grad(objective, theta), theta, s.eq6()))])


CHECKS: list[SymbolicCheck] = [
    SymbolicCheck(
        "eq3",
        "Eq. 3 (line 11)",
        "Eq. 2 with mismatch := H_t(θ_{1:T} − θ_t) is Eq. 3",
        True,
        eq3_from_eq2,
    ),
    SymbolicCheck(
        "eq4",
        "Eq. 4 (line 13)",
        "adding/subtracting θ_LLM turns Eq. 3 into Eq. 4",
        True,
        eq4_equiv_eq3,
    ),
    SymbolicCheck(
        "eq5-line1",
        "Eq. 5 first line (line 14)",
        "H_0 × Eq. 4, rearranged: H̄(θ_{1:T} − θ_LLM) = Σα_t H_0 Δ_t + Σα_t H_t Δ_t",
        True,
        eq5_first_line,
    ),
    SymbolicCheck(
        "eq5-line2",
        "Eq. 5 second line",
        "Σα_t H_0 Δ_t + Σα_t H_t Δ_t = Σα_t (H_0 + H_t) Δ_t",
        True,
        eq5_second_line,
    ),
    SymbolicCheck(
        "eq6",
        "Eq. 6 (line 16)",
        "θ̂ = θ_LLM + Σα_t H̄⁻¹(H_0 + H_t)(θ_t − θ_LLM) solves Eq. 5",
        True,
        eq6_solves_eq5,
    ),
    SymbolicCheck(
        "eq6-exact-quadratic",
        "Eq. 6, quadratic losses",
        "for ℓ̄_t = ½‖y_t − X_tθ‖², Eq. 6 is the exact θ_{1:T}",
        True,
        eq6_exact_quadratic,
    ),
]
