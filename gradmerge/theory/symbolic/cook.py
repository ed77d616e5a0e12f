"""Sec. 1.4 (lines 31-46, Eq. 14-16): Eq. 13 reduces to Cook's formula for ridge regression.

Notation: full data ``(X, y)`` = remaining data ``(X_\\t, y_\\t)`` stacked over removed data
``(X_t, y_t)``; ``H̄ = XᵀX + δI``, ``H̄_\\t = X_\\tᵀX_\\t + δI``, ``H_t = X_tᵀX_t``, ``H_0`` = prior
precision of the fine-tune (generic symmetric), ``θ_t`` = fine-tuned (Eq. 15). ``d = 2``.

The remaining data enter only through ``B = X_\\tᵀX_\\t`` (generic symmetric, so any number of rows)
and ``r = X_\\tᵀy_\\t``; the removed data ``X_t`` is one explicit symbolic row (Cook's setting). The
Hessian checks of line 38 use an explicit 2x2 ``X``.

Errata:

* line 37 prints ``θ_\\t = H̄_\\t⁻¹ Xᵀ y`` (full data); the minimiser of Eq. 8 is
  ``H̄_\\t⁻¹ X_\\tᵀ y_\\t``.
* line 38 prints ``H̄ = ∇²[½‖y − Xθ‖² + ½‖θ‖²] = XᵀX + δI``; that Hessian is ``XᵀX + I``. The
  objective meant (Eq. 7) is ``½‖y − Xθ‖² + (δ/2)‖θ‖²``, whose Hessian is ``XᵀX + δI``.
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
    lsq_loss,
    mat,
    sqnorm,
    sym,
    vec,
)

D = 2


class _S:
    def __init__(self) -> None:
        self.b, self.r = sym("B", D), vec("r", D)  # X_\tᵀX_\t, X_\tᵀy_\t
        self.xt, self.yt = mat("Xt", 1, D), vec("yt", 1)
        self.delta = sp.Symbol("delta", positive=True)
        self.eye = sp.eye(D)
        self.ht = self.xt.T * self.xt
        self.hbar = self.b + self.ht + self.delta * self.eye
        self.hbar_r = self.b + self.delta * self.eye
        self.xty = self.r + self.xt.T * self.yt  # Xᵀy of the full data
        self.theta = vec("theta", D)
        # loss of the remaining data, up to a θ-independent constant
        self.loss_r = sqnorm(self.theta, self.b) / 2 - (self.r.T * self.theta)[0, 0]
        self.loss_t = lsq_loss(self.xt, self.yt, self.theta)

    def theta_llm(self) -> sp.Matrix:
        return inv(self.hbar) * self.xty

    def obj8_grad_at(self, value: sp.Matrix) -> sp.Matrix:
        obj = self.loss_r + self.delta * sqnorm(self.theta) / 2
        return at(grad(obj, self.theta), self.theta, value)


def line37_llm() -> bool:
    """θ_LLM = H̄⁻¹Xᵀy is the minimiser of ½‖y − Xθ‖² + (δ/2)‖θ‖² (gradient vanishes there)."""
    s = _S()
    obj = s.loss_r + s.loss_t + s.delta * sqnorm(s.theta) / 2
    return decide(at(grad(obj, s.theta), s.theta, s.theta_llm()))


def line37_removed_printed() -> bool:
    """Printed: θ_\\t = H̄_\\t⁻¹ Xᵀ y (full data) minimises Eq. 8's objective."""
    s = _S()
    return decide(s.obj8_grad_at(inv(s.hbar_r) * s.xty))


def line37_removed_corrected() -> bool:
    """Corrected: θ_\\t = H̄_\\t⁻¹ X_\\tᵀ y_\\t minimises Eq. 8's objective."""
    s = _S()
    return decide(s.obj8_grad_at(inv(s.hbar_r) * s.r))


def _line38(weight: sp.Expr) -> bool:
    x, y, th = mat("X", 2, D), vec("y", 2), vec("theta", D)
    delta = sp.Symbol("delta", positive=True)
    obj = lsq_loss(x, y, th) + weight * sqnorm(th) / 2
    return decide(hessian(obj, th) - (x.T * x + delta * sp.eye(D)))


def line38_printed() -> bool:
    """Printed: ∇²[½‖y − Xθ‖² + ½‖θ‖²] = XᵀX + δI."""
    return _line38(sp.Integer(1))


def line38_corrected() -> bool:
    """Corrected: ∇²[½‖y − Xθ‖² + (δ/2)‖θ‖²] = XᵀX + δI, and likewise H̄_\\t for Eq. 8."""
    s = _S()
    hr = hessian(s.loss_r + s.delta * sqnorm(s.theta) / 2, s.theta)
    return all_hold([_line38(sp.Symbol("delta", positive=True)), decide(hr - s.hbar_r)])


