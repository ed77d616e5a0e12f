"""Sec. 1.3 (lines 17-30, Eq. 7-13): removing task data ``D_t`` from the LLM.

Notation: ``θ_LLM`` = base (trained on ``ℓ̄_\\t + α_t ℓ̄_t + (δ/2)‖θ‖²``, Eq. 9), ``θ_t`` =
fine-tuned, ``θ_\\t`` = refit without ``D_t`` (Eq. 8), ``H_0`` = prior precision of the fine-tune,
``H_t`` = task curvature, ``B = ∇²ℓ̄_\\t(θ_LLM)``, ``H̄_\\t = δI + B``, ``H_{0+t} = H_0 + H_t``.
``d = 2``.

Gradient values are free symbol vectors: ``a = ∇ℓ̄_\\t(θ_LLM)``, ``b = ∇ℓ̄_t(θ_LLM)``,
``c = ∇ℓ̄_t(θ_t)``, ``e = ∇ℓ̄_\\t(θ_\\t)``. Premises (Eq. 10) eliminate ``a``, ``c`` and ``e``; the
Taylor premises are line 25 (``e := a + B(θ_\\t − θ_LLM)``) and Eq. 12
(``b := c + H_t(θ_LLM − θ_t)``). ``θ_\\t`` is a free vector in the equivalence checks.
"""

from __future__ import annotations

import sympy as sp

from gradmerge.theory.symbolic._check import SymbolicCheck
from gradmerge.theory.symbolic._util import (
    all_hold,
    at,
    decide,
    grad,
    hessian,
    inv,
    sqnorm,
    sym,
    vec,
)

D = 2


class _S:
    def __init__(self) -> None:
        self.h0, self.ht, self.b_hess = sym("H0", D), sym("Ht", D), sym("B", D)
        self.thl, self.tht, self.thr = vec("thL", D), vec("tht", D), vec("thr", D)  # thr = θ_\t
        self.al = sp.Symbol("alpha", real=True)
        self.delta = sp.Symbol("delta", positive=True)
        self.a, self.b, self.c, self.e = (vec(n, D) for n in ("a", "b", "c", "e"))
        self.eye = sp.eye(D)

    def eq10_subs(self) -> dict[sp.Symbol, sp.Expr]:
        """Eq. 10 solved for ``a`` (1st line), ``c`` (2nd line) and ``e`` (3rd line)."""
        a = -self.delta * self.thl - self.al * self.b
        c = -self.h0 * (self.tht - self.thl)
        e = -self.delta * self.thr
        pairs = [*zip(self.a, a, strict=True), *zip(self.c, c, strict=True)]
        pairs += list(zip(self.e, e, strict=True))
        return dict(pairs)

    def taylor_subs(self) -> dict[sp.Symbol, sp.Expr]:
        """Line 25 and Eq. 12, solved for ``e`` and ``b``."""
        e = self.a + self.b_hess * (self.thr - self.thl)
        b = self.c + self.ht * (self.thl - self.tht)
        return dict([*zip(self.e, e, strict=True), *zip(self.b, b, strict=True)])

    def res11(self) -> sp.Matrix:
        lhs = self.delta * (self.thr - self.thl) + self.al * self.h0 * (self.tht - self.thl)
        rhs = -(self.e - self.a) + self.al * (self.b - self.c)
        return lhs - rhs

    def res_l1(self) -> sp.Matrix:
        lhs = self.delta * (self.thr - self.thl) + self.al * self.h0 * (self.tht - self.thl)
        rhs = -self.b_hess * (self.thr - self.thl) + self.al * (self.ht * (self.thl - self.tht))
        return lhs - rhs

    def res_l2(self, thr: sp.Matrix | None = None) -> sp.Matrix:
        thr = self.thr if thr is None else thr
        lhs = (self.delta * self.eye + self.b_hess) * (thr - self.thl)
        return lhs + self.al * (self.h0 + self.ht) * (self.tht - self.thl)

    def line3(self) -> sp.Matrix:
        k = inv(self.delta * self.eye + self.b_hess)
        return self.thl - self.al * k * (self.h0 + self.ht) * (self.tht - self.thl)

    def eq13(self, hbar_r: sp.Matrix) -> sp.Matrix:
        return self.thl - self.al * inv(hbar_r) * (self.h0 + self.ht) * (self.tht - self.thl)


