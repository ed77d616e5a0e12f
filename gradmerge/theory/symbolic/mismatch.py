"""Sec. 1.1 (lines 4-9, Eq. 1-2): task arithmetic plus the gradient mismatch.

Notation: ``θ_LLM`` = base model, ``θ_t`` = model fine-tuned on task ``t``, ``θ_{1:T}`` = target
model, ``H_0`` = prior precision (symmetric), ``α_t`` = task weights. Size: ``d = 2``, ``T = 2``.

The gradient values ``∇ℓ̄_t(θ_t)`` and ``∇ℓ̄_t(θ_{1:T})`` are *free* symbol vectors, so Eq. 1 and
Eq. 2 are proven for any loss. The premises are the stationarity conditions of line 5:

* (line 5, 2nd) ``H_0(θ_t − θ_LLM) = −∇ℓ̄_t(θ_t)``, used to eliminate ``∇ℓ̄_t(θ_t)``;
* (line 5, 3rd) ``H_0(θ_{1:T} − θ_LLM) = −Σ_t α_t ∇ℓ̄_t(θ_{1:T})``, used to eliminate ``θ_{1:T}``.

Erratum (line 5, 1st condition): printed ``θ_LLM = −∇ℓ̄_LLM(θ_LLM)``. The LLM is trained on
``ℓ̄_LLM(θ) + (δ/2)‖θ‖²`` (Eq. 7, and Eq. 10 writes ``δ θ_LLM = ...``), whose stationarity
condition is ``δ θ_LLM = −∇ℓ̄_LLM(θ_LLM)``; the printed form holds only for ``δ = 1``. It is not
used by Eq. 1-2, so the derivation itself is unaffected. Shown with a quadratic
``ℓ̄_LLM = ½‖y − Xθ‖²`` (``X`` 2x2).
"""

from __future__ import annotations

from typing import Any

import sympy as sp

from gradmerge.theory.symbolic._check import SymbolicCheck
from gradmerge.theory.symbolic._util import decide, grad, inv, mat, sym, vec

D = 2
T = 2


def _setup() -> dict[str, Any]:
    h0 = sym("H0", D)
    th_llm = vec("thL", D)
    th = [vec(f"th{t + 1}", D) for t in range(T)]
    al = [sp.Symbol(f"alpha{t + 1}", real=True) for t in range(T)]
    g_ft = [-h0 * (th[t] - th_llm) for t in range(T)]  # ∇ℓ̄_t(θ_t), eliminated by line 5 (2nd)
    g_m = [vec(f"gm{t + 1}", D) for t in range(T)]  # ∇ℓ̄_t(θ_{1:T}), free
    # line 5 (3rd), solved for θ_{1:T}
    th_m = th_llm - inv(h0) * sum((al[t] * g_m[t] for t in range(T)), sp.zeros(D, 1))
    return {"h0": h0, "thL": th_llm, "th": th, "al": al, "g_ft": g_ft, "g_m": g_m, "thm": th_m}


def eq1_holds() -> bool:
    """Eq. 1 = (3rd condition) − Σ_t α_t (2nd condition), for any loss."""
    s = _setup()
    h0, thl, th, al, g_ft, g_m, thm = (
        s[k] for k in ("h0", "thL", "th", "al", "g_ft", "g_m", "thm")
    )
    lhs = h0 * (thm - thl) - sum((al[t] * h0 * (th[t] - thl) for t in range(T)), sp.zeros(D, 1))
    rhs = -sum((al[t] * (g_m[t] - g_ft[t]) for t in range(T)), sp.zeros(D, 1))
    return decide(lhs - rhs)


def eq2_holds() -> bool:
    """Eq. 2: θ_{1:T} = θ_TA − Σ_t α_t H_0⁻¹ [∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t)], for any loss."""
    s = _setup()
    h0, thl, th, al, g_ft, g_m, thm = (
        s[k] for k in ("h0", "thL", "th", "al", "g_ft", "g_m", "thm")
    )
    th_ta = thl + sum((al[t] * (th[t] - thl) for t in range(T)), sp.zeros(D, 1))
    mismatch = sum((al[t] * inv(h0) * (g_m[t] - g_ft[t]) for t in range(T)), sp.zeros(D, 1))
    return decide(thm - (th_ta - mismatch))


def _llm_quadratic() -> tuple[sp.Matrix, sp.Matrix, sp.Symbol]:
    """θ_LLM = argmin ½‖y − Xθ‖² + (δ/2)‖θ‖² (Eq. 7) and ∇ℓ̄_LLM there."""
    x, y = mat("X", 2, D), vec("y", 2)
    delta = sp.Symbol("delta", positive=True)
    th = vec("th", D)
    loss = ((y - x * th).T * (y - x * th))[0, 0] / 2
    th_llm = inv(x.T * x + delta * sp.eye(D)) * x.T * y
    g = grad(loss, th).subs(dict(zip(th, th_llm, strict=True)))
    return th_llm, g, delta


def line5_first_printed() -> bool:
    """Printed: θ_LLM = −∇ℓ̄_LLM(θ_LLM) for the minimiser of Eq. 7 (false unless δ = 1)."""
    th_llm, g, _ = _llm_quadratic()
    return decide(th_llm + g)


def line5_first_corrected() -> bool:
    """Corrected: δ θ_LLM = −∇ℓ̄_LLM(θ_LLM) for the minimiser of Eq. 7."""
    th_llm, g, delta = _llm_quadratic()
    return decide(delta * th_llm + g)


CHECKS: list[SymbolicCheck] = [
    SymbolicCheck(
        "line5-first-printed",
        "line 5 (1st condition)",
        "θ_LLM = −∇ℓ̄_LLM(θ_LLM) is the stationarity condition of Eq. 7's objective",
        False,
        line5_first_printed,
    ),
    SymbolicCheck(
        "line5-first-corrected",
        "line 5 (1st condition)",
        "δθ_LLM = −∇ℓ̄_LLM(θ_LLM) is the stationarity condition of Eq. 7's objective",
        True,
        line5_first_corrected,
    ),
    SymbolicCheck(
        "eq1",
        "Eq. 1 (line 7)",
        "line 5 (3rd) − Σ α_t · line 5 (2nd) gives Eq. 1, for any loss",
        True,
        eq1_holds,
    ),
    SymbolicCheck(
        "eq2",
        "Eq. 2 (line 8)",
        "θ_{1:T} = θ_TA − Σ α_t H_0⁻¹[∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t)], for any loss",
        True,
        eq2_holds,
    ),
]
