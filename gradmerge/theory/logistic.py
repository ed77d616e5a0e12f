"""Exact logistic-regression merge and removal problems (Sec. 1.1–1.2, 1.4 of the appendix).

:class:`LogisticMergeProblem` and :class:`LogisticRemovalProblem` hold T tasks fine-tuned from one
pretrained softmax (or sigmoid) regression, every minimiser computed to machine precision by
:func:`newton_fit`; :func:`make_logistic_merge_problem` and :func:`make_logistic_removal_problem`
draw them from a seed. The model itself (loss, gradient, Hessian, Fisher; the flat parameter
layout) is :mod:`gradmerge.theory.logistic_model`, re-exported here, so that
``from gradmerge.theory import logistic`` gives the whole testbed.

Example:
    >>> problem = make_logistic_merge_problem(0, d=3, tasks=2, n_per_task=20)
    >>> problem.model.num_classes, len(problem.X_tasks)
    (2, 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from torch import Tensor

from gradmerge.theory.logistic_model import (
    LogisticModel,
    NewtonConvergenceError,
    NewtonInfo,
    NotIdentifiableError,
    newton_fit,
)
from gradmerge.theory.problems import (
    DTYPE,
    feature_scales,
    merged_precision,
    normalise_alphas,
    random_features,
    random_orthogonal,
)

__all__ = [
    "LogisticMergeProblem",
    "LogisticModel",
    "LogisticRemovalProblem",
    "NewtonConvergenceError",
    "NewtonInfo",
    "NotIdentifiableError",
    "make_logistic_merge_problem",
    "make_logistic_removal_problem",
    "newton_fit",
]

PriorKind = Literal["isotropic", "fisher"]


# ------------------------------------------------------------------------------------ problems


def _stack(
    Xs: Sequence[Tensor], ys: Sequence[Tensor], weights: Sequence[float]
) -> tuple[Tensor, Tensor, Tensor]:
    X = torch.cat(list(Xs), dim=0)
    y = torch.cat(list(ys), dim=0)
    w = torch.cat(
        [
            torch.full((Xi.shape[0],), float(wi), dtype=DTYPE)
            for Xi, wi in zip(Xs, weights, strict=True)
        ]
    )
    return X, y, w


@dataclass(frozen=True, eq=False)
class LogisticMergeProblem:
    """T logistic-regression tasks fine-tuned from one pretrained model (Sec. 1.1–1.2).

    All minimisers are computed by :func:`newton_fit` to machine precision:

    - θ_LLM = argmin_θ ℓ̄_pt(θ) + (δ/2)‖θ‖²                        # Eq. 7
    - θ_t   = argmin_θ ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}               # Eq. 15
    - θ_{1:T}(α) = argmin_θ Σ_t α_t ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}   (target of Eq. 2)

    Stationarity (Sec. 1.1): δθ_LLM = −∇ℓ̄_pt(θ_LLM); H_0(θ_t − θ_LLM) = −∇ℓ̄_t(θ_t);
    H_0(θ_{1:T} − θ_LLM) = −Σ_t α_t ∇ℓ̄_t(θ_{1:T}). Unlike the linear model, the merge rule (Eq. 6)
    is only a Taylor approximation here; its error is the gradient mismatch of Eq. 2.

    Attributes:
        model: the :class:`LogisticModel`.
        X_pt, y_pt: pretraining data.
        delta: δ > 0 of the pretraining prior (Eq. 7).
        X_tasks, y_tasks: one data set per task.
        prior_precision: H_0, the p×p SPD precision of the fine-tuning prior around θ_LLM.
    """

    model: LogisticModel
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
        """p."""
        return self.model.num_params

    @cached_property
    def theta_llm(self) -> Tensor:
        """θ_LLM = argmin ℓ̄_pt(θ) + (δ/2)‖θ‖².  # Eq. 7"""
        return newton_fit(self.model, self.X_pt, self.y_pt, prior_precision=self.delta)[0]

    @cached_property
    def finetuned_all(self) -> tuple[Tensor, ...]:
        """(θ_1, …, θ_T)."""
        return tuple(
            newton_fit(
                self.model,
                X,
                y,
                prior_precision=self.prior_precision,
                prior_mean=self.theta_llm,
                init=self.theta_llm,
            )[0]
            for X, y in zip(self.X_tasks, self.y_tasks, strict=True)
        )

    def finetuned(self, t: int) -> Tensor:
        """θ_t = argmin ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}.  # Eq. 15"""
        return self.finetuned_all[t]

    def target(self, alphas: float | Sequence[float] | Tensor = 1.0) -> Tensor:
        """θ_{1:T}(α) = argmin Σ_t α_t ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0} (α_t ≥ 0)."""
        a = normalise_alphas(alphas, self.num_tasks)
        X, y, w = _stack(self.X_tasks, self.y_tasks, [float(v) for v in a])
        return newton_fit(
            self.model,
            X,
            y,
            weights=w,
            prior_precision=self.prior_precision,
            prior_mean=self.theta_llm,
            init=self.theta_llm,
        )[0]

    def hessian(self, t: int, theta: Tensor | None = None) -> Tensor:
        """H_t = ∇²ℓ̄_t(θ), exact, at θ (default: θ_t, where Eq. 3 expands ℓ̄_t)."""
        theta = self.finetuned(t) if theta is None else theta
        return self.model.hessian(theta, self.X_tasks[t])

    def fisher(self, t: int, theta: Tensor | None = None) -> Tensor:
        """The true Fisher of task t at θ (default θ_t); equal to :meth:`hessian`."""
        theta = self.finetuned(t) if theta is None else theta
        return self.model.fisher(theta, self.X_tasks[t])

    def gradient(self, t: int, theta: Tensor) -> Tensor:
        """∇ℓ̄_t(θ)."""
        return self.model.gradient(theta, self.X_tasks[t], self.y_tasks[t])

    def loss(self, t: int, theta: Tensor) -> Tensor:
        """ℓ̄_t(θ)."""
        return self.model.loss(theta, self.X_tasks[t], self.y_tasks[t])

    def pretraining_gradient(self, theta: Tensor) -> Tensor:
        """∇ℓ̄_pt(θ) (without the δθ of the prior)."""
        return self.model.gradient(theta, self.X_pt, self.y_pt)

    def pretraining_hessian(self, theta: Tensor | None = None) -> Tensor:
        """δI + ∇²ℓ̄_pt(θ) (default at θ_LLM: the Laplace precision of the base model)."""
        theta = self.theta_llm if theta is None else theta
        eye = torch.eye(self.num_params, dtype=DTYPE)
        return self.delta * eye + self.model.hessian(theta, self.X_pt)

    def merged_precision(self, alphas: float | Sequence[float] | Tensor = 1.0) -> Tensor:
        """H̄ = H_0 + Σ_t α_t H_t with H_t at θ_t."""
        hessians = [self.hessian(t) for t in range(self.num_tasks)]
        a = normalise_alphas(alphas, self.num_tasks)
        return merged_precision(self.prior_precision, hessians, a)


