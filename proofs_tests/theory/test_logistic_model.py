"""Tests of :mod:`gradmerge.theory.logistic` against independent references.

References: a loss written with ``torch.nn.functional`` (binary_cross_entropy_with_logits /
cross_entropy) on parameters sliced by hand, differentiated by torch.func (grad, hessian, jacrev);
statsmodels Logit / GLM(Binomial, freq_weights) / MNLogit for unregularised fits; and the paper's
stationarity conditions (Sec. 1.1, Eq. 10).
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import statsmodels.api as sm
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from gradmerge.theory import logistic
from gradmerge.theory.logistic import LogisticModel, newton_fit
from gradmerge.theory.problems import random_spd

F64 = torch.float64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (Frobenius)."""
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def stationarity_residual(lhs: torch.Tensor, rhs: torch.Tensor) -> float:
    """‖lhs − rhs‖ / (‖lhs‖ + ‖rhs‖)."""
    return float(torch.linalg.norm(lhs - rhs) / (torch.linalg.norm(lhs) + torch.linalg.norm(rhs)))


def reference_losses(
    theta: torch.Tensor, X: torch.Tensor, y: torch.Tensor, k: int, intercept: bool
) -> torch.Tensor:
    """Per-example losses from torch.nn.functional; the layout is sliced by hand (weight (k', d)
    row-major, then bias (k',))."""
    d = X.shape[1]
    kk = 1 if k == 2 else k
    W = theta[: kk * d].reshape(kk, d)
    z = X @ W.T
    if intercept:
        z = z + theta[kk * d :]
    if k == 2:
        return F.binary_cross_entropy_with_logits(z[:, 0], y.to(F64), reduction="none")
    return F.cross_entropy(z, y, reduction="none")


def random_case(seed: int, n: int, d: int, k: int, intercept: bool, weighted: bool, scale: float):
    g = torch.Generator().manual_seed(seed)
    model = LogisticModel(d, k, intercept)
    X = torch.randn(n, d, generator=g, dtype=F64)
    y = torch.randint(0, k, (n,), generator=g)
    theta = scale * torch.randn(model.num_params, generator=g, dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) * 2 + 0.05 if weighted else None
    return model, X, y, theta, w


cases = dict(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 12),
    d=st.integers(1, 5),
    k=st.integers(2, 4),
    intercept=st.booleans(),
    weighted=st.booleans(),
    scale=st.sampled_from([0.1, 1.0, 4.0]),
)


def rounding_floors(model, theta, X, w) -> tuple[float, float, float]:
    """Absolute rounding floors of the autograd reference for (loss, gradient, Hessian).

    F.cross_entropy and its derivatives form logsumexp(z) − z_y and 1 − p_y by subtraction, so
    for confident predictions they carry an absolute error of a few ε per example — ε·‖z_i‖∞,
    ε·‖x̃_i‖, ε·‖x̃_i‖² — that is large relative to the tiny true values (our closed forms avoid
    the subtraction; :func:`test_confident_predictions_against_mpmath` checks them at 400 digits).
    The tolerances are 1e-12 relative plus 100× these floors.
    """
    n = X.shape[0]
    ww = torch.ones(n, dtype=F64) if w is None else w
    xt = torch.cat([X, torch.ones(n, 1, dtype=F64)], 1) if model.fit_intercept else X
    xn = torch.linalg.norm(xt, dim=1)
    zmax = model.logits(theta, X).abs().amax(dim=1) + 1.0
    eps = torch.finfo(F64).eps
    return tuple(100 * eps * float(torch.sum(ww * v)) for v in (zmax, xn, xn**2))


@given(**cases)
def test_derivatives_match_autograd(seed, n, d, k, intercept, weighted, scale) -> None:
    model, X, y, theta, w = random_case(seed, n, d, k, intercept, weighted, scale)
    ww = torch.ones(n, dtype=F64) if w is None else w
    f_loss, f_grad, f_hess = rounding_floors(model, theta, X, w)

    def total(th: torch.Tensor) -> torch.Tensor:
        return torch.dot(ww, reference_losses(th, X, y, k, intercept))

    def weighted_losses(th: torch.Tensor) -> torch.Tensor:
        return ww * reference_losses(th, X, y, k, intercept)

    def close(ours: torch.Tensor, ref: torch.Tensor, floor: float) -> bool:
        return float(torch.linalg.norm(ours - ref)) <= 1e-12 * float(torch.linalg.norm(ref)) + floor

    assert close(model.loss(theta, X, y, w), total(theta), f_loss)
    assert close(model.gradient(theta, X, y, w), torch.func.grad(total)(theta), f_grad)
    assert close(model.hessian(theta, X, y, w), torch.func.hessian(total)(theta), f_hess)
    per_ex = torch.func.jacrev(weighted_losses)(theta)
    assert per_ex.shape == (n, model.num_params)
    assert close(model.per_example_gradients(theta, X, y, w), per_ex, f_grad)
    if scale <= 1.0:  # moderate logits: the plain 1e-12 relative agreement
        assert rel_err(model.gradient(theta, X, y, w), torch.func.grad(total)(theta)) <= 1e-12
        assert rel_err(model.hessian(theta, X, y, w), torch.func.hessian(total)(theta)) <= 1e-12


