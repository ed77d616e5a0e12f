"""Numeric checks on exact linear regression (quadratic losses), where the appendix claims
exactness.

Every case is drawn from a seed: dimensions d ∈ [1, 8], T ∈ [1, 4] tasks, 1–12 examples per task
(fewer than d makes H_t singular; H_0 keeps the systems definite), feature covariance condition
numbers up to 1e6, H_0 a random SPD matrix (condition up to 1e3, scale 1e-2–1e2), δ in 1e-2–10,
α_t in 0.1–2. The merge and removal results come from the public gradmerge functions.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

import gradmerge as gm
from gradmerge.theory import linear
from gradmerge.theory.numeric._common import (
    DTYPE,
    NumericCheck,
    alpha_not_one,
    rel,
    rng,
    vector_layout,
)
from gradmerge.theory.numeric.cases import LinearMergeSpec, LinearRemovalSpec


def _merge_inputs(problem: linear.LinearMergeProblem) -> dict:
    lay = vector_layout(problem.num_params)
    return {
        "base": lay.params(problem.theta_llm),
        "finetuned": [lay.params(problem.finetuned(t)) for t in range(problem.num_tasks)],
        "curvatures": [lay.dense(problem.hessian(t)) for t in range(problem.num_tasks)],
        "prior": lay.dense(problem.prior_precision),
    }


def _removal_inputs(problem: linear.LinearRemovalProblem) -> dict:
    lay = vector_layout(problem.num_params)
    return {
        "base": lay.params(problem.theta_llm),
        "finetuned": lay.params(problem.finetuned),
        "curvature": lay.dense(problem.task_hessian()),
        "remaining": lay.dense(problem.remaining_hessian()),
        "prior": lay.dense(problem.prior_precision),
    }


# ----- Sec. 1.2: the merge rule is exact for quadratic losses ---------------------------------
def eq6_exact(spec: LinearMergeSpec) -> float:
    """gm.gradient_matching (Eq. 6) against the exact multi-task MAP θ_{1:T}."""
    problem, alphas = spec.build(), list(spec.alphas)
    merged = gm.gradient_matching(**_merge_inputs(problem), alphas=alphas)
    return rel(merged["theta"], problem.target(alphas))


def eq2_linear(spec: LinearMergeSpec) -> float:
    """Eq. 2 at the exact target: θ_{1:T} = θ_TA − Σ α_t H_0⁻¹ Δ_t, via gm diagnostics."""
    problem, alphas = spec.build(), list(spec.alphas)
    lay = vector_layout(problem.num_params)
    inputs = _merge_inputs(problem)
    target = problem.target(alphas)
    grads = lay.grad_fns(problem.gradient, problem.num_tasks)
    mismatch = gm.gradient_mismatch(
        lay.params(target), inputs["finetuned"], grads, alphas=alphas, prior=inputs["prior"]
    )
    ta = gm.task_arithmetic(inputs["base"], inputs["finetuned"], alphas=alphas)
    assert mismatch.correction is not None
    return rel(ta["theta"] - mismatch.correction["theta"], target)


# ----- Sec. 1.3–1.4: removal, Cook, Koh & Liang ----------------------------------------------
def eq13_exact(spec: LinearRemovalSpec) -> float:
    """gm.remove (Eq. 13) against the exact refit θ_\\t, for any α_t and H_0."""
    problem = spec.build()
    removed = gm.remove(**_removal_inputs(problem), alpha=problem.alpha)
    return rel(removed["theta"], problem.refit)


def _cook(problem: linear.LinearRemovalProblem) -> Tensor:
    """Eq. 14: θ_LLM + H̄_\\t⁻¹ X_tᵀ(X_t θ_LLM − y_t)."""
    residual = problem.X_t @ problem.theta_llm - problem.y_t
    return problem.theta_llm + torch.linalg.solve(
        problem.remaining_hessian(), problem.X_t.T @ residual
    )


def eq14_cook(spec: LinearRemovalSpec) -> float:
    """Cook's formula (Eq. 14) against the exact refit (α_t = 1, as in Sec. 1.4)."""
    problem = replace(spec, alpha=1.0).build()
    return rel(_cook(problem), problem.refit)


