"""Exact linear-regression reference model (paper appendix, Sec. 1.4 and 1.5).

The loss of a data set (X, y), X ∈ R^{n×d} with one example per row, is the SUM over examples

    ℓ̄(θ) = ½ ‖y − Xθ‖² = Σ_i ½ (y_i − x_iᵀθ)²,
    ∇ℓ̄(θ) = Xᵀ(Xθ − y),        ∇²ℓ̄(θ) = XᵀX   (independent of θ and y).

Optional per-example weights w_i turn it into Σ_i w_i ½ (y_i − x_iᵀθ)² (gradient Xᵀ W (Xθ − y),
Hessian Xᵀ W X). Every minimiser of a quadratic objective is a closed form solved by Cholesky, so
the merge target θ_{1:T}, the fine-tuned models θ_t and the exact refit θ_\\t are exact up to
rounding; on this model the merge rule (Eq. 6) and the removal rule (Eq. 13) are exact identities,
which is what makes it a ground truth for the library's merge formulas.

All tensors are ``torch.float64``; parameters are flat vectors θ ∈ R^d.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from gradmerge.theory.problems import (
    DTYPE,
    PrecisionLike,
    as_float64,
    cholesky_solve,
    feature_scales,
    merged_precision,
    normalise_alphas,
    perturbed_rotation,
    precision_matrix,
    prior_mean_vector,
    random_features,
    random_orthogonal,
    random_spd,
)

__all__ = [
    "LinearMergeProblem",
    "LinearRemovalProblem",
    "fit",
    "fit_weighted",
    "gradient",
    "hessian",
    "loss",
    "make_linear_merge_problem",
    "make_linear_removal_problem",
]


# --------------------------------------------------------------------------------------------
# loss, gradient, Hessian


def _weights(weights: Tensor | None, n: int) -> Tensor:
    if weights is None:
        return torch.ones(n, dtype=DTYPE)
    w = as_float64(weights)
    if w.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), got {tuple(w.shape)}")
    return w


def loss(theta: Tensor, X: Tensor, y: Tensor, weights: Tensor | None = None) -> Tensor:
    """ℓ̄(θ) = Σ_i w_i ½ (y_i − x_iᵀθ)² (w_i = 1 by default): a SUM over examples, a 0-d tensor."""
    X, y = as_float64(X), as_float64(y)
    r = y - X @ as_float64(theta)
    return 0.5 * torch.sum(_weights(weights, X.shape[0]) * r * r)


def gradient(theta: Tensor, X: Tensor, y: Tensor, weights: Tensor | None = None) -> Tensor:
    """∇ℓ̄(θ) = Xᵀ W (Xθ − y) with W = diag(w) (W = I by default)."""
    X, y = as_float64(X), as_float64(y)
    r = X @ as_float64(theta) - y
    return X.T @ (_weights(weights, X.shape[0]) * r)


def hessian(
    theta: Tensor | None, X: Tensor, y: Tensor | None = None, weights: Tensor | None = None
) -> Tensor:
    """∇²ℓ̄(θ) = Xᵀ W X (does not depend on θ or y; they are accepted for a uniform signature)."""
    del theta, y
    X = as_float64(X)
    H = X.T @ (_weights(weights, X.shape[0])[:, None] * X)
    return 0.5 * (H + H.T)


# --------------------------------------------------------------------------------------------
# closed-form fits


def fit_weighted(
    datasets: Sequence[tuple[Tensor, Tensor, float]],
    *,
    prior_precision: PrecisionLike,
    prior_mean: Tensor | float | None = None,
) -> Tensor:
    """argmin_θ Σ_k w_k ½‖y_k − X_kθ‖² + ½‖θ − m‖²_P, in closed form.

    The stationarity condition Σ_k w_k X_kᵀ(X_kθ − y_k) + P(θ − m) = 0 is the SPD system

        (Σ_k w_k X_kᵀX_k + P) θ = Σ_k w_k X_kᵀ y_k + P m,

    solved by Cholesky. ``prior_precision`` P is δ (δ·I), a diagonal or a d×d matrix; it may be 0
    when Σ_k w_k X_kᵀX_k is positive definite (ordinary least squares). ``prior_mean`` m defaults
    to 0.

    Raises:
        NotPositiveDefiniteError: when the system matrix is not positive definite.
    """
    if not datasets:
        raise ValueError("fit_weighted needs at least one data set")
    d = as_float64(datasets[0][0]).shape[1]
    P = precision_matrix(prior_precision, d)
    m = prior_mean_vector(prior_mean, d)
    A = P.clone()
    b = P @ m
    for X, y, w in datasets:
        X, y = as_float64(X), as_float64(y)
        A = A + float(w) * (X.T @ X)
        b = b + float(w) * (X.T @ y)
    return cholesky_solve(A, b, what="Σ_k w_k X_kᵀX_k + P")


def fit(
    X: Tensor,
    y: Tensor,
    *,
    prior_precision: PrecisionLike,
    prior_mean: Tensor | float | None = None,
    weight: float = 1.0,
) -> Tensor:
    """argmin_θ weight·½‖y − Xθ‖² + ½‖θ − m‖²_P, i.e. (weight·XᵀX + P)θ = weight·Xᵀy + Pm.

    See :func:`fit_weighted`, of which this is the one-data-set case.
    """
    return fit_weighted([(X, y, weight)], prior_precision=prior_precision, prior_mean=prior_mean)


# --------------------------------------------------------------------------------------------
# merge problem


@dataclass(frozen=True, eq=False)
class LinearMergeProblem:
    """T linear-regression tasks fine-tuned from one pretrained model (Sec. 1.1–1.2).

    Quantities (all exact closed forms):

    - θ_LLM = argmin_θ ℓ̄_pt(θ) + (δ/2)‖θ‖²                         # Eq. 7
    - θ_t   = argmin_θ ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}                # Eq. 15
    - θ_{1:T}(α) = argmin_θ Σ_t α_t ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}    (target of Eq. 2)
    - H_t = X_tᵀX_t (SUM over the examples of task t), ∇ℓ̄_t(θ) = X_tᵀ(X_tθ − y_t).

    Stationarity (Sec. 1.1): δθ_LLM = −∇ℓ̄_pt(θ_LLM); H_0(θ_t − θ_LLM) = −∇ℓ̄_t(θ_t);
    H_0(θ_{1:T} − θ_LLM) = −Σ_t α_t ∇ℓ̄_t(θ_{1:T}). Because the losses are quadratic, the merge rule
    θ_LLM + Σ_t α_t H̄⁻¹(H_0 + H_t)(θ_t − θ_LLM) with H̄ = H_0 + Σ_t α_t H_t (Eq. 6) equals
    θ_{1:T}(α) exactly.

    Attributes:
        X_pt, y_pt: pretraining data (n_pt×d, n_pt).
        delta: δ > 0, the isotropic prior precision of pretraining (Eq. 7).
        X_tasks, y_tasks: one (n_t×d, n_t) data set per task.
        prior_precision: H_0, the d×d SPD precision of the fine-tuning prior around θ_LLM.
    """

    X_pt: Tensor
    y_pt: Tensor
    delta: float
    X_tasks: tuple[Tensor, ...]
    y_tasks: tuple[Tensor, ...]
    prior_precision: Tensor

    @property
    def num_tasks(self) -> int:
        """T."""
        return len(self.X_tasks)

    @property
    def num_params(self) -> int:
        """p = d."""
        return self.X_pt.shape[1]

    @cached_property
    def theta_llm(self) -> Tensor:
        """θ_LLM = (X_ptᵀX_pt + δI)⁻¹ X_ptᵀ y_pt.  # Eq. 7"""
        return fit(self.X_pt, self.y_pt, prior_precision=self.delta)

    @cached_property
    def _finetuned(self) -> tuple[Tensor, ...]:
        return tuple(
            fit(X, y, prior_precision=self.prior_precision, prior_mean=self.theta_llm)
            for X, y in zip(self.X_tasks, self.y_tasks, strict=True)
        )

    def finetuned(self, t: int) -> Tensor:
        """θ_t = (H_0 + X_tᵀX_t)⁻¹(H_0 θ_LLM + X_tᵀy_t).  # Eq. 15"""
        return self._finetuned[t]

    @property
    def finetuned_all(self) -> tuple[Tensor, ...]:
        """(θ_1, …, θ_T)."""
        return self._finetuned

    def target(self, alphas: float | Sequence[float] | Tensor = 1.0) -> Tensor:
        """θ_{1:T}(α) = argmin_θ Σ_t α_t ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0} (α_t ≥ 0)."""
        a = normalise_alphas(alphas, self.num_tasks)
        data = [(X, y, float(w)) for X, y, w in zip(self.X_tasks, self.y_tasks, a, strict=True)]
        return fit_weighted(data, prior_precision=self.prior_precision, prior_mean=self.theta_llm)

    def hessian(self, t: int, theta: Tensor | None = None) -> Tensor:
        """H_t = X_tᵀX_t (constant; ``theta`` is accepted for symmetry with the logistic model)."""
        return hessian(theta, self.X_tasks[t])

    def gradient(self, t: int, theta: Tensor) -> Tensor:
        """∇ℓ̄_t(θ) = X_tᵀ(X_tθ − y_t)."""
        return gradient(theta, self.X_tasks[t], self.y_tasks[t])

    def loss(self, t: int, theta: Tensor) -> Tensor:
        """ℓ̄_t(θ) = ½‖y_t − X_tθ‖²."""
        return loss(theta, self.X_tasks[t], self.y_tasks[t])

    def pretraining_hessian(self) -> Tensor:
        """δI + X_ptᵀX_pt, the Hessian of the pretraining objective of Eq. 7."""
        return self.delta * torch.eye(self.num_params, dtype=DTYPE) + hessian(None, self.X_pt)

    def merged_precision(self, alphas: float | Sequence[float] | Tensor = 1.0) -> Tensor:
        """H̄ = H_0 + Σ_t α_t H_t."""
        hessians = [self.hessian(t) for t in range(self.num_tasks)]
        a = normalise_alphas(alphas, self.num_tasks)
        return merged_precision(self.prior_precision, hessians, a)