@dataclass(frozen=True, eq=False)
class LogisticRemovalProblem:
    """Remove a data set D_t from a logistic model trained on D_\\t ∪ D_t (Sec. 1.3).

    - θ_LLM = argmin ℓ̄_\\t(θ) + α_t ℓ̄_t(θ) + (δ/2)‖θ‖²    # Eq. 9
    - θ_t   = argmin ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0}          # Eq. 15
    - θ_\\t  = argmin ℓ̄_\\t(θ) + (δ/2)‖θ‖² (exact refit)    # Eq. 8

    Stationarity: Eq. 10. The removal rule (Eq. 13) is an approximation here.

    Attributes:
        model: the :class:`LogisticModel`.
        X_keep, y_keep: D_\\t.
        X_t, y_t: D_t.
        delta: δ > 0.
        alpha: α_t (Eq. 9).
        prior_precision: H_0, the SPD precision used to fine-tune θ_t.
    """

    model: LogisticModel
    X_keep: Tensor
    y_keep: Tensor
    X_t: Tensor
    y_t: Tensor
    delta: float
    alpha: float
    prior_precision: Tensor

    @property
    def num_params(self) -> int:
        """p."""
        return self.model.num_params

    @cached_property
    def theta_llm(self) -> Tensor:
        """θ_LLM = argmin ℓ̄_\\t + α_t ℓ̄_t + (δ/2)‖θ‖².  # Eq. 9"""
        X, y, w = _stack([self.X_keep, self.X_t], [self.y_keep, self.y_t], [1.0, self.alpha])
        return newton_fit(self.model, X, y, weights=w, prior_precision=self.delta)[0]

    @cached_property
    def finetuned(self) -> Tensor:
        """θ_t = argmin ℓ̄_t + ½‖θ − θ_LLM‖²_{H_0}.  # Eq. 15"""
        return newton_fit(
            self.model,
            self.X_t,
            self.y_t,
            prior_precision=self.prior_precision,
            prior_mean=self.theta_llm,
            init=self.theta_llm,
        )[0]

    @cached_property
    def refit(self) -> Tensor:
        """θ_\\t = argmin ℓ̄_\\t + (δ/2)‖θ‖², the exact answer.  # Eq. 8"""
        return newton_fit(
            self.model, self.X_keep, self.y_keep, prior_precision=self.delta, init=self.theta_llm
        )[0]

    def remaining_hessian(self, theta: Tensor | None = None) -> Tensor:
        """H̄_\\t = δI + ∇²ℓ̄_\\t(θ), default at θ_LLM (as in Eq. 13)."""
        theta = self.theta_llm if theta is None else theta
        eye = torch.eye(self.num_params, dtype=DTYPE)
        return self.delta * eye + self.model.hessian(theta, self.X_keep)

    def task_hessian(self, theta: Tensor | None = None) -> Tensor:
        """H_t = ∇²ℓ̄_t(θ), default at θ_t (the expansion point of Eq. 12)."""
        theta = self.finetuned if theta is None else theta
        return self.model.hessian(theta, self.X_t)

    def task_gradient(self, theta: Tensor) -> Tensor:
        """∇ℓ̄_t(θ)."""
        return self.model.gradient(theta, self.X_t, self.y_t)

    def remaining_gradient(self, theta: Tensor) -> Tensor:
        """∇ℓ̄_\\t(θ) (without the δθ of the prior)."""
        return self.model.gradient(theta, self.X_keep, self.y_keep)

    def task_gradient_at_llm(self) -> Tensor:
        """g_t = ∇ℓ̄_t(θ_LLM) (influence removal, Sec. 1.4)."""
        return self.task_gradient(self.theta_llm)