def eq16_reduces_to_cook(spec: LinearRemovalSpec) -> float:
    """gm.remove with α_t = 1 (Eq. 13) against Cook's formula (Eq. 14), as Eq. 16 derives."""
    problem = replace(spec, alpha=1.0).build()
    return rel(gm.remove(**_removal_inputs(problem), alpha=1.0)["theta"], _cook(problem))


def koh_liang_exact(spec: LinearRemovalSpec) -> float:
    """gm.influence_remove, θ_LLM + α_t H̄_\\t⁻¹ g_t, against the exact refit, any α_t."""
    problem = spec.build()
    lay = vector_layout(problem.num_params)
    removed = gm.influence_remove(
        lay.params(problem.theta_llm),
        lay.params(problem.task_gradient_at_llm()),
        remaining=lay.dense(problem.remaining_hessian()),
        alpha=problem.alpha,
    )
    return rel(removed["theta"], problem.refit)


def koh_liang_printed(spec: LinearRemovalSpec) -> float:
    """As printed (line 48, no α_t): θ_LLM + H̄_\\t⁻¹ g_t, with α_t ≠ 1, against the refit."""
    problem = replace(spec, alpha=alpha_not_one(rng(spec.seed + 1))).build()
    step = torch.linalg.solve(problem.remaining_hessian(), problem.task_gradient_at_llm())
    return rel(problem.theta_llm + step, problem.refit)


def line37_printed(spec: LinearRemovalSpec) -> float:
    """As printed: θ_\\t = H̄_\\t⁻¹ Xᵀy with the FULL data, against the refit."""
    problem = replace(spec, alpha=1.0).build()
    X = torch.cat([problem.X_keep, problem.X_t])
    y = torch.cat([problem.y_keep, problem.y_t])
    return rel(torch.linalg.solve(problem.remaining_hessian(), X.T @ y), problem.refit)


def line37_corrected(spec: LinearRemovalSpec) -> float:
    """Corrected: θ_\\t = H̄_\\t⁻¹ X_\\tᵀ y_\\t, against the refit."""
    problem = replace(spec, alpha=1.0).build()
    rhs = problem.X_keep.T @ problem.y_keep
    return rel(torch.linalg.solve(problem.remaining_hessian(), rhs), problem.refit)


def _line38(spec: LinearRemovalSpec, *, printed: bool) -> float:
    problem = replace(spec, alpha=1.0).build()
    delta = problem.delta if not printed else alpha_not_one(rng(spec.seed + 2))
    X = torch.cat([problem.X_keep, problem.X_t])
    y = torch.cat([problem.y_keep, problem.y_t])
    reg = 0.5 if printed else 0.5 * delta  # printed: ½‖θ‖²; corrected: (δ/2)‖θ‖²

    def objective(theta: Tensor) -> Tensor:
        return 0.5 * torch.sum((y - X @ theta) ** 2) + reg * torch.sum(theta**2)

    hess = torch.autograd.functional.hessian(objective, problem.theta_llm.clone())
    claimed = X.T @ X + delta * torch.eye(X.shape[1], dtype=DTYPE)
    return rel(hess, claimed)


def line38_printed(spec: LinearRemovalSpec) -> float:
    """As printed: ∇²[½‖y − Xθ‖² + ½‖θ‖²] = XᵀX + δI (δ ≠ 1), Hessian by autograd."""
    return _line38(spec, printed=True)


def line38_corrected(spec: LinearRemovalSpec) -> float:
    """Corrected: ∇²[½‖y − Xθ‖² + (δ/2)‖θ‖²] = XᵀX + δI, Hessian by autograd."""
    return _line38(spec, printed=False)


# ----- Sec. 1.5: line 83–84, Eq. 21 -----------------------------------------------------------
def _autograd_hessian_of_task(problem: linear.LinearMergeProblem, t: int) -> Tensor:
    return torch.autograd.functional.hessian(
        lambda th: problem.loss(t, th), problem.finetuned(t).clone()
    )


def line83_hessian_printed(spec: LinearMergeSpec) -> float:
    """As printed: H_t = X_t X_tᵀ (n_t = d so that it is conformable), against autograd."""
    d = max(2, spec.d)  # for d = n_t = 1 both products are the same scalar
    problem = replace(spec, d=d, n_per_task=d, tasks=1, alphas=(1.0,)).build()
    X = problem.X_tasks[0]
    return rel(X @ X.T, _autograd_hessian_of_task(problem, 0))