@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.integers(1, 3),
    k=st.integers(2, 4),
    scale=st.sampled_from([1.0, 8.0, 30.0]),
)
@mpmath.workdps(400)  # logits up to ~±300: 1 − p must survive at full precision
def test_confident_predictions_against_mpmath(seed: int, d: int, k: int, scale: float) -> None:
    """One example, possibly very confident: loss, gradient and Hessian entries agree with a
    400-digit mpmath evaluation of the textbook formulas to 1e-12 *elementwise* relative error
    (ℓ = log Σ_k e^{z̃_k} − z̃_y, ∇ = (p − e_y) ⊗ x̃, ∇² = (diag p − ppᵀ) ⊗ x̃x̃ᵀ)."""
    model, X, y, theta, _ = random_case(seed, 1, d, k, True, False, scale)
    kk, x = model.num_outputs, [mpmath.mpf(float(v)) for v in X[0]] + [mpmath.mpf(1)]
    W, b = theta[: kk * d].reshape(kk, d), theta[kk * d :]
    z = [sum(mpmath.mpf(float(W[c, j])) * x[j] for j in range(d)) + float(b[c]) for c in range(kk)]
    zt = [mpmath.mpf(0), *z] if k == 2 else z
    label = int(y[0])
    lse = mpmath.log(sum(mpmath.exp(v) for v in zt))
    probs = [mpmath.exp(v - lse) for v in zt]
    p = probs[1:] if k == 2 else probs  # the K' modelled probabilities
    e = [mpmath.mpf(int(label == (c + 1 if k == 2 else c))) for c in range(kk)]

    def flat(c: int, j: int) -> int:  # layout: weight (K', d) row-major, then bias (K',)
        return c * d + j if j < d else kk * d + c

    P = model.num_params
    g_ref, h_ref = [mpmath.mpf(0)] * P, [[mpmath.mpf(0)] * P for _ in range(P)]
    for c in range(kk):
        for j in range(d + 1):
            g_ref[flat(c, j)] = (p[c] - e[c]) * x[j]
            for c2 in range(kk):
                a = (p[c] if c == c2 else 0) - p[c] * p[c2]
                for j2 in range(d + 1):
                    h_ref[flat(c, j)][flat(c2, j2)] = a * x[j] * x[j2]

    def check(ours: torch.Tensor, ref) -> None:
        for o, r in zip(ours.reshape(-1).tolist(), ref, strict=True):
            assert abs(o - float(r)) <= 1e-12 * abs(float(r)) + 1e-300

    check(model.per_example_losses(theta, X, y), [lse - zt[label]])
    check(model.gradient(theta, X, y), g_ref)
    check(model.hessian(theta, X), [v for row in h_ref for v in row])
    check(model.fisher(theta, X), [v for row in h_ref for v in row])


@given(**cases)
def test_fisher_equals_hessian(seed, n, d, k, intercept, weighted, scale) -> None:
    """Canonical link: E_y[∇ℓ∇ℓᵀ] (computed over labels) equals ∇²ℓ̄ — our closed-form Hessian to
    1e-12 relative, autograd's Hessian to 1e-12 relative plus its rounding floor."""
    model, X, y, theta, w = random_case(seed, n, d, k, intercept, weighted, scale)
    ww = torch.ones(n, dtype=F64) if w is None else w

    def total(th: torch.Tensor) -> torch.Tensor:
        return torch.dot(ww, reference_losses(th, X, y, k, intercept))

    fisher = model.fisher(theta, X, w)
    assert rel_err(fisher, model.hessian(theta, X, y, w)) <= 1e-12
    hess_ref = torch.func.hessian(total)(theta)
    floor = rounding_floors(model, theta, X, w)[2]
    err = float(torch.linalg.norm(fisher - hess_ref))
    assert err <= 1e-12 * float(torch.linalg.norm(hess_ref)) + floor