# ------------------------------------------------------------------------------------ generators


def _true_weights(k: int, scales: Tensor, Q: Tensor, signal: float, g: torch.Generator) -> Tensor:
    """k×d Gaussian rows, each rescaled so its logit wᵀx has standard deviation ``signal``."""
    W = torch.randn(k, scales.shape[0], generator=g, dtype=DTYPE)
    logit_std = torch.linalg.norm((W @ Q) * scales[None, :], dim=1)
    return W * (signal / logit_std)[:, None]


def _sample_labels(model: LogisticModel, theta: Tensor, X: Tensor, g: torch.Generator) -> Tensor:
    """y_i ~ p(·|x_i, θ) by inverse-CDF sampling from the generator (integer labels)."""
    probs = model.predict_proba(theta, X)
    u = torch.rand(X.shape[0], 1, generator=g, dtype=DTYPE)
    labels = (torch.cumsum(probs, dim=1) < u).sum(dim=1)
    return labels.clamp(max=model.num_classes - 1).to(torch.long)


class _Sampler:
    """Features x = Q diag(s) z + μ and true parameters, shared by the generators."""

    def __init__(
        self,
        model: LogisticModel,
        g: torch.Generator,
        *,
        condition: float,
        signal: float,
        covariate_shift: float,
    ) -> None:
        self.model, self.g = model, g
        d = model.num_features
        self.s = feature_scales(d, condition)
        self.Q = random_orthogonal(d, g)
        self.signal = signal
        self.covariate_shift = covariate_shift
        self.base = self.parameters()

    def parameters(self) -> Tensor:
        """A random θ*: rows with logit std ``signal``, biases ~ N(0, 0.5²)."""
        m = self.model
        W = _true_weights(m.num_outputs, self.s, self.Q, self.signal, self.g)
        params = {"weight": W}
        if m.fit_intercept:
            params["bias"] = 0.5 * torch.randn(m.num_outputs, generator=self.g, dtype=DTYPE)
        return m.flatten(params)

    def shifted(self, shift: float) -> Tensor:
        """θ* + shift·u, u drawn like θ* (so ``shift`` is relative to the signal)."""
        return self.base + shift * self.parameters()

    def data(self, n: int, theta: Tensor, *, shifted_covariates: bool) -> tuple[Tensor, Tensor]:
        """n examples x (mean μ ~ covariate_shift·N(0, Σ) if shifted) with labels from θ."""
        mean = None
        if shifted_covariates and self.covariate_shift > 0.0:
            nu = torch.randn(self.s.shape[0], generator=self.g, dtype=DTYPE)
            mean = self.covariate_shift * (self.Q @ (self.s * nu))
        X = random_features(n, self.s, self.Q, self.g, mean=mean)
        return X, _sample_labels(self.model, theta, X, self.g)


