"""Sec. 1.6 (lines 111-118): model merging as the MAP of Bayes' posterior (linear regression).

Notation: ``θ_LLM`` = base, ``θ_t`` = fine-tuned, ``θ_{1:T}`` = target, ``H_0`` = prior precision,
``H_t`` = task curvature, ``α_t`` weights, ``H̄ = H_0 + Σ_t α_t H_t``. ``d = 2``, ``T = 2``.
``J(θ) = (1 − Σα_t)[−½‖θ − θ_LLM‖²_{H_0}] + Σ_t α_t[−½‖θ − θ_t‖²_{H_0+H_t}]`` is line 114's
objective.

Erratum (line 114): printed ``θ_{1:T} = arg min_θ J(θ)``. ``∇²J = −H̄`` is negative definite, so
the stationary point is the *maximiser* (``J(θ_{1:T} + v) − J(θ_{1:T}) = −½ vᵀH̄v``), and ``J`` is
unbounded below: no minimiser exists. Corrected: ``arg max`` (consistent with
"maximum-a-posteriori", line 117). For the maximiser check ``H_0 = L Lᵀ``, ``H_t = M_t M_tᵀ`` and
``α_t = a_t²`` make ``vᵀH̄v`` an explicit sum of squares.

Note (not checked): in line 117 ``p(θ) Π p(D_t|θ)^{α_t} = p(θ) Π [p(θ|D_t)/p(θ)]^{α_t}`` holds only
up to the constant ``Π p(D_t)^{α_t}`` (Bayes' rule), i.e. "∝", which is what the chain needs; the
product's upper limit is printed ``D`` and should be ``T``.
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
    gaussian_logpdf,
    grad,
    hessian,
    inv,
    mat,
    msum,
    sqnorm,
    vec,
)

COL = (D, 1)


class _S(MergeSymbols):
    def __init__(self) -> None:
        super().__init__()
        self.theta = vec("theta", D)

    @property
    def hbar(self) -> sp.Matrix:
        return self.h0 + msum((self.al[t] * self.h[t] for t in range(T)), (D, D))

    def objective(self) -> sp.Expr:
        """Line 114's J(θ)."""
        prior = -sqnorm(self.theta - self.thl, self.h0) / 2
        posts = [-sqnorm(self.theta - self.th[t], self.h0 + self.h[t]) / 2 for t in range(T)]
        return (1 - sum(self.al)) * prior + sum(self.al[t] * posts[t] for t in range(T))

    def line113_rhs(self, x: sp.Matrix | None = None) -> sp.Matrix:
        x = self.theta if x is None else x
        add_sub = msum(
            (self.al[t] * self.h0 * (self.th[t] - x + x - self.thl) for t in range(T)), COL
        )
        curv = msum((self.al[t] * self.h[t] * (x - self.th[t]) for t in range(T)), COL)
        return -self.h0 * (x - self.thl) + add_sub - curv

    def stationary_point(self) -> sp.Matrix:
        """Solution of ∇J = 0: H̄⁻¹[(1 − Σα)H_0θ_LLM + Σ α_t(H_0 + H_t)θ_t]."""
        rhs = (1 - sum(self.al)) * self.h0 * self.thl + msum(
            (self.al[t] * (self.h0 + self.h[t]) * self.th[t] for t in range(T)), COL
        )
        return inv(self.hbar) * rhs


def line113_identity() -> bool:
    """Line 113's RHS = −H_0 × (residual of Eq. 2 with mismatch H_t(θ − θ_t)), for every θ."""
    s = _S()
    h0i = inv(s.h0)
    th_ta = s.thl + msum((s.al[t] * (s.th[t] - s.thl) for t in range(T)), COL)
    mism = msum((s.al[t] * h0i * s.h[t] * (s.theta - s.th[t]) for t in range(T)), COL)
    res2 = s.theta - (th_ta - mism)
    return decide(s.line113_rhs() + s.h0 * res2)


def line113_linear() -> bool:
    """Quadratic losses: line 113's RHS vanishes at the exact θ_{1:T}.

    ``ℓ̄_t(θ) = ½θᵀH_tθ − b_tᵀθ`` (linear regression: ``H_t = X_tᵀX_t``, ``b_t = X_tᵀy_t``);
    ``θ_t`` free and ``b_t`` eliminated by the fine-tune condition (Eq. 15). The exact θ_{1:T} is
    the stationary point of Σ α_t ℓ̄_t + ½‖θ − θ_LLM‖²_{H_0}, checked here too.
    """
    s = _S()
    bs = [s.h[t] * s.th[t] + s.h0 * (s.th[t] - s.thl) for t in range(T)]
    losses = [sqnorm(s.theta, s.h[t]) / 2 - (bs[t].T * s.theta)[0, 0] for t in range(T)]
    obj = sum(s.al[t] * losses[t] for t in range(T)) + sqnorm(s.theta - s.thl, s.h0) / 2
    exact = inv(s.hbar) * (s.h0 * s.thl + msum((s.al[t] * bs[t] for t in range(T)), COL))
    is_target = decide(at(grad(obj, s.theta), s.theta, exact))
    return all_hold([is_target, decide(s.line113_rhs(exact))])


def line114_stationarity() -> bool:
    """∇J(θ) equals line 113's RHS, for every θ."""
    s = _S()
    return decide(grad(s.objective(), s.theta) - s.line113_rhs())


def line114_hessian() -> bool:
    """∇²J = −(H_0 + Σ α_t H_t) = −H̄."""
    s = _S()
    return decide(hessian(s.objective(), s.theta) + s.hbar)


