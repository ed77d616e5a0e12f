"""Tests of :mod:`gradmerge.theory.linear` against independent references.

References: torch.autograd (torch.func) for derivatives, ``numpy.linalg.lstsq`` and statsmodels
OLS/WLS for unregularised fits, an augmented least-squares problem (QR route, not the normal
equations) for regularised fits, and the paper's stationarity conditions (Sec. 1.1, Eq. 10).
"""

from __future__ import annotations

import numpy as np
import statsmodels.api as sm
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradmerge.theory import linear
from gradmerge.theory.problems import random_spd

F64 = torch.float64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (Frobenius)."""
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def stationarity_residual(lhs: torch.Tensor, rhs: torch.Tensor) -> float:
    """‖lhs − rhs‖ / (‖lhs‖ + ‖rhs‖)."""
    return float(torch.linalg.norm(lhs - rhs) / (torch.linalg.norm(lhs) + torch.linalg.norm(rhs)))


def data(seed: int, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, generator=g, dtype=F64)


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 15),
    d=st.integers(1, 6),
    weighted=st.booleans(),
)
def test_loss_gradient_hessian_match_autograd(seed: int, n: int, d: int, weighted: bool) -> None:
    X, y = data(seed, n, d)
    g = torch.Generator().manual_seed(seed + 1)
    theta = torch.randn(d, generator=g, dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) + 0.1 if weighted else None

    def reference(th: torch.Tensor) -> torch.Tensor:
        r = y - X @ th
        ww = torch.ones(n, dtype=F64) if w is None else w
        return 0.5 * torch.dot(ww, r**2)

    assert (
        abs(float(linear.loss(theta, X, y, w) - reference(theta)))
        <= 1e-12 * float(reference(theta)) + 1e-300
    )
    grad_ref = torch.func.grad(reference)(theta)
    hess_ref = torch.func.hessian(reference)(theta)
    assert rel_err(linear.gradient(theta, X, y, w), grad_ref) <= 1e-12
    assert rel_err(linear.hessian(theta, X, y, w), hess_ref) <= 1e-12


def test_fit_unregularised_matches_lstsq_and_statsmodels_ols() -> None:
    X, y = data(0, 60, 7)
    theta = linear.fit(X, y, prior_precision=0.0)
    lstsq = np.linalg.lstsq(X.numpy(), y.numpy(), rcond=None)[0]
    ols = sm.OLS(y.numpy(), X.numpy()).fit().params
    assert rel_err(theta, torch.from_numpy(lstsq)) <= 1e-10
    assert rel_err(theta, torch.from_numpy(np.asarray(ols))) <= 1e-10


def test_fit_weighted_unregularised_matches_statsmodels_wls() -> None:
    X1, y1 = data(1, 30, 5)
    X2, y2 = data(2, 25, 5)
    theta = linear.fit_weighted([(X1, y1, 0.3), (X2, y2, 2.5)], prior_precision=0.0)
    w = np.concatenate([np.full(30, 0.3), np.full(25, 2.5)])
    X = np.concatenate([X1.numpy(), X2.numpy()])
    y = np.concatenate([y1.numpy(), y2.numpy()])
    wls = sm.WLS(y, X, weights=w).fit().params
    assert rel_err(theta, torch.from_numpy(np.asarray(wls))) <= 1e-10


@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 20),
    d=st.integers(1, 8),
    weight=st.floats(0.01, 100.0),
)
def test_fit_regularised_matches_augmented_least_squares(
    seed: int, n: int, d: int, weight: float
) -> None:
    """argmin w·½‖y − Xθ‖² + ½‖θ − m‖²_P is the least-squares solution of the stacked system
    [√w X; Lᵀ] θ ≈ [√w y; Lᵀ m] with P = L Lᵀ — solved by numpy's SVD least squares, an
    independent route that never forms the normal equations."""
    X, y = data(seed, n, d)
    g = torch.Generator().manual_seed(seed + 7)
    P = random_spd(d, condition=50.0, scale=2.0, generator=g)
    m = torch.randn(d, generator=g, dtype=F64)
    theta = linear.fit(X, y, prior_precision=P, prior_mean=m, weight=weight)
    L = torch.linalg.cholesky(P)
    A = torch.cat([weight**0.5 * X, L.T]).numpy()
    b = torch.cat([weight**0.5 * y, L.T @ m]).numpy()
    ref = torch.from_numpy(np.linalg.lstsq(A, b, rcond=None)[0])
    assert rel_err(theta, ref) <= 1e-10
    # normal equations: w Xᵀ(Xθ − y) + P(θ − m) = 0
    lhs = weight * linear.gradient(theta, X, y)
    assert stationarity_residual(lhs, -P @ (theta - m)) <= 1e-10


def test_merge_problem_stationarity_and_exact_merge() -> None:
    """Sec. 1.1 stationarity conditions; Eq. 6 (exact for quadratic losses); α = 0 gives θ_LLM."""
    pr = linear.make_linear_merge_problem(
        3, d=8, tasks=3, n_per_task=5, condition=1e3, prior_condition=1e2, covariate_shift=0.5
    )
    H0, base = pr.prior_precision, pr.theta_llm
    grad_pt = linear.gradient(base, pr.X_pt, pr.y_pt)
    assert stationarity_residual(pr.delta * base, -grad_pt) <= 1e-10  # Eq. 7
    for t in range(pr.num_tasks):
        th = pr.finetuned(t)
        assert stationarity_residual(H0 @ (th - base), -pr.gradient(t, th)) <= 1e-10  # Eq. 10
    alphas = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    target = pr.target(alphas)
    rhs = -sum(alphas[t] * pr.gradient(t, target) for t in range(pr.num_tasks))
    assert stationarity_residual(H0 @ (target - base), rhs) <= 1e-10
    Hbar = pr.merged_precision(alphas)
    step = sum(
        alphas[t] * (H0 + pr.hessian(t)) @ (pr.finetuned(t) - base) for t in range(pr.num_tasks)
    )
    merged = base + torch.linalg.solve(Hbar, step)  # Eq. 6
    assert rel_err(merged, target) <= 1e-10
    assert rel_err(pr.target(0.0), base) <= 1e-12


def test_removal_problem_stationarity_and_exact_removal() -> None:
    """Eq. 10 holds; Eq. 13, the influence rule and (for α_t = 1) Cook's Eq. 14 give θ_\\t."""
    for alpha in (1.0, 0.4):
        pr = linear.make_linear_removal_problem(
            5, d=6, n_keep=40, n_remove=7, delta=0.5, alpha=alpha, condition=1e3
        )
        base, th, refit = pr.theta_llm, pr.finetuned, pr.refit
        lhs = pr.delta * base
        rhs = -pr.remaining_gradient(base) - alpha * pr.task_gradient(base)
        assert stationarity_residual(lhs, rhs) <= 1e-10
        lhs2 = pr.prior_precision @ (th - base)
        assert stationarity_residual(lhs2, -pr.task_gradient(th)) <= 1e-10
        assert stationarity_residual(pr.delta * refit, -pr.remaining_gradient(refit)) <= 1e-10
        Hr = pr.remaining_hessian()
        eq13 = base - alpha * torch.linalg.solve(
            Hr, (pr.prior_precision + pr.task_hessian()) @ (th - base)
        )
        assert rel_err(eq13, refit) <= 1e-10
        influence = base + alpha * torch.linalg.solve(Hr, pr.task_gradient_at_llm())
        assert rel_err(influence, refit) <= 1e-10
        if alpha == 1.0:
            cook = base + torch.linalg.solve(Hr, pr.X_t.T @ (pr.X_t @ base - pr.y_t))  # Eq. 14
            assert rel_err(cook, refit) <= 1e-10