def eq11_from_eq10() -> bool:
    """Eq. 11 = line 3 − (line 1 − α_t line 2) of Eq. 10, for any loss."""
    s = _S()
    return decide(s.res11().subs(s.eq10_subs(), simultaneous=True))


def after29_line1() -> bool:
    """Eq. 11 with the Taylor premises (line 25, Eq. 12) is the first line after line 29."""
    s = _S()
    return decide(s.res11().subs(s.taylor_subs(), simultaneous=True) - s.res_l1())


def after29_line2() -> bool:
    """First and second line after line 29 have the same residual for every θ_\\t."""
    s = _S()
    return decide(s.res_l1() - s.res_l2())


def after29_line3_eq13() -> bool:
    """Third line after line 29 solves the second, and equals Eq. 13 with H̄_\\t = δI + B."""
    s = _S()
    solves = decide(s.res_l2(s.line3()))
    same = decide(s.line3() - s.eq13(s.delta * s.eye + s.b_hess))
    return all_hold([solves, same])


def eq13_exact_quadratic() -> bool:
    """Quadratic losses: Eq. 13 is the exact θ_\\t, for any α_t and any symmetric H_0.

    ``ℓ̄_\\t(θ) = ½θᵀBθ − rᵀθ``, ``ℓ̄_t(θ) = ½θᵀH_tθ − b_tᵀθ`` (linear regression:
    ``B = X_\\tᵀX_\\t``, ``H_t = X_tᵀX_t``). ``θ_LLM`` and ``θ_t`` are free; ``r`` and ``b_t`` are
    eliminated by the stationarity conditions of Eq. 9 and Eq. 15. Checks that H̄_\\t is the
    Hessian of Eq. 8's objective and that its gradient vanishes at Eq. 13 (unique minimiser for
    H̄_\\t ≻ 0).
    """
    s = _S()
    theta = vec("theta", D)
    bt = s.ht * s.tht + s.h0 * (s.tht - s.thl)  # Eq. 15: ∇ℓ̄_t(θ_t) = −H_0(θ_t − θ_LLM)
    r = (s.b_hess + s.al * s.ht + s.delta * s.eye) * s.thl - s.al * bt  # Eq. 9 stationarity
    loss_rest = sqnorm(theta, s.b_hess) / 2 - (r.T * theta)[0, 0]
    loss_t = sqnorm(theta, s.ht) / 2 - (bt.T * theta)[0, 0]
    reg = s.delta * sqnorm(theta) / 2
    checks = [
        decide(at(grad(loss_rest + s.al * loss_t + reg, theta), theta, s.thl)),  # premise sanity
        decide(at(grad(loss_t + sqnorm(theta - s.thl, s.h0) / 2, theta), theta, s.tht)),
    ]
    obj8 = loss_rest + reg
    hbar_r = hessian(loss_rest, theta) + s.delta * s.eye  # δI + ∇²ℓ̄_\t(θ_LLM)
    checks.append(decide(hessian(obj8, theta) - hbar_r))
    checks.append(decide(at(grad(obj8, theta), theta, s.eq13(hbar_r))))
    return all_hold(checks)


CHECKS: list[SymbolicCheck] = [
    SymbolicCheck(
        "eq11",
        "Eq. 11 (line 24)",
        "Eq. 10's three conditions combine to Eq. 11, for any loss",
        True,
        eq11_from_eq10,
    ),
    SymbolicCheck(
        "eq11-taylor-line1",
        "line 29, first line",
        "Eq. 11 with line 25 and Eq. 12 substituted gives the first line after line 29",
        True,
        after29_line1,
    ),
    SymbolicCheck(
        "eq11-taylor-line2",
        "line 29, second line",
        "[δI + ∇²ℓ̄_\\t](θ_\\t − θ_LLM) = −α_t(H_0 + H_t)(θ_t − θ_LLM) is the same equation",
        True,
        after29_line2,
    ),
    SymbolicCheck(
        "eq13",
        "line 29, third line; Eq. 13 (line 30)",
        "θ̂_\\t = θ_LLM − α_t H̄_\\t⁻¹(H_0 + H_t)(θ_t − θ_LLM) solves the second line",
        True,
        after29_line3_eq13,
    ),
    SymbolicCheck(
        "eq13-exact-quadratic",
        "Eq. 13, quadratic losses",
        "for quadratic losses Eq. 13 is the exact refit θ_\\t, any α_t and any H_0",
        True,
        eq13_exact_quadratic,
    ),
]
