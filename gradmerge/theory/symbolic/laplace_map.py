"""Sec. 1.5 (lines 55-86, Eq. 17-21, Theorem 1): merging as MAP estimation.

Notation: prior ``p(θ) = N(θ | θ_LLM, H_0⁻¹)``, likelihood ``p(D_t | θ) ∝ e^{−ℓ̄_t(θ)}``, weights
``α_t``, ``H̄ = H_0 + Σ_t α_t H_t``, ``H_{0+t} = H_0 + H_t``, ``r_t(θ) = p(θ | D_t) / p(θ)``.
``d = 2``, ``T = 2``. Densities are compared through the gradients of their logs (equal gradients ⇔
equal up to normalisation); a MAP is checked by a vanishing gradient plus a negative-definite
Hessian ``−H̄``.

Errata and notes:

(a) Line 65 / Eq. 19: the "second-order approximation at θ_t",
    ``ℓ̄_t(θ) ≈ ℓ̄_t(θ_t) + ½‖θ − θ_t‖²_{H_t}``, drops the first-order term, but θ_t is not a
    stationary point of ℓ̄_t: ``∇ℓ̄_t(θ_t) = −H_0(θ_t − θ_LLM)`` (Eq. 10, 2nd line). With the
    printed ``q_α`` the MAP is ``θ_LLM + H̄⁻¹ Σ_t α_t H_t(θ_t − θ_LLM)``, not Eq. 18, so the right
    half of Eq. 20 fails as printed. Corrected: keep ``∇ℓ̄_t(θ_t)ᵀ(θ − θ_t)``, equivalently use the
    Laplace posterior ``q(θ|D_t) = N(θ | θ_t, (H_0 + H_t)⁻¹)`` in
    ``q_α ∝ p(θ) Π_t [q(θ|D_t)/p(θ)]^{α_t}``; then the MAP is Eq. 18 exactly.
(b) Theorem 1, left half of Eq. 20, holds for any loss (undefined sympy functions ``ℓ̄_t``). Typos
    (not checked): the product's upper limit is printed ``D``, should be ``T`` (also line 117); the
    theorem text says "posterior p(D_t|θ)", which is the likelihood; the posterior is ``p(θ|D_t)``.
(c) Line 83 prints ``H_t = X_t X_tᵀ``; the Hessian of ``½‖y_t − X_tθ‖²`` is ``X_tᵀX_t`` (the printed
    matrix is ``n_t x n_t``; it is not conformable unless ``n_t = d``, and wrong even then).
(d) Line 83's last equality ``H_t(θ_{1:T} − θ_t) = ∇ log r_t(θ)|_{θ_{1:T}}`` is wrong (sign and an
    extra term): ``∇ log r_t(θ) = −∇ℓ̄_t(θ) = −H_t(θ − θ_t) + H_0(θ_t − θ_LLM)``. Corrected: the
    mismatch is ``∇ log r_t(θ_t) − ∇ log r_t(θ_{1:T})``.
(e) Line 84 / Eq. 21: for linear models the Taylor step Eq. 21 is exact; ``p_α = q_α`` holds for the
    corrected ``q_α`` and fails for the printed one. (Line 84 also writes ``p_α(θ|D_t)`` for
    ``p_α(θ|D_{1:T})``.)
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
    decide_equal,
    gaussian_logpdf,
    grad,
    hessian,
    inv,
    lsq_loss,
    mat,
    msum,
    sqnorm,
    sym,
    vec,
)

COL = (D, 1)


class _S(MergeSymbols):
    """Generic symbols: any loss, curvatures H_t symmetric, θ_t and θ free."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = vec("theta", D)
        self.hbar = self.h0 + msum((self.al[t] * self.h[t] for t in range(T)), (D, D))

    def log_prior(self) -> sp.Expr:
        return gaussian_logpdf(self.theta, self.thl, self.h0)

    def g_ft(self, t: int) -> sp.Matrix:
        """∇ℓ̄_t(θ_t) from the fine-tune condition (Eq. 10, second line)."""
        return -self.h0 * (self.th[t] - self.thl)

    def log_q_printed(self) -> sp.Expr:
        """Eq. 19 as printed (constants dropped)."""
        quad = sum(self.al[t] * sqnorm(self.theta - self.th[t], self.h[t]) / 2 for t in range(T))
        return self.log_prior() - quad

    def log_q_corrected(self) -> sp.Expr:
        """Eq. 19 with the first-order term ∇ℓ̄_t(θ_t)ᵀ(θ − θ_t) kept (constants dropped)."""
        approx = [
            (self.g_ft(t).T * (self.theta - self.th[t]))[0, 0]
            + sqnorm(self.theta - self.th[t], self.h[t]) / 2
            for t in range(T)
        ]
        return self.log_prior() - sum(self.al[t] * approx[t] for t in range(T))

    def log_q_laplace_ratio(self) -> sp.Expr:
        """log p(θ) + Σ α_t log[N(θ|θ_t, (H_0 + H_t)⁻¹) / p(θ)]."""
        ratios = [
            gaussian_logpdf(self.theta, self.th[t], self.h0 + self.h[t]) - self.log_prior()
            for t in range(T)
        ]
        return self.log_prior() + sum(self.al[t] * ratios[t] for t in range(T))

    def eq18(self) -> sp.Matrix:
        k = inv(self.hbar)
        terms = (self.al[t] * k * (self.h0 + self.h[t]) * (self.th[t] - self.thl) for t in range(T))
        return self.thl + msum(terms, COL)

    def map_is(self, log_density: sp.Expr, point: sp.Matrix) -> bool:
        """Gradient of ``log_density`` vanishes at ``point`` and its Hessian is −H̄."""
        stationary = decide(at(grad(log_density, self.theta), self.theta, point))
        concave = decide(hessian(log_density, self.theta) + self.hbar)
        return all_hold([stationary, concave])