def test_layout_probabilities_and_extreme_logits() -> None:
    model = LogisticModel(3, 4)
    assert model.layout == {"weight": (4, 3), "bias": (4,)} and model.num_params == 16
    theta = torch.arange(16, dtype=F64)
    params = model.unflatten(theta)
    assert params["weight"][1, 2] == 5 and params["bias"][0] == 12
    assert torch.equal(model.flatten(params), theta)
    assert LogisticModel(3, 2, fit_intercept=False).layout == {"weight": (1, 3)}
    X = torch.randn(5, 3, dtype=F64)
    probs = model.predict_proba(theta / 10, X)
    z = X @ params["weight"].T / 10 + params["bias"] / 10
    assert rel_err(probs, torch.softmax(z, dim=1)) <= 1e-14
    binary = LogisticModel(1, 2, fit_intercept=False)
    xb = torch.tensor([[1.0], [1.0], [1.0]], dtype=F64)
    # z = ±800 (and 30, where softplus' linear cutoff at 20 would lose 1e-13): exact losses
    for z0 in (800.0, -800.0, 30.0):
        losses = binary.per_example_losses(
            torch.tensor([z0], dtype=F64), xb, torch.tensor([0, 1, 1])
        )
        with mpmath.workdps(400):
            zm = mpmath.mpf(z0)
            exact_y0, exact_y1 = mpmath.log1p(mpmath.exp(zm)), mpmath.log1p(mpmath.exp(-zm))
        exact = torch.tensor([float(exact_y0), float(exact_y1), float(exact_y1)], dtype=F64)
        assert torch.allclose(losses, exact, rtol=1e-15, atol=1e-300)
        pb = binary.predict_proba(torch.tensor([z0], dtype=F64), xb)
        assert torch.all(torch.isfinite(pb)) and torch.allclose(pb.sum(1), torch.ones(3, dtype=F64))


def binary_data(seed: int, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=F64)
    w_true = torch.randn(d, generator=g, dtype=F64)
    p = torch.sigmoid(X @ w_true + 0.3)
    y = (torch.rand(n, generator=g, dtype=F64) < p).to(torch.long)
    return X, y


def test_newton_binary_mle_matches_statsmodels_logit() -> None:
    X, y = binary_data(0, 300, 4)
    model = LogisticModel(4, 2)
    theta, info = newton_fit(model, X, y, prior_precision=0.0)
    exog = np.column_stack([X.numpy(), np.ones(300)])  # bias last, as in the flat layout
    ref = sm.Logit(y.numpy(), exog).fit(method="newton", tol=1e-14, maxiter=100, disp=0).params
    assert rel_err(theta, torch.from_numpy(np.asarray(ref))) <= 1e-8
    assert info.gradient_norm <= 1e-10 * info.gradient_scale


def test_newton_binary_weighted_matches_glm_freq_weights_and_replication() -> None:
    """Integer weights: statsmodels GLM(Binomial, freq_weights) and the fit on replicated rows."""
    X, y = binary_data(1, 120, 3)
    g = torch.Generator().manual_seed(5)
    w = torch.randint(1, 4, (120,), generator=g).to(F64)
    model = LogisticModel(3, 2)
    theta, _ = newton_fit(model, X, y, prior_precision=0.0, weights=w)
    exog = np.column_stack([X.numpy(), np.ones(120)])
    glm = sm.GLM(y.numpy(), exog, family=sm.families.Binomial(), freq_weights=w.numpy())
    ref = glm.fit(method="newton", tol=1e-14, maxiter=100).params
    assert rel_err(theta, torch.from_numpy(np.asarray(ref))) <= 1e-8
    reps = w.to(torch.long)
    theta_rep, _ = newton_fit(
        model, X.repeat_interleave(reps, 0), y.repeat_interleave(reps), prior_precision=0.0
    )
    assert rel_err(theta, theta_rep) <= 1e-10