def line83_hessian_corrected(spec: LinearMergeSpec) -> float:
    """Corrected: H_t = X_tᵀ X_t, against the autograd Hessian of ½‖y_t − X_tθ‖²."""
    problem = spec.build()
    X = problem.X_tasks[0]
    return rel(X.T @ X, _autograd_hessian_of_task(problem, 0))


def _log_ratio_grad(problem: linear.LinearMergeProblem, t: int, theta: Tensor) -> Tensor:
    """∇ log[p(θ|D_t)/p(θ)] with p(θ|D_t) = N(θ_t, (H_0+H_t)⁻¹), p(θ) = N(θ_LLM, H_0⁻¹)."""
    h0 = problem.prior_precision
    post = torch.distributions.MultivariateNormal(
        problem.finetuned(t), precision_matrix=h0 + problem.hessian(t)
    )
    prior = torch.distributions.MultivariateNormal(problem.theta_llm, precision_matrix=h0)
    x = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(post.log_prob(x) - prior.log_prob(x), x)
    return grad


def line83_printed(spec: LinearMergeSpec) -> float:
    """As printed: H_t(θ_{1:T} − θ_t) = ∇ log[p(θ|D_t)/p(θ)] at θ_{1:T}."""
    problem, alphas = spec.build(), list(spec.alphas)
    target = problem.target(alphas)
    mismatch = problem.hessian(0) @ (target - problem.finetuned(0))
    return rel(_log_ratio_grad(problem, 0, target), mismatch)


def line83_corrected(spec: LinearMergeSpec) -> float:
    """Corrected: ∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t) = ∇log r_t(θ_t) − ∇log r_t(θ_{1:T}), r_t =
    p(θ|D_t)/p(θ)."""
    problem, alphas = spec.build(), list(spec.alphas)
    target = problem.target(alphas)
    mismatch = problem.gradient(0, target) - problem.gradient(0, problem.finetuned(0))
    theta_t = problem.finetuned(0)
    claimed = _log_ratio_grad(problem, 0, theta_t) - _log_ratio_grad(problem, 0, target)
    return rel(claimed, mismatch)


def eq21_exact(spec: LinearMergeSpec) -> float:
    """Eq. 21 for linear models: ∇ℓ̄_t(θ) = ∇ℓ̄_t(θ_t) + H_t(θ − θ_t) at a random θ."""
    problem = spec.build()
    theta = torch.as_tensor(rng(spec.seed + 3).standard_normal(problem.num_params), dtype=DTYPE)
    theta_t = problem.finetuned(0)
    taylor = problem.gradient(0, theta_t) + problem.hessian(0) @ (theta - theta_t)
    return rel(taylor, problem.gradient(0, theta))


def _log_posterior_grads(spec: LinearMergeSpec, *, printed: bool) -> float:
    """∇log p_α against ∇log q_α (Eq. 19) at a random θ, with q_α as printed or corrected."""
    problem, alphas = spec.build(), list(spec.alphas)
    theta = torch.as_tensor(rng(spec.seed + 4).standard_normal(problem.num_params), dtype=DTYPE)
    h0, theta_llm = problem.prior_precision, problem.theta_llm

    def log_p(th: Tensor) -> Tensor:
        quad = -0.5 * (th - theta_llm) @ h0 @ (th - theta_llm)
        return quad - sum(a * problem.loss(t, th) for t, a in enumerate(alphas))

    def log_q(th: Tensor) -> Tensor:
        out = -0.5 * (th - theta_llm) @ h0 @ (th - theta_llm)
        for t, a in enumerate(alphas):
            theta_t = problem.finetuned(t)
            out = out - a * 0.5 * (th - theta_t) @ problem.hessian(t) @ (th - theta_t)
            if not printed:  # the first-order term at θ_t, which is not a minimum of ℓ̄_t
                out = out - a * problem.gradient(t, theta_t) @ (th - theta_t)
        return out

    gp = torch.autograd.functional.jacobian(log_p, theta)
    gq = torch.autograd.functional.jacobian(log_q, theta)
    return rel(gq, gp)


