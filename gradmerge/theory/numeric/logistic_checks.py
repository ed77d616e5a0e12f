"""Numeric checks on exact logistic regression (binary and softmax), solved by Newton.

Here the merge and removal rules are only Taylor approximations, so the checks are of two kinds:
identities that hold for ANY loss (Eq. 1–2, Theorem 1, and exact expressions of each rule's error
in terms of Taylor remainders of the gradients), and errata of Sec. 1.5 that show on a non-linear
model. Cases: d ∈ [1, 5], K ∈ {2, 3, 4} classes, T ∈ [1, 3] tasks with 5–40 examples each, task
shift 0–1.5, δ in 0.1–10, H_0 isotropic or the base model's Laplace precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

import gradmerge as gm
from gradmerge.theory import logistic
from gradmerge.theory.numeric._common import (
    DTYPE,
    Layout,
    NumericCheck,
    alpha_not_one,
    rel,
    residual,
    rng,
)
from gradmerge.theory.numeric.cases import LogisticMergeSpec, LogisticRemovalSpec


def merge_inputs(
    problem: logistic.LogisticMergeProblem, curvatures: Sequence[Tensor] | None = None
) -> dict:
    """gm inputs: H_t defaults to the exact Hessian at θ_t (the expansion point of Eq. 3)."""
    lay = Layout(problem.model.layout)
    hs = (
        curvatures
        if curvatures is not None
        else [problem.hessian(t) for t in range(problem.num_tasks)]
    )
    return {
        "base": lay.params(problem.theta_llm),
        "finetuned": [lay.params(problem.finetuned(t)) for t in range(problem.num_tasks)],
        "curvatures": [lay.dense(h) for h in hs],
        "prior": lay.dense(problem.prior_precision),
    }


def _mismatches(problem: logistic.LogisticMergeProblem, theta: Tensor) -> list[Tensor]:
    """Δ_t = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)."""
    return [
        problem.gradient(t, theta) - problem.gradient(t, problem.finetuned(t))
        for t in range(problem.num_tasks)
    ]


# ----- Sec. 1.1: Eq. 1–2 hold for any loss ----------------------------------------------------
def eq1_any_loss(spec: LogisticMergeSpec) -> float:
    """Residual of Eq. 1 at the exact θ_t, θ_{1:T} (relative to the size of its terms)."""
    problem, alphas = spec.build(), list(spec.alphas)
    target, h0, theta_llm = problem.target(alphas), problem.prior_precision, problem.theta_llm
    lhs = h0 @ (target - theta_llm) - sum(
        a * h0 @ (problem.finetuned(t) - theta_llm) for t, a in enumerate(alphas)
    )
    rhs = -torch.stack(
        [a * d for a, d in zip(alphas, _mismatches(problem, target), strict=True)]
    ).sum(0)
    return residual(lhs, rhs, h0 @ (target - theta_llm))


def eq2_any_loss(spec: LogisticMergeSpec) -> float:
    """Eq. 2 via gm: θ_{1:T} = gm.task_arithmetic − gm.gradient_mismatch(...).correction."""
    problem, alphas = spec.build(), list(spec.alphas)
    lay = Layout(problem.model.layout)
    inputs = merge_inputs(problem)
    target = problem.target(alphas)
    grads = lay.grad_fns(problem.gradient, problem.num_tasks)
    mismatch = gm.gradient_mismatch(
        lay.params(target), inputs["finetuned"], grads, alphas=alphas, prior=inputs["prior"]
    )
    ta = lay.flat(gm.task_arithmetic(inputs["base"], inputs["finetuned"], alphas=alphas))
    assert mismatch.correction is not None
    correction = lay.flat(mismatch.correction)
    return residual(ta - correction, target, ta, correction)


def line5_printed(spec: LogisticMergeSpec) -> float:
    """As printed: θ_LLM = −∇ℓ̄_LLM(θ_LLM) (θ_LLM trained with (δ/2)‖θ‖², δ ≠ 1)."""
    problem = replace(spec, delta=alpha_not_one(rng(spec.seed + 1))).build()
    return rel(problem.theta_llm, -problem.pretraining_gradient(problem.theta_llm))


def line5_corrected(spec: LogisticMergeSpec) -> float:
    """Corrected: δθ_LLM = −∇ℓ̄_LLM(θ_LLM)."""
    problem = spec.build()
    return rel(problem.delta * problem.theta_llm, -problem.pretraining_gradient(problem.theta_llm))


# ----- the error of each rule, exactly, in terms of Taylor remainders ------------------------
def eq6_remainder(spec: LogisticMergeSpec) -> float:
    """gm.gradient_matching − θ_{1:T} = H̄⁻¹ Σ_t α_t ρ_t, ρ_t = Δ_t − H_t(θ_{1:T} − θ_t) (any
    loss)."""
    problem, alphas = spec.build(), list(spec.alphas)
    lay = Layout(problem.model.layout)
    merged = lay.flat(gm.gradient_matching(**merge_inputs(problem), alphas=alphas))
    target = problem.target(alphas)
    rho = [
        d - problem.hessian(t) @ (target - problem.finetuned(t))
        for t, d in enumerate(_mismatches(problem, target))
    ]
    predicted = torch.linalg.solve(
        problem.merged_precision(alphas), sum(a * r for a, r in zip(alphas, rho, strict=True))
    )
    return residual(merged - target, predicted, merged, target)


def _removal_remainders(problem: logistic.LogisticRemovalProblem) -> tuple[Tensor, Tensor]:
    """ρ_1 = ∇ℓ̄_\\t(θ_\\t) − ∇ℓ̄_\\t(θ_LLM) − ∇²ℓ̄_\\t(θ_LLM)(θ_\\t − θ_LLM) and
    ρ_2 = ∇ℓ̄_t(θ_LLM) − ∇ℓ̄_t(θ_t) − H_t(θ_LLM − θ_t): the Taylor remainders of line 25
    and Eq. 12."""
    refit, theta_llm, theta_t = problem.refit, problem.theta_llm, problem.finetuned
    eye = torch.eye(problem.num_params, dtype=DTYPE)
    h_rest = problem.remaining_hessian() - problem.delta * eye
    rho1 = (
        problem.remaining_gradient(refit)
        - problem.remaining_gradient(theta_llm)
        - h_rest @ (refit - theta_llm)
    )
    rho2 = (
        problem.task_gradient(theta_llm)
        - problem.task_gradient(theta_t)
        - problem.task_hessian() @ (theta_llm - theta_t)
    )
    return rho1, rho2


def eq13_remainder(spec: LogisticRemovalSpec) -> float:
    """gm.remove − θ_\\t = H̄_\\t⁻¹(ρ_1 − α_t ρ_2) (any loss)."""
    problem = spec.build()
    lay = Layout(problem.model.layout)
    removed = gm.remove(
        lay.params(problem.theta_llm),
        lay.params(problem.finetuned),
        lay.dense(problem.task_hessian()),
        remaining=lay.dense(problem.remaining_hessian()),
        prior=lay.dense(problem.prior_precision),
        alpha=problem.alpha,
    )
    rho1, rho2 = _removal_remainders(problem)
    predicted = torch.linalg.solve(problem.remaining_hessian(), rho1 - problem.alpha * rho2)
    return residual(lay.flat(removed) - problem.refit, predicted, lay.flat(removed), problem.refit)


def koh_liang_remainder(spec: LogisticRemovalSpec) -> float:
    """gm.influence_remove − θ_\\t = H̄_\\t⁻¹ ρ_1 (any loss)."""
    problem = spec.build()
    lay = Layout(problem.model.layout)
    removed = gm.influence_remove(
        lay.params(problem.theta_llm),
        lay.params(problem.task_gradient_at_llm()),
        remaining=lay.dense(problem.remaining_hessian()),
        alpha=problem.alpha,
    )
    rho1, _ = _removal_remainders(problem)
    predicted = torch.linalg.solve(problem.remaining_hessian(), rho1)
    return residual(lay.flat(removed) - problem.refit, predicted, lay.flat(removed), problem.refit)


# ----- Sec. 1.5: Theorem 1 -------------------------------------------------------------------
def thm1_left(spec: LogisticMergeSpec) -> float:
    """θ_{1:T} is stationary for log p(θ) + Σ_t α_t log[p(θ|D_t)/p(θ)], p(θ|D_t) ∝ p(θ)e^{−ℓ̄_t}."""
    problem, alphas = spec.build(), list(spec.alphas)
    target, h0, theta_llm = problem.target(alphas), problem.prior_precision, problem.theta_llm

    def objective(th: Tensor) -> Tensor:  # log p(θ) − Σ α_t ℓ̄_t(θ), up to constants
        quad = -0.5 * (th - theta_llm) @ h0 @ (th - theta_llm)
        return quad - sum(a * problem.loss(t, th) for t, a in enumerate(alphas))

    grad = torch.autograd.functional.jacobian(objective, target)
    scale = float(torch.linalg.norm(h0 @ (target - theta_llm))) + sum(
        a * float(torch.linalg.norm(problem.gradient(t, target))) for t, a in enumerate(alphas)
    )
    return float(torch.linalg.norm(grad)) / max(scale, 1e-300)


def _laplace_map(spec: LogisticMergeSpec, *, printed: bool) -> float:
    """arg max of q_α (Eq. 19) found by Newton on its autograd Hessian, against
    gm.gradient_matching."""
    problem, alphas = spec.build(), list(spec.alphas)
    lay = Layout(problem.model.layout)
    h0, theta_llm = problem.prior_precision, problem.theta_llm

    def neg_log_q(th: Tensor) -> Tensor:
        out = 0.5 * (th - theta_llm) @ h0 @ (th - theta_llm)
        for t, a in enumerate(alphas):
            theta_t = problem.finetuned(t)
            out = out + a * 0.5 * (th - theta_t) @ problem.hessian(t) @ (th - theta_t)
            if not printed:  # keep ∇ℓ̄_t(θ_t)ᵀ(θ − θ_t): θ_t is not a minimum of ℓ̄_t alone
                out = out + a * problem.gradient(t, theta_t) @ (th - theta_t)
        return out

    # neg_log_q is quadratic: one Newton step from θ_LLM lands on its minimiser exactly
    grad = torch.autograd.functional.jacobian(neg_log_q, theta_llm)
    hess = torch.autograd.functional.hessian(neg_log_q, theta_llm)
    map_q = theta_llm - torch.linalg.solve(hess, grad)
    merged = lay.flat(gm.gradient_matching(**merge_inputs(problem), alphas=alphas))
    return rel(merged, map_q)


def thm1_right_printed(spec: LogisticMergeSpec) -> float:
    """As printed: Eq. 18 (gm.gradient_matching) = arg max q_α with Eq. 19's q_α."""
    return _laplace_map(spec, printed=True)