# --------------------------------------------------------------------------------------------
# removal problem


@dataclass(frozen=True, eq=False)
class LinearRemovalProblem:
    """Remove a data set D_t from a model trained on D_\\t ∪ D_t (Sec. 1.3–1.4).

    - θ_LLM = argmin_θ ℓ̄_\\t(θ) + α_t ℓ̄_t(θ) + (δ/2)‖θ‖²           # Eq. 9
    - θ_t   = argmin_θ ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}                 # Eq. 15
    - θ_\\t  = argmin_θ ℓ̄_\\t(θ) + (δ/2)‖θ‖²  (the exact refit)       # Eq. 8
    - H̄_\\t = δI + X_keepᵀX_keep, H_t = X_tᵀX_t, g_t = ∇ℓ̄_t(θ_LLM).

    Stationarity: Eq. 10. For this model both the removal rule
    θ_LLM − α_t H̄_\\t⁻¹(H_0 + H_t)(θ_t − θ_LLM) (Eq. 13) and the influence rule
    θ_LLM + α_t H̄_\\t⁻¹ g_t equal θ_\\t exactly (for α_t = 1 the latter is Eq. 14/16).

    Attributes:
        X_keep, y_keep: the data that stay, D_\\t.
        X_t, y_t: the data to remove, D_t.
        delta: δ > 0 (Eq. 8, 9).
        alpha: α_t, the weight of D_t in the original training (Eq. 9).
        prior_precision: H_0, the d×d SPD precision used to fine-tune θ_t (Eq. 15).
    """

    X_keep: Tensor
    y_keep: Tensor
    X_t: Tensor
    y_t: Tensor
    delta: float
    alpha: float
    prior_precision: Tensor

    @property
    def num_params(self) -> int:
        """p = d."""
        return self.X_keep.shape[1]

    @cached_property
    def theta_llm(self) -> Tensor:
        """θ_LLM = (δI + X_keepᵀX_keep + α_t X_tᵀX_t)⁻¹(X_keepᵀy_keep + α_t X_tᵀy_t).  # Eq. 9"""
        data = [(self.X_keep, self.y_keep, 1.0), (self.X_t, self.y_t, self.alpha)]
        return fit_weighted(data, prior_precision=self.delta)

    @cached_property
    def finetuned(self) -> Tensor:
        """θ_t = (H_0 + X_tᵀX_t)⁻¹(H_0 θ_LLM + X_tᵀy_t).  # Eq. 15"""
        return fit(
            self.X_t, self.y_t, prior_precision=self.prior_precision, prior_mean=self.theta_llm
        )

    @cached_property
    def refit(self) -> Tensor:
        """θ_\\t = (δI + X_keepᵀX_keep)⁻¹ X_keepᵀy_keep, the exact answer.  # Eq. 8"""
        return fit(self.X_keep, self.y_keep, prior_precision=self.delta)

    def remaining_hessian(self) -> Tensor:
        """H̄_\\t = δI + X_keepᵀX_keep (= δI + ∇²ℓ̄_\\t at any θ)."""
        return self.delta * torch.eye(self.num_params, dtype=DTYPE) + hessian(None, self.X_keep)

    def task_hessian(self) -> Tensor:
        """H_t = X_tᵀX_t."""
        return hessian(None, self.X_t)

    def task_gradient(self, theta: Tensor) -> Tensor:
        """∇ℓ̄_t(θ) = X_tᵀ(X_tθ − y_t)."""
        return gradient(theta, self.X_t, self.y_t)

    def remaining_gradient(self, theta: Tensor) -> Tensor:
        """∇ℓ̄_\\t(θ) = X_keepᵀ(X_keepθ − y_keep) (without the δθ of the prior)."""
        return gradient(theta, self.X_keep, self.y_keep)

    def task_gradient_at_llm(self) -> Tensor:
        """g_t = ∇ℓ̄_t(θ_LLM) (Koh & Liang's influence removal uses it, Sec. 1.4)."""
        return self.task_gradient(self.theta_llm)