def line84_printed(spec: LinearMergeSpec) -> float:
    """As printed (line 84 with Eq. 19's q_α): p_α = q_α for linear models (∇log compared)."""
    return _log_posterior_grads(spec, printed=True)


def line84_corrected(spec: LinearMergeSpec) -> float:
    """Corrected q_α (first-order term kept): p_α = q_α for linear models (∇log compared)."""
    return _log_posterior_grads(spec, printed=False)


# ----- Sec. 1.6: MAP of Bayes' posterior ------------------------------------------------------
def _line114(spec: LinearMergeSpec) -> tuple[Tensor, Tensor, float]:
    """Gradient and Hessian of line 114's objective at θ_{1:T}, and the gradient's scale."""
    problem, alphas = spec.build(), list(spec.alphas)
    target, h0, theta_llm = problem.target(alphas), problem.prior_precision, problem.theta_llm

    def objective(th: Tensor) -> Tensor:
        out = (1 - sum(alphas)) * (-0.5 * (th - theta_llm) @ h0 @ (th - theta_llm))
        for t, a in enumerate(alphas):
            diff = th - problem.finetuned(t)
            out = out + a * (-0.5 * diff @ (h0 + problem.hessian(t)) @ diff)
        return out

    grad = torch.autograd.functional.jacobian(objective, target)
    hess = torch.autograd.functional.hessian(objective, target)
    scale = float(torch.linalg.norm(h0 @ (target - theta_llm))) + sum(
        a * float(torch.linalg.norm((h0 + problem.hessian(t)) @ (target - problem.finetuned(t))))
        for t, a in enumerate(alphas)
    )
    return grad, hess, scale


def line114_stationary(spec: LinearMergeSpec) -> float:
    """θ_{1:T} is a stationary point of line 114's objective (relative gradient norm)."""
    grad, _, scale = _line114(spec)
    return float(torch.linalg.norm(grad)) / max(scale, 1e-300)


def line114_printed_argmin(spec: LinearMergeSpec) -> float:
    """As printed, θ_{1:T} = arg MIN: error = how negative the Hessian is, relative (0 at a min)."""
    _, hess, _ = _line114(spec)
    eig = torch.linalg.eigvalsh(hess)
    return max(0.0, -float(eig[0])) / float(eig.abs().max())


def line114_corrected_argmax(spec: LinearMergeSpec) -> float:
    """Corrected, θ_{1:T} = arg MAX: stationary and the Hessian (= −H̄) negative definite."""
    grad, hess, scale = _line114(spec)
    eig = torch.linalg.eigvalsh(hess)
    curvature_error = max(0.0, float(eig[-1])) / float(eig.abs().max())
    return max(curvature_error, float(torch.linalg.norm(grad)) / max(scale, 1e-300))


def line117_identity(spec: LinearMergeSpec) -> float:
    """log of p(θ)Π[p(θ|D_t)/p(θ)]^{α_t} = log of p(θ)^{1−Σα_t} Π p(θ|D_t)^{α_t}, random θ."""
    problem, alphas = spec.build(), list(spec.alphas)
    h0 = problem.prior_precision
    theta = torch.as_tensor(rng(spec.seed + 5).standard_normal(problem.num_params), dtype=DTYPE)
    prior = torch.distributions.MultivariateNormal(problem.theta_llm, precision_matrix=h0)
    posts = [
        torch.distributions.MultivariateNormal(
            problem.finetuned(t), precision_matrix=h0 + problem.hessian(t)
        ).log_prob(theta)
        for t in range(problem.num_tasks)
    ]
    lp = prior.log_prob(theta)
    left = lp + sum(a * (q - lp) for a, q in zip(alphas, posts, strict=True))
    right = (1 - sum(alphas)) * lp + sum(a * q for a, q in zip(alphas, posts, strict=True))
    return abs(float(left - right)) / max(abs(float(left)), 1e-300)