def make_logistic_merge_problem(
    seed: int,
    *,
    d: int,
    tasks: int,
    n_per_task: int,
    classes: int = 2,
    n_pretrain: int | None = None,
    shift: float = 1.0,
    covariate_shift: float = 0.0,
    delta: float = 1.0,
    prior: PriorKind = "isotropic",
    prior_scale: float = 1.0,
    condition: float = 1.0e1,
    signal: float = 2.0,
    fit_intercept: bool = True,
) -> LogisticMergeProblem:
    """A random :class:`LogisticMergeProblem`, deterministic in ``seed``.

    Data model. Features x = Q diag(s) z (+ μ_t), z ~ N(0, I), s log-spaced so that the feature
    covariance has condition number ``condition`` (largest eigenvalue 1), Q a random rotation.
    True parameters: pretraining θ* has Gaussian weight rows rescaled so that every logit has
    standard deviation ``signal`` and biases ~ N(0, 0.5²); task t uses θ*_t = θ* + ``shift``·u_t
    with u_t drawn like θ*, so ``shift`` = 0 gives identical tasks and ``shift`` = 1 a change as
    large as the signal. With ``covariate_shift`` > 0 task t's features get a mean
    μ_t = covariate_shift·Q diag(s) ν_t, ν_t ~ N(0, I). Labels are sampled from the model.

    Fine-tuning prior H_0 (``prior``):

    - ``"isotropic"``: H_0 = prior_scale·δ·I.
    - ``"fisher"``: H_0 = prior_scale·(δI + F_pt(θ_LLM)), F_pt the true Fisher of the pretraining
      data at the base model as a SUM over its N_pt examples (= N_pt × the mean Fisher); with
      prior_scale = 1 this is the Laplace precision of the base model. SPD because δ > 0.

    Args:
        seed: seed of the ``torch.Generator``.
        d: number of features.
        tasks: T.
        n_per_task: examples per task.
        classes: K (2 gives the binary sigmoid model).
        n_pretrain: pretraining examples (default 20·d·K', enough to be non-separable).
        shift, covariate_shift: how much the tasks differ (see above).
        delta: δ > 0 of the pretraining prior (Eq. 7).
        prior, prior_scale: the fine-tuning prior (see above).
        condition: condition number of the feature covariance.
        signal: standard deviation of each true logit.
        fit_intercept: whether the model has biases.
    """
    if delta <= 0.0:
        raise ValueError(f"delta must be > 0, got {delta}")
    model = LogisticModel(d, classes, fit_intercept)
    g = torch.Generator().manual_seed(seed)
    sampler = _Sampler(
        model, g, condition=condition, signal=signal, covariate_shift=covariate_shift
    )
    n_pt = 20 * d * model.num_outputs if n_pretrain is None else n_pretrain
    X_pt, y_pt = sampler.data(n_pt, sampler.base, shifted_covariates=False)
    Xs, ys = [], []
    for _ in range(tasks):
        X_t, y_t = sampler.data(n_per_task, sampler.shifted(shift), shifted_covariates=True)
        Xs.append(X_t)
        ys.append(y_t)
    H0 = _prior(model, prior, prior_scale, delta, [(X_pt, y_pt, 1.0)])
    return LogisticMergeProblem(
        model=model,
        X_pt=X_pt,
        y_pt=y_pt,
        delta=float(delta),
        X_tasks=tuple(Xs),
        y_tasks=tuple(ys),
        prior_precision=H0,
    )