# ---------------------------------------------------------------- (a) line 65, Eq. 19, Eq. 20 right


def _quadratic_task() -> tuple[sp.Matrix, sp.Matrix, sp.Expr, sp.Matrix, sp.Matrix, sp.Matrix]:
    """Linear regression task (X_t 2x2) with its fine-tuned θ_t (Eq. 15, closed form)."""
    h0, thl, theta = sym("H0", D), vec("thL", D), vec("theta", D)
    x, y = mat("Xt", 2, D), vec("yt", 2)
    tht = inv(h0 + x.T * x) * (h0 * thl + x.T * y)
    return h0, thl, lsq_loss(x, y, theta), theta, tht, x.T * x


def line65_printed() -> bool:
    """ℓ̄_t(θ) = ℓ̄_t(θ_t) + ½‖θ − θ_t‖²_{H_t} for quadratic ℓ̄_t (second order is exact there)."""
    _, _, loss, theta, tht, ht = _quadratic_task()
    return decide(loss - at(loss, theta, tht) - sqnorm(theta - tht, ht) / 2)


def line65_corrected() -> bool:
    """ℓ̄_t(θ) = ℓ̄_t(θ_t) − (θ_t − θ_LLM)ᵀH_0(θ − θ_t) + ½‖θ − θ_t‖²_{H_t} for quadratic ℓ̄_t."""
    h0, thl, loss, theta, tht, ht = _quadratic_task()
    first = (-(h0 * (tht - thl)).T * (theta - tht))[0, 0]
    return decide(loss - at(loss, theta, tht) - first - sqnorm(theta - tht, ht) / 2)


def eq20_right_printed() -> bool:
    """Eq. 18 is the MAP of the printed q_α (Eq. 19)."""
    s = _S()
    return s.map_is(s.log_q_printed(), s.eq18())


def printed_q_map() -> bool:
    """The printed q_α's MAP is θ_LLM + H̄⁻¹ Σ α_t H_t(θ_t − θ_LLM)."""
    s = _S()
    terms = (s.al[t] * s.h[t] * (s.th[t] - s.thl) for t in range(T))
    return s.map_is(s.log_q_printed(), s.thl + inv(s.hbar) * msum(terms, COL))


def eq20_right_corrected() -> bool:
    """Eq. 18 is the MAP of the corrected q_α (first-order term kept)."""
    s = _S()
    return s.map_is(s.log_q_corrected(), s.eq18())


def laplace_ratio_form() -> bool:
    """Corrected q_α ∝ p(θ) Π [N(θ|θ_t, (H_0+H_t)⁻¹)/p(θ)]^{α_t} (log-density gradients agree)."""
    s = _S()
    return decide(grad(s.log_q_corrected(), s.theta) - grad(s.log_q_laplace_ratio(), s.theta))