def test_generators_are_seeded_and_conditioned() -> None:
    kw = dict(d=10, tasks=2, n_per_task=12, n_pretrain=4000, condition=1e4, prior_condition=1e3)
    a = linear.make_linear_merge_problem(11, **kw)
    b = linear.make_linear_merge_problem(11, **kw)
    c = linear.make_linear_merge_problem(12, **kw)
    assert torch.equal(a.X_pt, b.X_pt) and torch.equal(a.y_tasks[1], b.y_tasks[1])
    assert torch.equal(a.prior_precision, b.prior_precision)
    assert not torch.equal(a.X_pt, c.X_pt)
    ev = torch.linalg.eigvalsh(a.prior_precision)
    assert abs(float(ev[-1] / ev[0]) / 1e3 - 1.0) <= 1e-8
    assert torch.allclose(a.prior_precision, a.prior_precision.T, rtol=0, atol=0)
    # sample covariance condition ≈ population condition (n/d = 400: within a factor 1.5)
    ev_x = torch.linalg.eigvalsh(a.X_pt.T @ a.X_pt / 4000)
    assert 1e4 / 1.5 <= float(ev_x[-1] / ev_x[0]) <= 1e4 * 1.5
    r = linear.make_linear_removal_problem(1, d=4, n_keep=20, n_remove=3, delta=0.1, alpha=2.0)
    assert (r.delta, r.alpha) == (0.1, 2.0) and r.X_t.shape == (3, 4)