# --------------------------------------------------------------------------------------------
# generators


def make_linear_merge_problem(
    seed: int,
    *,
    d: int,
    tasks: int,
    n_per_task: int,
    n_pretrain: int | None = None,
    condition: float = 1.0e2,
    delta: float = 1.0,
    prior_condition: float = 1.0e1,
    prior_scale: float = 1.0,
    noise: float = 0.1,
    task_shift: float = 1.0,
    covariate_shift: float = 0.0,
) -> LinearMergeProblem:
    """A random :class:`LinearMergeProblem`, deterministic in ``seed``.

    Data model. Features are x = Q diag(s) z (+ μ_t), z ~ N(0, I), with s log-spaced so the
    population covariance Q diag(s²) Qᵀ has condition number ``condition`` (largest eigenvalue 1)
    and Q a random rotation. Responses y = xᵀθ*_src + ``noise``·ε, ε ~ N(0, 1). Pretraining uses
    θ*_pt ~ N(0, I); task t uses θ*_t = θ*_pt + ``task_shift``·u_t with u_t ~ N(0, I), so the
    tasks differ; with ``covariate_shift`` > 0 task t also uses its own rotation Q_t (the Q factor
    of Q + covariate_shift·G_t), so the task Hessians H_t differ in their eigenvectors too.

    Args:
        seed: seed of the ``torch.Generator`` that draws everything.
        d: number of parameters (features; no intercept).
        tasks: T, the number of tasks.
        n_per_task: examples per task (n_per_task < d gives rank-deficient H_t, which is fine
            because H_0 is SPD).
        n_pretrain: pretraining examples (default 10·d).
        condition: condition number of the feature covariance (the sample XᵀX/n is close to it
            when n ≫ d).
        delta: δ of the pretraining prior (Eq. 7).
        prior_condition: condition number of H_0.
        prior_scale: 2-norm (largest eigenvalue) of H_0 = V diag(λ) Vᵀ, λ log-spaced from
            prior_scale down to prior_scale/prior_condition, V a random rotation.
        noise: standard deviation of the response noise.
        task_shift: size of the task-specific change of the true parameters.
        covariate_shift: how far each task's feature rotation moves away from pretraining's.
    """
    g = torch.Generator().manual_seed(seed)
    n_pt = 10 * d if n_pretrain is None else n_pretrain
    s = feature_scales(d, condition)
    Q = random_orthogonal(d, g)
    theta_star = torch.randn(d, generator=g, dtype=DTYPE)
    X_pt = random_features(n_pt, s, Q, g)
    y_pt = X_pt @ theta_star + noise * torch.randn(n_pt, generator=g, dtype=DTYPE)
    Xs, ys = [], []
    for _ in range(tasks):
        Q_t = perturbed_rotation(Q, covariate_shift, g)
        theta_t = theta_star + task_shift * torch.randn(d, generator=g, dtype=DTYPE)
        X_t = random_features(n_per_task, s, Q_t, g)
        y_t = X_t @ theta_t + noise * torch.randn(n_per_task, generator=g, dtype=DTYPE)
        Xs.append(X_t)
        ys.append(y_t)
    H0 = random_spd(d, condition=prior_condition, scale=prior_scale, generator=g)
    return LinearMergeProblem(
        X_pt=X_pt,
        y_pt=y_pt,
        delta=float(delta),
        X_tasks=tuple(Xs),
        y_tasks=tuple(ys),
        prior_precision=H0,
    )