# ---------------------------------------------------------------- (b) Theorem 1, left half


def _left_objective() -> tuple[_S, sp.Expr, list[sp.Matrix]]:
    """log p(θ) + Σ α_t log[p(θ|D_t)/p(θ)], p(θ|D_t) = p(θ) e^{−ℓ̄_t(θ)} / Z_t, any ℓ̄_t."""
    s = _S()
    losses = [sp.Function(f"ell{t + 1}")(*s.theta) for t in range(T)]
    zs = [sp.Symbol(f"Z{t + 1}", positive=True) for t in range(T)]
    log_post = [s.log_prior() - losses[t] - sp.log(zs[t]) for t in range(T)]
    obj = s.log_prior() + sum(s.al[t] * (log_post[t] - s.log_prior()) for t in range(T))
    return s, obj, [grad(loss, s.theta) for loss in losses]


def eq20_left_stationarity() -> bool:
    """∇ of the left objective = −H_0(θ − θ_LLM) − Σ α_t ∇ℓ̄_t(θ) (line 5, third condition)."""
    s, obj, grads = _left_objective()
    target = -s.h0 * (s.theta - s.thl) - msum((s.al[t] * grads[t] for t in range(T)), COL)
    return decide(grad(obj, s.theta) - target)


def eq20_left_eq17() -> bool:
    """Residual of Eq. 17 = −H_0⁻¹ ∇(left objective), given Eq. 10 (2nd): stationarity ⇔ Eq. 17."""
    s, obj, grads = _left_objective()
    h0i = inv(s.h0)
    th_ta = s.thl + msum((s.al[t] * (s.th[t] - s.thl) for t in range(T)), COL)
    mism = msum((s.al[t] * h0i * (grads[t] - s.g_ft(t)) for t in range(T)), COL)
    res17 = s.theta - (th_ta - mism)
    return decide(res17 + h0i * grad(obj, s.theta))


# ------------------------------------------------- (c)-(e) linear regression, line 83


class _Lin:
    """Two linear-regression tasks, 1 row each; θ_t fine-tuned (Eq. 15), θ_{1:T} exact."""

    def __init__(self, rows: int = 1) -> None:
        self.s = _S()
        s = self.s
        self.x = [mat(f"X{t + 1}", rows, D) for t in range(T)]
        self.y = [vec(f"y{t + 1}", rows) for t in range(T)]
        s.h = [self.x[t].T * self.x[t] for t in range(T)]
        s.hbar = s.h0 + msum((s.al[t] * s.h[t] for t in range(T)), (D, D))
        s.th = [inv(s.h0 + s.h[t]) * (s.h0 * s.thl + self.x[t].T * self.y[t]) for t in range(T)]
        self.loss = [lsq_loss(self.x[t], self.y[t], s.theta) for t in range(T)]
        rhs = s.h0 * s.thl + msum((s.al[t] * self.x[t].T * self.y[t] for t in range(T)), COL)
        self.th_merged = inv(s.hbar) * rhs

    def grad_loss(self, t: int, point: sp.Matrix | None = None) -> sp.Matrix:
        g = grad(self.loss[t], self.s.theta)
        return g if point is None else at(g, self.s.theta, point)

    def grad_log_ratio(self, t: int, point: sp.Matrix | None = None) -> sp.Matrix:
        """∇ log[N(θ|θ_t, (H_0+H_t)⁻¹) / N(θ|θ_LLM, H_0⁻¹)]."""
        s = self.s
        log_r = gaussian_logpdf(s.theta, s.th[t], s.h0 + s.h[t]) - s.log_prior()
        g = grad(log_r, s.theta)
        return g if point is None else at(g, s.theta, point)


def line83_gradient() -> bool:
    """∇ℓ̄_t(θ) = X_tᵀ(X_tθ − y_t) and ∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t) = X_tᵀX_t(θ_{1:T} − θ_t)."""
    th, x, y, th_a, th_b = vec("theta", D), mat("Xt", 2, D), vec("yt", 2), vec("a", D), vec("b", D)
    g = grad(lsq_loss(x, y, th), th)
    mismatch = at(g, th, th_a) - at(g, th, th_b)
    return all_hold([decide(g - x.T * (x * th - y)), decide(mismatch - x.T * x * (th_a - th_b))])