def _increment(s: _S) -> tuple[sp.Expr, sp.Matrix]:
    """``J(θ + v) − J(θ) − ∇J(θ)ᵀv`` for free θ, v (equals J(θ* + v) − J(θ*) where ∇J(θ*) = 0)."""
    v = vec("v", D)
    j = s.objective()
    lin = (grad(j, s.theta).T * v)[0, 0]
    return at(j, s.theta, s.theta + v) - j - lin, v


def line114_argmax_corrected() -> bool:
    """The stationary point θ_{1:T} of J is its global maximiser.

    (i) ``J(θ* + v) − J(θ*) = −½ vᵀH̄v`` (J is quadratic; generic H_0, H_t, α_t); (ii) with
    ``H_0 = LLᵀ``, ``H_t = M_tM_tᵀ``, ``α_t = a_t²``: ``vᵀH̄v = ‖Lᵀv‖² + Σ a_t²‖M_tᵀv‖² ≥ 0``.
    """
    s = _S()
    inc, v = _increment(s)
    taylor = decide(inc + sqnorm(v, s.hbar) / 2)
    lo = sp.Matrix([[sp.Symbol("L11"), 0], [sp.Symbol("L21"), sp.Symbol("L22")]])
    ms = [mat(f"M{t + 1}", D, D) for t in range(T)]
    a = [sp.Symbol(f"a{t + 1}", real=True) for t in range(T)]
    s.h0, s.h, s.al = lo * lo.T, [m * m.T for m in ms], [ai**2 for ai in a]
    sos = sqnorm(lo.T * v) + sum(s.al[t] * sqnorm(ms[t].T * v) for t in range(T))
    return all_hold([taylor, decide(sqnorm(v, s.hbar) - sos)])


def line114_argmin_printed() -> bool:
    """θ_{1:T} = arg min J, i.e. J(θ* + v) − J(θ*) ≥ 0 for all v.

    The increment is exactly ``−½vᵀH̄v`` (checked here); at the positive-definite instance
    H_0 = H_t = I, α_t = ½ and v = s·(1, 0) it is −s², negative and unbounded below: no minimiser.
    """
    s = _S()
    inc, v = _increment(s)
    if not decide(inc + sqnorm(v, s.hbar) / 2):
        raise AssertionError("increment identity failed")
    scale = sp.Symbol("s", real=True)
    inst = {x: sp.Integer(int(x.name[-2] == x.name[-1])) for m in [s.h0, *s.h] for x in m}
    inst.update({al: sp.Rational(1, 2) for al in s.al})
    inst.update({v[0]: scale, v[1]: sp.Integer(0)})
    value = sp.expand(inc.subs(inst))  # = −s²: θ, θ_LLM, θ_t drop out of the increment
    return bool(value.subs(scale, 1) >= 0)


def line117_product() -> bool:
    """log[p Π (p_t/p)^{α_t}] = log[p^{1−Σα_t} Π p_t^{α_t}] for positive densities p, p_t."""
    p = sp.Symbol("p", positive=True)
    ps = [sp.Symbol(f"p{t + 1}", positive=True) for t in range(T)]
    al = [sp.Symbol(f"alpha{t + 1}", real=True) for t in range(T)]
    lhs = sp.log(p * sp.Mul(*[(ps[t] / p) ** al[t] for t in range(T)]))
    rhs = sp.log(p ** (1 - sum(al)) * sp.Mul(*[ps[t] ** al[t] for t in range(T)]))
    return decide(sp.expand_log(lhs, force=True) - sp.expand_log(rhs, force=True))


def line118_objective() -> bool:
    """log[p(θ)^{1−Σα} Π p(θ|D_t)^{α_t}] with the Gaussians of lines 115-116 = J(θ) + constant."""
    s = _S()
    log_last = (1 - sum(s.al)) * gaussian_logpdf(s.theta, s.thl, s.h0) + sum(
        s.al[t] * gaussian_logpdf(s.theta, s.th[t], s.h0 + s.h[t]) for t in range(T)
    )
    return decide(grad(log_last, s.theta) - grad(s.objective(), s.theta))


CHECKS: list[SymbolicCheck] = [
    SymbolicCheck(
        "line113-rearrangement",
        "line 113",
        "line 113 is −H_0 × Eq. 2 with mismatch H_t(θ_{1:T} − θ_t) (θ_t ± θ_{1:T} added)",
        True,
        line113_identity,
    ),
    SymbolicCheck(
        "line113-linear",
        "line 113",
        "linear regression: line 113 holds at the exact θ_{1:T}",
        True,
        line113_linear,
    ),
    SymbolicCheck(
        "line114-stationarity",
        "line 114",
        "∇J(θ) = line 113's right-hand side",
        True,
        line114_stationarity,
    ),
    SymbolicCheck(
        "line114-hessian", "line 114", "∇²J = −(H_0 + Σ α_t H_t) = −H̄", True, line114_hessian
    ),
    SymbolicCheck(
        "line114-argmin-printed",
        "line 114",
        "θ_{1:T} = arg min_θ J(θ)",
        False,
        line114_argmin_printed,
    ),
    SymbolicCheck(
        "line114-argmax-corrected",
        "line 114",
        "θ_{1:T} = arg max_θ J(θ) (H_0 ≻ 0, H_t ⪰ 0, α_t ≥ 0)",
        True,
        line114_argmax_corrected,
    ),
    SymbolicCheck(
        "line117-product",
        "line 117",
        "p(θ) Π [p(θ|D_t)/p(θ)]^{α_t} = p(θ)^{1−Σα_t} Π p(θ|D_t)^{α_t}",
        True,
        line117_product,
    ),
    SymbolicCheck(
        "line118-objective",
        "line 118",
        "log of p(θ)^{1−Σα_t} Π p(θ|D_t)^{α_t} is J(θ) up to a constant",
        True,
        line118_objective,
    ),
]