CHECKS: list[NumericCheck] = [
    NumericCheck(
        "eq2", "Eq. 2 (line 8)", "θ_{1:T} = θ_TA − Σα_t H_0⁻¹[mismatch]", True, eq2_linear
    ),
    NumericCheck(
        "eq6-exact-quadratic",
        "Eq. 6 (line 16)",
        "merge rule equals θ_{1:T} for quadratic losses",
        True,
        eq6_exact,
    ),
    NumericCheck(
        "eq13-exact-quadratic",
        "Eq. 13 (line 30)",
        "removal rule equals the refit θ_\\t (linear)",
        True,
        eq13_exact,
    ),
    NumericCheck(
        "eq14", "Eq. 14 (line 39)", "Cook's formula equals the refit θ_\\t", True, eq14_cook
    ),
    NumericCheck(
        "eq16-eq13-alpha1-is-eq14",
        "Eq. 16 (line 45)",
        "Eq. 13 with α_t=1 equals Cook's formula",
        True,
        eq16_reduces_to_cook,
    ),
    NumericCheck(
        "koh-liang-exact-linear-alpha-corrected",
        "line 48",
        "θ_LLM + α_t H̄_\\t⁻¹ g_t equals the refit",
        True,
        koh_liang_exact,
    ),
    NumericCheck(
        "koh-liang-exact-linear-alpha-printed",
        "line 48",
        "θ_LLM + H̄_\\t⁻¹ g_t (no α_t) equals the refit",
        False,
        koh_liang_printed,
    ),
    NumericCheck(
        "line37-removed-printed",
        "line 37",
        "θ_\\t = H̄_\\t⁻¹ Xᵀy (full data)",
        False,
        line37_printed,
    ),
    NumericCheck(
        "line37-removed-corrected",
        "line 37",
        "θ_\\t = H̄_\\t⁻¹ X_\\tᵀ y_\\t",
        True,
        line37_corrected,
    ),
    NumericCheck(
        "line38-hessian-printed",
        "line 38",
        "∇²[½‖y−Xθ‖² + ½‖θ‖²] = XᵀX + δI",
        False,
        line38_printed,
    ),
    NumericCheck(
        "line38-hessian-corrected",
        "line 38",
        "∇²[½‖y−Xθ‖² + (δ/2)‖θ‖²] = XᵀX + δI",
        True,
        line38_corrected,
    ),
    NumericCheck(
        "line83-hessian-printed", "line 83", "H_t = X_t X_tᵀ", False, line83_hessian_printed
    ),
    NumericCheck(
        "line83-hessian-corrected", "line 83", "H_t = X_tᵀ X_t", True, line83_hessian_corrected
    ),
    NumericCheck(
        "line83-ratio-printed",
        "line 83",
        "H_t(θ_{1:T}−θ_t) = ∇log[p(θ|D_t)/p(θ)] at θ_{1:T}",
        False,
        line83_printed,
    ),
    NumericCheck(
        "line83-ratio-corrected",
        "line 83",
        "mismatch = ∇log r_t(θ_t) − ∇log r_t(θ_{1:T})",
        True,
        line83_corrected,
    ),
    NumericCheck(
        "eq21-exact-linear",
        "Eq. 21 (line 84)",
        "Taylor expansion of ∇ℓ̄_t is exact for linear models",
        True,
        eq21_exact,
    ),
    NumericCheck(
        "line84-p-eq-q-printed",
        "line 84 / Eq. 19",
        "p_α = q_α (q_α as printed) for linear models",
        False,
        line84_printed,
    ),
    NumericCheck(
        "line84-p-eq-q-corrected",
        "line 84 / Eq. 19",
        "p_α = q_α with the first-order term kept",
        True,
        line84_corrected,
    ),
    NumericCheck(
        "line114-stationarity",
        "lines 113–114",
        "θ_{1:T} is stationary for line 114's objective",
        True,
        line114_stationary,
    ),
    NumericCheck(
        "line114-argmin-printed",
        "line 114",
        "θ_{1:T} = arg min of line 114's objective",
        False,
        line114_printed_argmin,
    ),
    NumericCheck(
        "line114-argmax-corrected",
        "line 114",
        "θ_{1:T} = arg max of line 114's objective",
        True,
        line114_corrected_argmax,
    ),
    NumericCheck(
        "line117-product",
        "line 117",
        "p(θ)Π[p(θ|D_t)/p(θ)]^α = p(θ)^{1−Σα}Π p(θ|D_t)^α",
        True,
        line117_identity,
    ),
]