def thm1_right_corrected(spec: LogisticMergeSpec) -> float:
    """Corrected: Eq. 18 = arg max q_α with the first-order term of the expansion at θ_t kept."""
    return _laplace_map(spec, printed=False)


# ----- line 105: the "Monte-Carlo estimator" of the diagonal Fisher ---------------------------
def _fisher_diagonals(spec: LogisticMergeSpec) -> tuple[Tensor, Tensor, Tensor]:
    """(Σ_i ∇ℓ_i(y_i)² with observed labels, E_{y~model}[Σ_i ∇ℓ_i(y)²] by enumeration, diag F)."""
    problem = spec.build()
    model, X, y = problem.model, problem.X_tasks[0], problem.y_tasks[0]
    theta = problem.finetuned(0)
    empirical = (model.per_example_gradients(theta, X, y) ** 2).sum(0)
    probs = model.predict_proba(theta, X)  # n × K
    expected = torch.zeros_like(empirical)
    for k in range(model.num_classes):
        labels = torch.full_like(y, k)
        sq = model.per_example_gradients(theta, X, labels) ** 2
        expected = expected + (probs[:, k : k + 1] * sq).sum(0)
    return empirical, expected, torch.diagonal(model.fisher(theta, X))


def line105_printed(spec: LogisticMergeSpec) -> float:
    """As printed: Σ_i[∇ℓ_i(θ)]² (observed labels) is the diagonal Fisher's MC estimate."""
    empirical, _, fisher = _fisher_diagonals(spec)
    return rel(empirical, fisher)