def _line83_hessian(printed: bool) -> bool:
    results = []
    for rows in (1, 2):
        th, x, y = vec("theta", D), mat("Xt", rows, D), vec("yt", rows)
        claimed = x * x.T if printed else x.T * x
        results.append(decide_equal(hessian(lsq_loss(x, y, th), th), claimed))
    return all_hold(results)


def line83_hessian_printed() -> bool:
    """H_t = ∇²½‖y_t − X_tθ‖² = X_t X_tᵀ, for n_t = 1 (not conformable) and n_t = d = 2."""
    return _line83_hessian(printed=True)


def line83_hessian_corrected() -> bool:
    """H_t = X_tᵀ X_t, for n_t = 1 and n_t = 2."""
    return _line83_hessian(printed=False)


def line116_posterior() -> bool:
    """Linear model: p(θ) e^{−ℓ̄_t(θ)} ∝ N(θ | θ_t, (H_0 + H_t)⁻¹) (θ_t from Eq. 15)."""
    lin = _Lin()
    s = lin.s
    results = []
    for t in range(T):
        lhs = grad(s.log_prior() - lin.loss[t], s.theta)
        rhs = grad(gaussian_logpdf(s.theta, s.th[t], s.h0 + s.h[t]), s.theta)
        results.append(decide(lhs - rhs))
    return all_hold(results)


def line83_ratio_printed() -> bool:
    """H_t(θ_{1:T} − θ_t) = ∇ log r_t(θ)|_{θ=θ_{1:T}} (θ_{1:T} the exact linear-model merge)."""
    lin = _Lin()
    s = lin.s
    return decide(s.h[0] * (lin.th_merged - s.th[0]) - lin.grad_log_ratio(0, lin.th_merged))


def line83_ratio_corrected() -> bool:
    """∇ log r_t = −∇ℓ̄_t, hence ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t) = ∇ log r_t(θ_t) − ∇ log r_t(θ), any θ."""
    lin = _Lin()
    s = lin.s
    t = 0
    same = decide(lin.grad_log_ratio(t) + lin.grad_loss(t))
    mismatch = lin.grad_loss(t) - lin.grad_loss(t, s.th[t])
    corrected = lin.grad_log_ratio(t, s.th[t]) - lin.grad_log_ratio(t)
    return all_hold([same, decide(mismatch - corrected)])


def eq21_exact_linear() -> bool:
    """Eq. 21: ∇ℓ̄_t(θ) = ∇ℓ̄_t(θ_t) + H_t(θ − θ_t) exactly for ℓ̄_t = ½‖y_t − X_tθ‖², any θ,
    θ_t."""
    th, tht, x, y = vec("theta", D), vec("tht", D), mat("Xt", 2, D), vec("yt", 2)
    g = grad(lsq_loss(x, y, th), th)
    return decide(g - at(g, th, tht) - x.T * x * (th - tht))


def _p_alpha_minus_q(corrected: bool) -> sp.Matrix:
    lin = _Lin()
    s = lin.s
    log_p = s.log_prior() - sum(s.al[t] * lin.loss[t] for t in range(T))
    log_q = s.log_q_corrected() if corrected else s.log_q_printed()
    return grad(log_p, s.theta) - grad(log_q, s.theta)


def line84_printed() -> bool:
    """Linear model: p_α(θ|D_{1:T}) = q_α(θ|D_{1:T}) with the printed q_α (Eq. 19)."""
    return decide(_p_alpha_minus_q(corrected=False))


def line84_corrected() -> bool:
    """Linear model: p_α = q_α with the corrected q_α."""
    return decide(_p_alpha_minus_q(corrected=True))