@pytest.mark.parametrize("k", [2, 3])
def test_newton_regularised_is_stationary(k: int) -> None:
    """∇f = 0 at the result, with ∇f from autograd of the reference loss (1e-10 relative to the
    sum of the magnitudes of the gradient's terms)."""
    g = torch.Generator().manual_seed(k)
    n, d = 80, 5
    model = LogisticModel(d, k)
    X = 3.0 * torch.randn(n, d, generator=g, dtype=F64)
    y = torch.randint(0, k, (n,), generator=g)
    w = torch.rand(n, generator=g, dtype=F64) + 0.5
    P = random_spd(model.num_params, condition=1e3, scale=1.0, generator=g)
    m = torch.randn(model.num_params, generator=g, dtype=F64)
    theta, info = newton_fit(model, X, y, prior_precision=P, prior_mean=m, weights=w)

    def objective(th: torch.Tensor) -> torch.Tensor:
        r = th - m
        return torch.dot(w, reference_losses(th, X, y, k, True)) + 0.5 * r @ P @ r

    grad = torch.func.grad(objective)(theta)
    scale = float(torch.sum(w * torch.linalg.norm(X, dim=1))) + float(
        torch.linalg.norm(P @ (theta - m))
    )
    assert float(torch.linalg.norm(grad)) <= 1e-10 * scale
    assert info.iterations < 30


def test_newton_multiclass_mle_matches_statsmodels_mnlogit() -> None:
    """The full softmax with P = 0 is not identifiable (adding one vector to every row of [W|b]
    changes nothing), so ``newton_fit`` refuses it unless ``allow_singular=True``, which keeps the
    iterates orthogonal to those directions (sum-to-zero rows from init 0). The identifiable
    quantities — probabilities and row differences W_k − W_0, b_k − b_0, which are exactly
    statsmodels MNLogit's parameters with reference class 0 — are then compared at 1e-8 relative:
    both fits are Newton to machine precision on the same strictly convex reduced problem."""
    g = torch.Generator().manual_seed(3)
    n, d, k = 400, 3, 3
    X = torch.randn(n, d, generator=g, dtype=F64)
    W = torch.randn(k, d, generator=g, dtype=F64)
    y = torch.multinomial(torch.softmax(X @ W.T, dim=1), 1, generator=g)[:, 0]
    model = LogisticModel(d, k)
    with pytest.raises(logistic.NotIdentifiableError):
        newton_fit(model, X, y, prior_precision=0.0)
    theta, _ = newton_fit(model, X, y, prior_precision=0.0, allow_singular=True)
    params = model.unflatten(theta)
    assert float(params["weight"].sum(0).abs().max()) <= 1e-12
    assert float(params["bias"].sum().abs()) <= 1e-12
    exog = np.column_stack([X.numpy(), np.ones(n)])
    res = sm.MNLogit(y.numpy(), exog).fit(method="newton", tol=1e-14, maxiter=100, disp=0)
    ref = torch.from_numpy(np.asarray(res.params))  # (d+1)×(K−1): classes 1..K−1 minus class 0
    ours = torch.cat([params["weight"], params["bias"][:, None]], dim=1)  # K×(d+1)
    diffs = (ours[1:] - ours[0]).T
    assert rel_err(diffs, ref) <= 1e-8
    probs_ref = torch.from_numpy(np.asarray(res.predict(exog)))
    assert rel_err(model.predict_proba(theta, X), probs_ref) <= 1e-8


def test_newton_reports_separable_data() -> None:
    X = torch.linspace(-2, 2, 20, dtype=F64)[:, None]
    y = (X[:, 0] > 0).to(torch.long)
    with pytest.raises(logistic.NewtonConvergenceError):
        newton_fit(LogisticModel(1, 2), X, y, prior_precision=0.0)
    theta, _ = newton_fit(LogisticModel(1, 2), X, y, prior_precision=1e-3)  # a prior fixes it
    assert torch.all(torch.isfinite(theta))