def make_linear_removal_problem(
    seed: int,
    *,
    d: int,
    n_keep: int,
    n_remove: int,
    delta: float = 1.0,
    alpha: float = 1.0,
    condition: float = 1.0e2,
    prior_condition: float = 1.0e1,
    prior_scale: float = 1.0,
    noise: float = 0.1,
    shift: float = 1.0,
) -> LinearRemovalProblem:
    """A random :class:`LinearRemovalProblem`, deterministic in ``seed``.

    Features as in :func:`make_linear_merge_problem` (covariance condition number ``condition``).
    The kept data follow θ*; the removed data follow θ* + ``shift``·u (u ~ N(0, I)), so removing
    them moves the model. H_0 is a random SPD matrix with 2-norm ``prior_scale`` and condition
    number ``prior_condition``.

    Args:
        seed: seed of the ``torch.Generator``.
        d: number of parameters.
        n_keep: size of D_\\t.
        n_remove: size of D_t.
        delta: δ (Eq. 8, 9).
        alpha: α_t, the weight D_t had in training (Eq. 9).
        condition, prior_condition, prior_scale, noise: as in :func:`make_linear_merge_problem`.
        shift: how different the removed data's true parameters are.
    """
    g = torch.Generator().manual_seed(seed)
    s = feature_scales(d, condition)
    Q = random_orthogonal(d, g)
    theta_star = torch.randn(d, generator=g, dtype=DTYPE)
    theta_removed = theta_star + shift * torch.randn(d, generator=g, dtype=DTYPE)
    X_keep = random_features(n_keep, s, Q, g)
    y_keep = X_keep @ theta_star + noise * torch.randn(n_keep, generator=g, dtype=DTYPE)
    X_t = random_features(n_remove, s, Q, g)
    y_t = X_t @ theta_removed + noise * torch.randn(n_remove, generator=g, dtype=DTYPE)
    H0 = random_spd(d, condition=prior_condition, scale=prior_scale, generator=g)
    return LinearRemovalProblem(
        X_keep=X_keep,
        y_keep=y_keep,
        X_t=X_t,
        y_t=y_t,
        delta=float(delta),
        alpha=float(alpha),
        prior_precision=H0,
    )
