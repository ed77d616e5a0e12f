"""gradmerge's removal rules against statsmodels' exact refits (an external oracle).

- Linear regression: leave-one-out through ``OLS(...).fit().get_influence()`` (``params_not_obsi``
  are exact refits without observation i, ``dfbeta`` = params − params_not_obsi). Eq. 13 and the
  influence rule are exact here (Sec. 1.4), for any fine-tuning prior H_0.
- Logistic regression: statsmodels has no exact leave-out attribute for GLMs (``params_one`` is a
  one-step approximation), so the oracle is a GLM refit without D_t. There the rules are
  approximations; what is exact is each rule's error in terms of Taylor remainders, which we
  verify against the oracle's refit. (Which rule lands closer is measured by
  ``gradmerge verify``'s removal study, not asserted: the appendix claims no inequality.)
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.theory import linear, logistic
from gradmerge.theory.numeric._common import Layout, residual

sm = pytest.importorskip("statsmodels.api")

DT = torch.float64


def _t(x):
    return torch.as_tensor(np.asarray(x), dtype=DT)


@given(
    seed=st.integers(0, 2**31 - 1),
    extra=st.integers(3, 25),
    d=st.integers(1, 5),
    h0_scale=st.floats(1e-2, 1e2),
)
def test_ols_leave_one_out_matches_statsmodels(seed, extra, d, h0_scale):
    r = np.random.default_rng(seed)
    n = d + extra  # leaving one out keeps n − 1 > d: every refit is well defined
    X = r.standard_normal((n, d)) * np.exp(r.uniform(-2, 2, d))
    y = X @ r.standard_normal(d) + r.standard_normal(n)
    fit = sm.OLS(y, X).fit()
    infl = fit.get_influence()
    base = _t(fit.params)
    lay = Layout({"w": (d,)})
    q, _ = np.linalg.qr(r.standard_normal((d, d)))
    h0 = _t((q * np.exp(r.uniform(-1, 1, d))) @ q.T * h0_scale)  # any SPD fine-tuning prior
    h0 = (h0 + h0.T) / 2
    for i in range(n):
        x_i, y_i = _t(X[i : i + 1]), _t(y[i : i + 1])
        keep = np.arange(n) != i
        theta_i = linear.fit(x_i, y_i, prior_precision=h0, prior_mean=base)  # Eq. 15
        remaining = lay.dense(_t(X[keep].T @ X[keep]))  # δ = 0: plain OLS
        removed = gm.remove(
            lay.params(base),
            lay.params(theta_i),
            lay.dense(x_i.T @ x_i),
            remaining=remaining,
            prior=lay.dense(h0),
        )
        influence = gm.influence_remove(
            lay.params(base), lay.params(x_i.T @ (x_i @ base - y_i)), remaining=remaining
        )
        oracle = _t(infl.params_not_obsi[i])
        scale = float(torch.linalg.norm(oracle)) + float(torch.linalg.norm(base))
        assert float(torch.linalg.norm(removed["w"] - oracle)) <= 1e-9 * scale
        assert float(torch.linalg.norm(influence["w"] - oracle)) <= 1e-9 * scale
        # Cook's dfbeta is the size of the step the rule takes
        assert float(torch.linalg.norm((base - removed["w"]) - _t(infl.dfbeta[i]))) <= 1e-9 * scale


def _glm(X, y, weights=None):
    exog = np.column_stack([X, np.ones(len(X))])  # [weight..., bias]: LogisticModel's layout
    res = sm.GLM(y, exog, family=sm.families.Binomial(), freq_weights=weights).fit(tol=1e-13)
    return _t(res.params)


def _removal_problem(seed, n_keep, n_remove, alpha, shift):
    """Binary logistic regression without a prior (δ = 0), so statsmodels fits it exactly."""
    r = np.random.default_rng(seed)
    d = 3
    w_true = r.standard_normal(d)
    X = r.standard_normal((n_keep + n_remove, d))
    w_rm = w_true + shift * r.standard_normal(d)
    logits = np.where(np.arange(n_keep + n_remove) < n_keep, X @ w_true, X @ w_rm)
    y = (r.uniform(size=len(X)) < 1 / (1 + np.exp(-logits))).astype(float)
    return X[:n_keep], y[:n_keep], X[n_keep:], y[n_keep:], alpha


@given(
    seed=st.integers(0, 2**31 - 1),
    n_remove=st.integers(1, 25),
    alpha=st.floats(0.3, 2.0),
    shift=st.floats(0.0, 2.0),
)
def test_logistic_removal_errors_against_glm_refits(seed, n_remove, alpha, shift):
    Xk, yk, Xt, yt, alpha = _removal_problem(seed, 150, n_remove, alpha, shift)
    model = logistic.LogisticModel(3, 2)
    lay = Layout(model.layout)
    # θ_LLM (Eq. 9, δ = 0) and the exact refit θ_\t (Eq. 8), both by statsmodels
    w_all = np.concatenate([np.ones(len(Xk)), np.full(len(Xt), alpha)])
    theta_llm = _glm(np.vstack([Xk, Xt]), np.concatenate([yk, yt]), w_all)
    refit = _glm(Xk, yk)
    Xk_, yk_, Xt_, yt_ = _t(Xk), _t(yk).long(), _t(Xt), _t(yt).long()
    h0 = model.fisher(theta_llm, Xk_) + alpha * model.fisher(theta_llm, Xt_)  # Laplace prior
    theta_t, _ = logistic.newton_fit(model, Xt_, yt_, prior_precision=h0, prior_mean=theta_llm)
    h_rest = model.hessian(theta_llm, Xk_)  # H̄_\t with δ = 0
    h_t = model.hessian(theta_t, Xt_)
    eq13 = lay.flat(
        gm.remove(
            lay.params(theta_llm),
            lay.params(theta_t),
            lay.dense(h_t),
            remaining=lay.dense(h_rest),
            prior=lay.dense(h0),
            alpha=alpha,
        )
    )
    kl = lay.flat(
        gm.influence_remove(
            lay.params(theta_llm),
            lay.params(model.gradient(theta_llm, Xt_, yt_)),
            remaining=lay.dense(h_rest),
            alpha=alpha,
        )
    )
    grad_rest = lambda th: model.gradient(th, Xk_, yk_)  # noqa: E731
    grad_t = lambda th: model.gradient(th, Xt_, yt_)  # noqa: E731
    rho1 = grad_rest(refit) - grad_rest(theta_llm) - h_rest @ (refit - theta_llm)
    rho2 = grad_t(theta_llm) - grad_t(theta_t) - h_t @ (theta_llm - theta_t)
    # exact error identities, verified against the oracle's refit
    pred13 = torch.linalg.solve(h_rest, rho1 - alpha * rho2)
    pred_kl = torch.linalg.solve(h_rest, rho1)
    assert residual(eq13 - refit, pred13, eq13, refit) <= 1e-9
    assert residual(kl - refit, pred_kl, kl, refit) <= 1e-9