def _prior(
    model: LogisticModel,
    kind: PriorKind,
    scale: float,
    delta: float,
    data: Sequence[tuple[Tensor, Tensor, float]],
) -> Tensor:
    """H_0 of the generators: scale·δI, or scale·(δI + Σ_k w_k F_k(θ_LLM)) with θ_LLM the fit of
    the weighted ``data`` under the prior δI."""
    eye = torch.eye(model.num_params, dtype=DTYPE)
    if kind == "isotropic":
        return scale * delta * eye
    if kind != "fisher":
        raise ValueError(f"prior must be 'isotropic' or 'fisher', got {kind!r}")
    X, y, w = _stack([a for a, _, _ in data], [b for _, b, _ in data], [c for _, _, c in data])
    theta_llm, _ = newton_fit(model, X, y, weights=w, prior_precision=delta)
    H = scale * (delta * eye + model.fisher(theta_llm, X, weights=w))
    return 0.5 * (H + H.T)


def make_logistic_removal_problem(
    seed: int,
    *,
    d: int,
    n_keep: int,
    n_remove: int,
    classes: int = 2,
    delta: float = 1.0,
    alpha: float = 1.0,
    shift: float = 1.0,
    covariate_shift: float = 0.0,
    prior: PriorKind = "isotropic",
    prior_scale: float = 1.0,
    condition: float = 1.0e1,
    signal: float = 2.0,
    fit_intercept: bool = True,
) -> LogisticRemovalProblem:
    """A random :class:`LogisticRemovalProblem`, deterministic in ``seed``.

    Features and true parameters as in :func:`make_logistic_merge_problem`: the kept data follow
    θ*; the removed data follow θ* + ``shift``·u (and, with ``covariate_shift``, have shifted
    features). H_0 is ``prior_scale``·δI (``"isotropic"``) or ``prior_scale``·(δI + F_\\t(θ_LLM) +
    α_t F_t(θ_LLM)) (``"fisher"``: the Laplace precision of the base model of Eq. 9, Fishers as
    SUMS over examples).
    """
    if delta <= 0.0:
        raise ValueError(f"delta must be > 0, got {delta}")
    model = LogisticModel(d, classes, fit_intercept)
    g = torch.Generator().manual_seed(seed)
    sampler = _Sampler(
        model, g, condition=condition, signal=signal, covariate_shift=covariate_shift
    )
    X_keep, y_keep = sampler.data(n_keep, sampler.base, shifted_covariates=False)
    X_t, y_t = sampler.data(n_remove, sampler.shifted(shift), shifted_covariates=True)
    H0 = _prior(model, prior, prior_scale, delta, [(X_keep, y_keep, 1.0), (X_t, y_t, alpha)])
    return LogisticRemovalProblem(
        model=model,
        X_keep=X_keep,
        y_keep=y_keep,
        X_t=X_t,
        y_t=y_t,
        delta=float(delta),
        alpha=float(alpha),
        prior_precision=H0,
    )