@pytest.mark.parametrize(("classes", "prior"), [(2, "isotropic"), (3, "fisher"), (2, "fisher")])
def test_merge_problem_stationarity(classes: int, prior: str) -> None:
    """Sec. 1.1: δθ_LLM = −∇ℓ̄_pt(θ_LLM); H_0(θ_t − θ_LLM) = −∇ℓ̄_t(θ_t);
    H_0(θ_{1:T} − θ_LLM) = −Σ α_t ∇ℓ̄_t(θ_{1:T})."""
    pr = logistic.make_logistic_merge_problem(
        7, d=4, tasks=3, classes=classes, n_per_task=30, shift=1.0, covariate_shift=0.5,
        delta=0.5, prior=prior, prior_scale=1.0, condition=1e2,
    )  # fmt: skip
    H0, base = pr.prior_precision, pr.theta_llm
    assert stationarity_residual(pr.delta * base, -pr.pretraining_gradient(base)) <= 1e-10
    for t in range(pr.num_tasks):
        th = pr.finetuned(t)
        assert stationarity_residual(H0 @ (th - base), -pr.gradient(t, th)) <= 1e-10
    alphas = [0.3, 1.0, 1.7]
    target = pr.target(alphas)
    rhs = -sum(a * pr.gradient(t, target) for t, a in enumerate(alphas))
    assert stationarity_residual(H0 @ (target - base), rhs) <= 1e-10
    if prior == "fisher":  # H_0 = δI + F_pt(θ_LLM), SPD
        assert rel_err(H0, pr.pretraining_hessian()) <= 1e-12
        assert float(torch.linalg.eigvalsh(H0)[0]) > 0
    else:
        assert torch.equal(H0, 0.5 * torch.eye(pr.num_params, dtype=F64))
    # exact Hessian of a task at an arbitrary θ, against autograd
    k, X, y = classes, pr.X_tasks[1], pr.y_tasks[1]
    hess_ref = torch.func.hessian(lambda th: reference_losses(th, X, y, k, True).sum())(target)
    assert rel_err(pr.hessian(1, target), hess_ref) <= 1e-12
    assert rel_err(pr.fisher(1), pr.hessian(1)) <= 1e-12


@pytest.mark.parametrize("classes", [2, 4])
def test_removal_problem_stationarity(classes: int) -> None:
    """Eq. 10, all three lines, and the tasks really differ (θ_\\t ≠ θ_LLM)."""
    pr = logistic.make_logistic_removal_problem(
        2, d=3, n_keep=150, n_remove=25, classes=classes, delta=0.7, alpha=1.5, shift=1.0,
        prior="fisher",
    )  # fmt: skip
    base, th, refit = pr.theta_llm, pr.finetuned, pr.refit
    rhs = -pr.remaining_gradient(base) - pr.alpha * pr.task_gradient(base)
    assert stationarity_residual(pr.delta * base, rhs) <= 1e-10
    lhs = pr.prior_precision @ (th - base)
    assert stationarity_residual(lhs, -pr.task_gradient(th)) <= 1e-10
    assert stationarity_residual(pr.delta * refit, -pr.remaining_gradient(refit)) <= 1e-10
    assert rel_err(refit, base) > 1e-3
    hess_ref = torch.func.hessian(
        lambda t: reference_losses(t, pr.X_keep, pr.y_keep, classes, True).sum()
    )(base)
    eye = torch.eye(pr.num_params, dtype=F64)
    assert rel_err(pr.remaining_hessian(), pr.delta * eye + hess_ref) <= 1e-12


def test_generators_are_seeded() -> None:
    kw = dict(d=3, tasks=2, n_per_task=20, classes=3)
    a = logistic.make_logistic_merge_problem(4, **kw)
    b = logistic.make_logistic_merge_problem(4, **kw)
    c = logistic.make_logistic_merge_problem(5, **kw)
    assert torch.equal(a.X_tasks[0], b.X_tasks[0]) and torch.equal(a.y_pt, b.y_pt)
    assert torch.equal(a.finetuned(1), b.finetuned(1))
    assert not torch.equal(a.X_pt, c.X_pt)
    # shift = 0 and no covariate shift: every task draws from the pretraining distribution
    same = logistic.make_logistic_merge_problem(4, d=3, tasks=2, n_per_task=4000, shift=0.0)
    far = logistic.make_logistic_merge_problem(4, d=3, tasks=2, n_per_task=4000, shift=2.0)
    gap_same = rel_err(same.target(), same.theta_llm)
    gap_far = rel_err(far.target(), far.theta_llm)
    assert gap_same < gap_far


def test_newton_tiny_prior_on_separable_tasks() -> None:
    """8 examples per task in 11 dimensions are separable; with H_0 = 1e-9·I the minimiser is
    finite but far away (logits in the hundreds on the way), and Newton still reaches it: the
    stationarity condition of the merge target holds, checked with autograd's gradient."""
    pr = logistic.make_logistic_merge_problem(
        1, d=10, tasks=4, classes=5, n_per_task=8, shift=2.0, prior_scale=1e-9, condition=1e3,
        signal=5.0,
    )  # fmt: skip
    target, base = pr.target(1.0), pr.theta_llm
    assert float(torch.linalg.norm(target - base)) > 100.0
    X, y = torch.cat(pr.X_tasks), torch.cat(pr.y_tasks)
    grad = torch.func.grad(lambda th: reference_losses(th, X, y, 5, True).sum())(target)
    assert stationarity_residual(pr.prior_precision @ (target - base), -grad) <= 1e-8