def eq14_cook() -> bool:
    """Eq. 14: θ_\\t − θ_LLM = H̄_\\t⁻¹ X_tᵀ(X_t θ_LLM − y_t) for ridge regression."""
    s = _S()
    thl = s.theta_llm()
    return decide(inv(s.hbar_r) * s.r - thl - inv(s.hbar_r) * s.xt.T * (s.xt * thl - s.yt))


def _fine_tune() -> tuple[_S, sp.Matrix, sp.Matrix, sp.Matrix]:
    """Generic θ_LLM, H_0, H̄_\\t (any symmetric) and θ_t from line 43's relation."""
    s = _S()
    h0, thl, hr = sym("H0", D), vec("thL", D), sym("Hr", D)
    s.hbar_r = hr
    tht = inv(h0 + s.ht) * (h0 * thl + s.xt.T * s.yt)
    return s, h0, thl, tht


def line43() -> bool:
    """Line 43: Eq. 15's stationarity ⇔ (H_0 + H_t)θ_t = H_0θ_LLM + X_tᵀy_t (same residual)."""
    s = _S()
    h0, thl, tht = sym("H0", D), vec("thL", D), vec("tht", D)
    stat = at(grad(s.loss_t + sqnorm(s.theta - thl, h0) / 2, s.theta), s.theta, tht)
    left = h0 * (tht - thl) - s.xt.T * (s.yt - s.xt * tht)
    right = (h0 + s.ht) * tht - (h0 * thl + s.xt.T * s.yt)
    return all_hold([decide(stat - left), decide(left - right)])


def _eq16_lines() -> list[sp.Matrix]:
    s, h0, thl, tht = _fine_tune()
    k, ht, xt, yt = inv(s.hbar_r), s.ht, s.xt, s.yt
    return [
        thl - k * (h0 + ht) * (tht - thl),
        thl - k * ((h0 + ht) * tht - (h0 + ht) * thl),
        thl - k * (h0 * thl + xt.T * yt - (h0 + ht) * thl),
        thl - k * (xt.T * yt - ht * thl),
        thl - k * (xt.T * yt - xt.T * xt * thl),
        thl + k * xt.T * (xt * thl - yt),
    ]


def _eq16_step(i: int) -> bool:
    lines = _eq16_lines()
    return decide(lines[i] - lines[i - 1])


def eq13_alpha1_is_eq14() -> bool:
    """Eq. 13 with α_t = 1 (first line of Eq. 16) equals θ_LLM + RHS of Eq. 14 (last line)."""
    lines = _eq16_lines()
    return decide(lines[0] - lines[-1])


def _step_check(i: int) -> SymbolicCheck:
    return SymbolicCheck(
        f"eq16-step{i}",
        f"Eq. 16, line {i + 1} (line 45)",
        f"line {i + 1} of Eq. 16 equals line {i}, given line 43's relation",
        True,
        lambda: _eq16_step(i),
    )


CHECKS: list[SymbolicCheck] = [
    SymbolicCheck(
        "line37-llm",
        "line 37",
        "θ_LLM = H̄⁻¹Xᵀy minimises ½‖y − Xθ‖² + (δ/2)‖θ‖²",
        True,
        line37_llm,
    ),
    SymbolicCheck(
        "line37-removed-printed",
        "line 37",
        "θ_\\t = H̄_\\t⁻¹ Xᵀ y (full data) minimises Eq. 8's objective",
        False,
        line37_removed_printed,
    ),
    SymbolicCheck(
        "line37-removed-corrected",
        "line 37",
        "θ_\\t = H̄_\\t⁻¹ X_\\tᵀ y_\\t minimises Eq. 8's objective",
        True,
        line37_removed_corrected,
    ),
    SymbolicCheck(
        "line38-hessian-printed",
        "line 38",
        "∇²[½‖y − Xθ‖² + ½‖θ‖²] = XᵀX + δI",
        False,
        line38_printed,
    ),
    SymbolicCheck(
        "line38-hessian-corrected",
        "line 38",
        "∇²[½‖y − Xθ‖² + (δ/2)‖θ‖²] = XᵀX + δI (and H̄_\\t = X_\\tᵀX_\\t + δI)",
        True,
        line38_corrected,
    ),
    SymbolicCheck(
        "eq14", "Eq. 14 (line 39)", "Cook's formula holds for ridge regression", True, eq14_cook
    ),
    SymbolicCheck(
        "line43",
        "line 43",
        "Eq. 15 stationarity ⇔ (H_0 + H_t)θ_t = H_0θ_LLM + X_tᵀy_t, H_t = X_tᵀX_t",
        True,
        line43,
    ),
    *[_step_check(i) for i in range(1, 6)],
    SymbolicCheck(
        "eq16-eq13-alpha1-is-eq14",
        "Eq. 16 (line 46)",
        "Eq. 13 with α_t = 1 equals θ_LLM + H̄_\\t⁻¹X_tᵀ(X_tθ_LLM − y_t) (Eq. 14)",
        True,
        eq13_alpha1_is_eq14,
    ),
]