CHECKS: list[SymbolicCheck] = [
    SymbolicCheck(
        "line65-taylor-printed",
        "line 65",
        "ℓ̄_t(θ) = ℓ̄_t(θ_t) + ½‖θ − θ_t‖²_{H_t} for quadratic ℓ̄_t (θ_t fine-tuned)",
        False,
        line65_printed,
    ),
    SymbolicCheck(
        "line65-taylor-corrected",
        "line 65",
        "ℓ̄_t(θ) = ℓ̄_t(θ_t) − (θ_t − θ_LLM)ᵀH_0(θ − θ_t) + ½‖θ − θ_t‖²_{H_t}, quadratic ℓ̄_t",
        True,
        line65_corrected,
    ),
    SymbolicCheck(
        "eq20-right-printed",
        "Eq. 19-20 (Theorem 1, right)",
        "Eq. 18 = argmax of the printed q_α",
        False,
        eq20_right_printed,
    ),
    SymbolicCheck(
        "eq19-printed-map",
        "Eq. 19 (printed q_α)",
        "argmax of the printed q_α = θ_LLM + H̄⁻¹ Σ α_t H_t(θ_t − θ_LLM)",
        True,
        printed_q_map,
    ),
    SymbolicCheck(
        "eq20-right-corrected",
        "Eq. 19-20 (Theorem 1, right)",
        "Eq. 18 = argmax of q_α with the first-order term ∇ℓ̄_t(θ_t)ᵀ(θ − θ_t) kept",
        True,
        eq20_right_corrected,
    ),
    SymbolicCheck(
        "eq19-laplace-ratio",
        "Eq. 19 (corrected)",
        "corrected q_α ∝ p(θ) Π [N(θ|θ_t,(H_0 + H_t)⁻¹)/p(θ)]^{α_t}",
        True,
        laplace_ratio_form,
    ),
    SymbolicCheck(
        "eq20-left-stationarity",
        "Eq. 20 (Theorem 1, left)",
        "∇ log[p(θ) Π (p(θ|D_t)/p(θ))^{α_t}] = −H_0(θ − θ_LLM) − Σ α_t ∇ℓ̄_t(θ), any loss",
        True,
        eq20_left_stationarity,
    ),
    SymbolicCheck(
        "eq20-left-eq17",
        "Eq. 17, Eq. 20 (Theorem 1, left)",
        "the left objective's stationarity condition is Eq. 17, any loss",
        True,
        eq20_left_eq17,
    ),
    SymbolicCheck(
        "line83-gradient",
        "line 82-83",
        "∇ℓ̄_t = X_tᵀ(X_tθ − y_t) and mismatch = X_tᵀX_t(θ_{1:T} − θ_t)",
        True,
        line83_gradient,
    ),
    SymbolicCheck(
        "line83-hessian-printed",
        "line 83",
        "H_t = ∇²½‖y_t − X_tθ‖² = X_t X_tᵀ",
        False,
        line83_hessian_printed,
    ),
    SymbolicCheck(
        "line83-hessian-corrected",
        "line 83",
        "H_t = ∇²½‖y_t − X_tθ‖² = X_tᵀ X_t",
        True,
        line83_hessian_corrected,
    ),
    SymbolicCheck(
        "line116-posterior",
        "lines 115-116",
        "linear model: p(θ|D_t) = N(θ | θ_t, (H_0 + H_t)⁻¹)",
        True,
        line116_posterior,
    ),
    SymbolicCheck(
        "line83-ratio-printed",
        "line 83 (last equality)",
        "H_t(θ_{1:T} − θ_t) = ∇ log[p(θ|D_t)/p(θ)] at θ_{1:T}",
        False,
        line83_ratio_printed,
    ),
    SymbolicCheck(
        "line83-ratio-corrected",
        "line 83 (last equality)",
        "∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t) = ∇ log r_t(θ_t) − ∇ log r_t(θ_{1:T}), r_t = p(θ|D_t)/p(θ)",
        True,
        line83_ratio_corrected,
    ),
    SymbolicCheck(
        "eq21-exact-linear",
        "Eq. 21 (line 84)",
        "Taylor's ∇ℓ̄_t(θ) ≈ ∇ℓ̄_t(θ_t) + H_t(θ − θ_t) is exact for linear regression",
        True,
        eq21_exact_linear,
    ),
    SymbolicCheck(
        "line84-p-eq-q-printed",
        "line 84",
        "linear model: p_α = q_α with the printed q_α",
        False,
        line84_printed,
    ),
    SymbolicCheck(
        "line84-p-eq-q-corrected",
        "line 84",
        "linear model: p_α = q_α with the corrected q_α",
        True,
        line84_corrected,
    ),
]