def line105_corrected(spec: LogisticMergeSpec) -> float:
    """Corrected: with labels drawn from the model, E[Σ_i ∇ℓ_i(y)²] is the diagonal Fisher."""
    _, expected, fisher = _fisher_diagonals(spec)
    return rel(expected, fisher)


CHECKS: list[NumericCheck] = [
    NumericCheck(
        "line5-first-printed",
        "line 5",
        "θ_LLM = −∇ℓ̄_LLM(θ_LLM) (δ ≠ 1)",
        False,
        line5_printed,
    ),
    NumericCheck(
        "line5-first-corrected",
        "line 5",
        "δθ_LLM = −∇ℓ̄_LLM(θ_LLM)",
        True,
        line5_corrected,
    ),
    NumericCheck(
        "eq1",
        "Eq. 1 (line 7)",
        "3rd − Σα_t·2nd stationarity condition, any loss",
        True,
        eq1_any_loss,
    ),
    NumericCheck(
        "eq2",
        "Eq. 2 (line 8)",
        "θ_{1:T} = θ_TA − Σα_t H_0⁻¹[mismatch], any loss",
        True,
        eq2_any_loss,
    ),
    NumericCheck(
        "eq6-error",
        "Eq. 6 (line 16)",
        "θ̂ − θ_{1:T} = H̄⁻¹Σα_t ρ_t (Taylor remainders)",
        True,
        eq6_remainder,
    ),
    NumericCheck(
        "eq13-error",
        "Eq. 13 (line 30)",
        "θ̂_\\t − θ_\\t = H̄_\\t⁻¹(ρ_1 − α_t ρ_2)",
        True,
        eq13_remainder,
    ),
    NumericCheck(
        "koh-liang-error",
        "line 48",
        "θ̂_KL − θ_\\t = H̄_\\t⁻¹ρ_1",
        True,
        koh_liang_remainder,
    ),
    NumericCheck(
        "eq20-left-stationarity",
        "Theorem 1, Eq. 20",
        "θ_{1:T} = arg max p(θ)Π[p(θ|D_t)/p(θ)]^α_t",
        True,
        thm1_left,
    ),
    NumericCheck(
        "eq20-right-printed",
        "Theorem 1, Eq. 19–20",
        "Eq. 18 = arg max q_α, q_α as printed",
        False,
        thm1_right_printed,
    ),
    NumericCheck(
        "eq20-right-corrected",
        "Theorem 1, Eq. 19–20",
        "Eq. 18 = arg max q_α, first-order term kept",
        True,
        thm1_right_corrected,
    ),
    NumericCheck(
        "line105-printed",
        "line 105",
        "Σ_i[∇ℓ_i]² (observed y) = diagonal Fisher",
        False,
        line105_printed,
    ),
    NumericCheck(
        "line105-corrected",
        "line 105",
        "E_{y~model}Σ_i[∇ℓ_i]² = diagonal Fisher",
        True,
        line105_corrected,
    ),
]
