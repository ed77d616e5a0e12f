"""Exact logistic-regression reference model: binary (sigmoid) and multiclass (softmax).

Model. For an input x ∈ R^d let x̃ = [x, 1] when there is an intercept (x̃ = x otherwise) and let
the logits be z = W x + b ∈ R^{K'}. With K = 2 classes the model is binary: K' = 1, labels
y ∈ {0, 1}, p(y = 1 | x) = σ(z). With K ≥ 3 it is a softmax over K' = K full rows, labels
y ∈ {0, …, K−1}, p(y = k | x) = softmax(z)_k. (The full softmax is over-parametrised: adding the
same vector to every row of [W | b] changes nothing; see :func:`newton_fit`.)

Flat parameter layout (:attr:`LogisticModel.layout`, in flattening order): ``weight`` of shape
(K', d) flattened row-major, then ``bias`` of shape (K',) when ``fit_intercept``. So
θ[k·d + j] = W[k, j] and θ[K'·d + k] = b[k]; p = K'·d (+ K').

Loss of a data set, a SUM over examples with optional weights w_i:

    ℓ̄(θ) = Σ_i w_i ℓ_i(θ),   ℓ_i(θ) = logsumexp(z̃_i) − z̃_{i, y_i},

with z̃ = [0, z] for the binary model (so ℓ_i = log(1 + e^{z_i}) − y_i z_i) and z̃ = z for softmax.
With J_i = ∂z_i/∂θ (K'×p; J_i v = V x̃_i for the parameters V = unflatten(v)), p_i the vector of
the K' modelled probabilities (σ(z_i), or softmax(z_i)) and e_{y} the label's one-hot (y_i itself
for the binary model):

    ∇ℓ̄(θ)  = Σ_i w_i J_iᵀ (p_i − e_{y_i}),
    ∇²ℓ̄(θ) = Σ_i w_i J_iᵀ (diag(p_i) − p_i p_iᵀ) J_i   (= Σ_i w_i (diag p_i − p_i p_iᵀ) ⊗ x̃_i x̃_iᵀ
              up to the ordering of the flat layout),
    F(θ)    = Σ_i w_i E_{y ~ p(·|x_i, θ)} [∇ℓ_i ∇ℓ_iᵀ]  (the true Fisher), which equals ∇²ℓ̄(θ)
              because the link is canonical. :meth:`LogisticModel.fisher` computes it as the
              expectation (an independent route), so tests can check the identity.

All tensors are ``torch.float64``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from torch import Tensor

from gradmerge.theory.problems import (
    DTYPE,
    NotPositiveDefiniteError,
    Precision,
    as_float64,
    cholesky_solve,
    feature_scales,
    merged_precision,
    normalise_alphas,
    precision_matrix,
    prior_mean_vector,
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


class LogisticModel:
    """Binary (``num_classes == 2``) or softmax (``num_classes >= 3``) logistic regression.

    Every method takes a flat θ ∈ R^p in the layout of :attr:`layout` and returns float64 tensors.
    Losses, gradients, Hessians and Fishers are SUMS over examples (weighted by ``weights`` when
    given).
    """

    def __init__(self, num_features: int, num_classes: int, fit_intercept: bool = True) -> None:
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1, got {num_features}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.num_features = int(num_features)
        self.num_classes = int(num_classes)
        self.fit_intercept = bool(fit_intercept)

    def __repr__(self) -> str:
        return (
            f"LogisticModel(num_features={self.num_features}, num_classes={self.num_classes}, "
            f"fit_intercept={self.fit_intercept})"
        )

    # ---------------------------------------------------------------- layout

    @property
    def binary(self) -> bool:
        """True for the sigmoid model (K = 2, one logit)."""
        return self.num_classes == 2

    @property
    def num_outputs(self) -> int:
        """K', the number of logits: 1 for binary, K for softmax."""
        return 1 if self.binary else self.num_classes

    @property
    def layout(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes in flattening order: ``{"weight": (K', d), "bias": (K',)}``."""
        out: dict[str, tuple[int, ...]] = {"weight": (self.num_outputs, self.num_features)}
        if self.fit_intercept:
            out["bias"] = (self.num_outputs,)
        return out

    @property
    def num_params(self) -> int:
        """p = K'·d (+ K' with intercept)."""
        return self.num_outputs * (self.num_features + int(self.fit_intercept))

    def unflatten(self, theta: Tensor) -> dict[str, Tensor]:
        """θ → ``{"weight": W, "bias": b}`` (views, row-major)."""
        theta = self._check_theta(theta)
        k, d = self.num_outputs, self.num_features
        out = {"weight": theta[: k * d].reshape(k, d)}
        if self.fit_intercept:
            out["bias"] = theta[k * d :]
        return out

    def flatten(self, params: dict[str, Tensor]) -> Tensor:
        """Inverse of :meth:`unflatten`."""
        parts = []
        for name, shape in self.layout.items():
            value = as_float64(params[name])
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
            parts.append(value.reshape(-1))
        return torch.cat(parts)

    def _check_theta(self, theta: Tensor) -> Tensor:
        theta = as_float64(theta)
        if theta.shape != (self.num_params,):
            raise ValueError(
                f"theta must have shape ({self.num_params},), got {tuple(theta.shape)}"
            )
        return theta

    def _check_X(self, X: Tensor) -> Tensor:
        X = as_float64(X)
        if X.ndim != 2 or X.shape[1] != self.num_features:
            raise ValueError(f"X must have shape (n, {self.num_features}), got {tuple(X.shape)}")
        return X

    def _weights(self, weights: Tensor | None, n: int) -> Tensor:
        if weights is None:
            return torch.ones(n, dtype=DTYPE)
        w = as_float64(weights)
        if w.shape != (n,):
            raise ValueError(f"weights must have shape ({n},), got {tuple(w.shape)}")
        return w

    def _targets(self, y: Tensor, n: int) -> Tensor:
        """The n×K' matrix of e_{y_i} (binary: the column y_i)."""
        y = torch.as_tensor(y)
        if y.shape != (n,):
            raise ValueError(f"y must have shape ({n},), got {tuple(y.shape)}")
        labels = y.to(torch.long)
        if not torch.equal(labels.to(y.dtype), y) or labels.min() < 0:
            raise ValueError("labels must be integers in {0, …, K−1}")
        if int(labels.max()) >= self.num_classes:
            raise ValueError(f"labels must be < num_classes = {self.num_classes}")
        if self.binary:
            return labels.to(DTYPE)[:, None]
        return torch.nn.functional.one_hot(labels, self.num_classes).to(DTYPE)

    # ---------------------------------------------------------------- forward

    def logits(self, theta: Tensor, X: Tensor) -> Tensor:
        """z_i = W x_i + b, an n×K' tensor."""
        params = self.unflatten(theta)
        z = self._check_X(X) @ params["weight"].T
        if self.fit_intercept:
            z = z + params["bias"][None, :]
        return z

    def _probs(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """p_i and 1 − p_i (both n×K'), each to full relative precision.

        p_ik = σ(z_ik − L_ik) and 1 − p_ik = σ(L_ik − z_ik) with L_ik = logsumexp_{l≠k} z_il
        (binary: σ(z), σ(−z)). Forming 1 − p_ik by subtraction would lose all digits of a
        confident prediction, and with them the relative accuracy of gradients and Hessians.
        """
        if self.binary:
            return torch.sigmoid(z), torch.sigmoid(-z)
        k = z.shape[1]
        others = z[:, None, :].expand(-1, k, -1).clone()
        others[:, torch.arange(k), torch.arange(k)] = -math.inf
        L = torch.logsumexp(others, dim=2)
        return torch.sigmoid(z - L), torch.sigmoid(L - z)

    def _residuals(self, z: Tensor, Y: Tensor) -> Tensor:
        """p_i − e_{y_i}, computed as −(1 − p_ik) at the label so that it keeps its precision."""
        P, Q = self._probs(z)
        return torch.where(Y > 0.5, -Q, P)

    def predict_proba(self, theta: Tensor, X: Tensor) -> Tensor:
        """p(y = k | x_i, θ) as an n×K tensor (binary: columns [1 − σ(z), σ(z)])."""
        z = self.logits(theta, X)
        if self.binary:
            return torch.cat([torch.sigmoid(-z), torch.sigmoid(z)], dim=1)
        return torch.softmax(z, dim=1)

    def per_example_losses(self, theta: Tensor, X: Tensor, y: Tensor) -> Tensor:
        """ℓ_i(θ) = logsumexp(z̃_i) − z̃_{i,y_i} (unweighted), computed stably."""
        z = self.logits(theta, X)
        Y = self._targets(y, z.shape[0])
        if self.binary:
            # log(1 + e^z) − y z = log(1 + e^{(1−2y) z}), without cancellation.
            u = (1.0 - 2.0 * Y[:, 0]) * z[:, 0]
            return torch.logaddexp(torch.zeros_like(u), u)
        # ℓ = log Σ_k e^{u_k} with u = z − z_y (u_y = 0): log1p of the other terms when y is the
        # arg-max (small losses keep their relative precision), M + log Σ e^{u − M} otherwise.
        u = z - torch.sum(Y * z, dim=1, keepdim=True)
        M = u.max(dim=1).values
        small = torch.log1p(torch.sum(torch.where(Y > 0.5, 0.0, torch.exp(u)), dim=1))
        large = M + torch.log(torch.sum(torch.exp(u - M[:, None]), dim=1))
        return torch.where(M <= 0.0, small, large)

    def loss(self, theta: Tensor, X: Tensor, y: Tensor, weights: Tensor | None = None) -> Tensor:
        """ℓ̄(θ) = Σ_i w_i ℓ_i(θ) (a 0-d tensor)."""
        losses = self.per_example_losses(theta, X, y)
        return torch.sum(self._weights(weights, losses.shape[0]) * losses)

    # ---------------------------------------------------------------- derivatives

    def _pullback(self, R: Tensor, X: Tensor) -> Tensor:
        """Rows J_iᵀ r_i for an n×K' matrix of logit cotangents R: an n×p tensor."""
        n = X.shape[0]
        G = (R[:, :, None] * X[:, None, :]).reshape(n, -1)
        return torch.cat([G, R], dim=1) if self.fit_intercept else G

    def per_example_gradients(
        self, theta: Tensor, X: Tensor, y: Tensor, weights: Tensor | None = None
    ) -> Tensor:
        """The n×p matrix with rows w_i ∇ℓ_i(θ) = w_i J_iᵀ(p_i − e_{y_i}) (w_i = 1 by default)."""
        X = self._check_X(X)
        R = self._residuals(self.logits(theta, X), self._targets(y, X.shape[0]))
        return self._pullback(R * self._weights(weights, X.shape[0])[:, None], X)

    def gradient(
        self, theta: Tensor, X: Tensor, y: Tensor, weights: Tensor | None = None
    ) -> Tensor:
        """∇ℓ̄(θ) = Σ_i w_i J_iᵀ(p_i − e_{y_i})."""
        return self.per_example_gradients(theta, X, y, weights).sum(dim=0)

    def hessian(
        self, theta: Tensor, X: Tensor, y: Tensor | None = None, weights: Tensor | None = None
    ) -> Tensor:
        """∇²ℓ̄(θ) = Σ_i w_i J_iᵀ A_i J_i, A_i = diag(p_i) − p_i p_iᵀ (exact; independent of y).

        A_i is formed entrywise, with diagonal p_ik(1 − p_ik) from the accurate complements of
        :meth:`_probs`, so each entry of H is a sum over examples of A_i,kl x̃_ij x̃_im without
        cancellation. J_i (K'×p) has rows J_ik, the flat-layout image of e_k ⊗ x̃_i.
        """
        del y
        X = self._check_X(X)
        n, k = X.shape[0], self.num_outputs
        w = self._weights(weights, n)
        P, Q = self._probs(self.logits(theta, X))
        A = -P[:, :, None] * P[:, None, :]
        A[:, torch.arange(k), torch.arange(k)] = P * Q
        eye = torch.eye(k, dtype=DTYPE)
        # J[i, c, :] = J_ic, the gradient of logit c of example i.
        J = self._pullback(eye.repeat(n, 1), X.repeat_interleave(k, dim=0)).reshape(n, k, -1)
        H = torch.einsum("icp,icd,idq->pq", J, w[:, None, None] * A, J)
        return 0.5 * (H + H.T)

    def fisher(self, theta: Tensor, X: Tensor, weights: Tensor | None = None) -> Tensor:
        """F(θ) = Σ_i w_i Σ_c p(c | x_i, θ) ∇ℓ_i(θ; c) ∇ℓ_i(θ; c)ᵀ, the true Fisher (a SUM).

        Computed from the per-example gradients of every possible label c, not from the Hessian
        formula; for this canonical-link model it equals :meth:`hessian` exactly.
        """
        X = self._check_X(X)
        n = X.shape[0]
        w = self._weights(weights, n)
        probs = self.predict_proba(theta, X)
        F = torch.zeros(self.num_params, self.num_params, dtype=DTYPE)
        for c in range(self.num_classes):
            G = self.per_example_gradients(theta, X, torch.full((n,), c, dtype=torch.long))
            F = F + G.T @ ((w * probs[:, c])[:, None] * G)
        return 0.5 * (F + F.T)

    def null_space(self) -> Tensor:
        """An orthonormal basis (p×q) of the directions that leave every probability unchanged.

        Empty (p×0) for the binary model; for softmax the q = d (+1) directions that add one vector
        u to every row of [W | b].
        """
        p = self.num_params
        if self.binary:
            return torch.zeros(p, 0, dtype=DTYPE)
        k, d = self.num_outputs, self.num_features
        q = d + int(self.fit_intercept)
        N = torch.zeros(p, q, dtype=DTYPE)
        for j in range(d):
            N[torch.arange(k) * d + j, j] = 1.0
        if self.fit_intercept:
            N[k * d + torch.arange(k), d] = 1.0
        return N / math.sqrt(k)


# ------------------------------------------------------------------------------------ Newton


class NewtonConvergenceError(RuntimeError):
    """:func:`newton_fit` did not reach its tolerance (e.g. separable data with no prior)."""


class NotIdentifiableError(ValueError):
    """The objective is flat along some directions (softmax without a prior on the null space)."""


@dataclass(frozen=True)
class NewtonInfo:
    """What :func:`newton_fit` did.

    Attributes:
        iterations: Newton steps taken.
        gradient_norm: ‖∇f(θ)‖ at the returned θ.
        gradient_scale: the scale the tolerance is relative to,
            Σ_i |w_i| ‖p_i − e_{y_i}‖ ‖x̃_i‖ + ‖P(θ − m)‖ + ‖P‖₂(‖θ‖ + ‖m‖): the sum of the
            magnitudes of the gradient's terms (the last: P(θ − m) is no more accurate than θ), so that the rounding floor of ‖∇f‖ is about 1e-16 of it. (Relative to
            it, a separable data set never converges: its terms shrink but do not cancel.)
        newton_decrement_sq: λ² = ∇fᵀ(∇²f)⁻¹∇f at the last step computed.
        objective: f(θ) at the returned θ.
        halvings: total step halvings made by the line search.
    """

    iterations: int
    gradient_norm: float
    gradient_scale: float
    newton_decrement_sq: float
    objective: float
    halvings: int


def newton_fit(
    model: LogisticModel,
    X: Tensor,
    y: Tensor,
    *,
    prior_precision: Precision,
    prior_mean: Tensor | float | None = None,
    weights: Tensor | None = None,
    init: Tensor | None = None,
    max_iter: int = 100,
    gtol: float = 1.0e-12,
    decrement_tol: float = 1.0e-28,
    allow_singular: bool = False,
) -> tuple[Tensor, NewtonInfo]:
    """Minimise f(θ) = Σ_i w_i ℓ_i(θ) + ½‖θ − m‖²_P by damped Newton to machine precision.

    Each iteration solves (∇²ℓ̄(θ) + P) Δ = −∇f(θ) by Cholesky and backtracks (halving) from the
    full step until the Armijo condition f(θ + tΔ) ≤ f(θ) − 10⁻⁴ t λ² holds, λ² = −∇fᵀΔ the squared
    Newton decrement. When λ² is below 1e-10·(1 + |f|) the predicted decrease is at the rounding
    level of f, so the full step is taken (quadratic convergence region). It stops when
    ‖∇f(θ)‖ ≤ ``gtol``·scale (scale: see :class:`NewtonInfo`) or λ² ≤ ``decrement_tol``.

    ``prior_precision`` P is δ (δ·I), a diagonal or a p×p matrix; 0 gives the maximum-likelihood
    fit, which exists for the binary model when the data are not separable and X̃ has full
    column rank.

    The full softmax (K ≥ 3) is not identifiable when P vanishes on :meth:`LogisticModel.null_space`
    (e.g. P = 0): the minimiser is a whole affine subspace. Then ``allow_singular=False`` raises
    :class:`NotIdentifiableError`; ``allow_singular=True`` keeps every step orthogonal to the flat
    directions and so returns the minimiser closest to ``init`` (with ``init`` = 0: Σ_k W_k = 0 and
    Σ_k b_k = 0, the "sum-to-zero" parametrisation). Probabilities and differences of rows W_k − W_l
    are then unique.

    Returns:
        θ and a :class:`NewtonInfo`.

    Raises:
        NewtonConvergenceError: no convergence within ``max_iter`` steps, a failed line search,
            logits beyond ±500 while P is not positive definite (typically separable data with a
            zero prior) or a singular Hessian (e.g. rank-deficient X̃ with P = 0).
        NotIdentifiableError: see above.
    """
    X = model._check_X(X)
    n, p = X.shape[0], model.num_params
    w = model._weights(weights, n)
    P = precision_matrix(prior_precision, p)
    m = prior_mean_vector(prior_mean, p)
    theta = torch.zeros(p, dtype=DTYPE) if init is None else model._check_theta(init).clone()

    # Directions along which f is flat: the null space of the softmax not covered by P.
    basis: Tensor | None = None
    N = model.null_space()
    if N.shape[1] > 0:
        M = N.T @ P @ N
        evals, evecs = torch.linalg.eigh(0.5 * (M + M.T))
        flat = evals <= 1.0e-13 * float(torch.linalg.matrix_norm(P, ord=2))
        if bool(flat.any()):
            if not allow_singular:
                raise NotIdentifiableError(
                    f"{model} with this prior precision is not identifiable: the objective is "
                    f"flat along {int(flat.sum())} direction(s) that add one vector to every class "
                    "row. Give the prior positive precision there, or pass allow_singular=True to "
                    "get the minimiser closest to `init`."
                )
            D = N @ evecs[:, flat]  # orthonormal flat directions
            evals_c, evecs_c = torch.linalg.eigh(torch.eye(p, dtype=DTYPE) - D @ D.T)
            basis = evecs_c[:, evals_c > 0.5]  # orthonormal basis of their complement

    x_norms = torch.linalg.norm(X, dim=1)
    if model.fit_intercept:
        x_norms = torch.sqrt(x_norms**2 + 1.0)
    Y = model._targets(y, n)

    def objective(th: Tensor) -> float:
        r = th - m
        return float(model.loss(th, X, y, w) + 0.5 * r @ (P @ r))

    # With a PD prior the minimiser is finite, however large the logits along the way get.
    prior_is_pd = bool(torch.linalg.cholesky_ex(0.5 * (P + P.T))[1] == 0)
    prior_norm = float(torch.linalg.matrix_norm(P, 2))
    halvings = 0
    dec2 = float("inf")
    for iteration in range(max_iter + 1):
        z = model.logits(theta, X)
        if not prior_is_pd and z.numel() and float(z.abs().amax()) > 500.0:
            raise NewtonConvergenceError(
                f"logits beyond ±500 at iteration {iteration}: the data are probably separable "
                "(the minimiser is at infinity); add a positive prior precision"
            )
        R = model._residuals(z, Y)
        prior_grad = P @ (theta - m)
        g = model._pullback(R * w[:, None], X).sum(dim=0) + prior_grad
        gnorm = float(torch.linalg.norm(g))
        data_scale = float(torch.sum(w.abs() * torch.linalg.norm(R, dim=1) * x_norms))
        # P(θ − m) can be no more accurate than θ itself: ‖P‖·eps·(‖θ‖ + ‖m‖) is its floor
        prior_scale = float(torch.linalg.norm(prior_grad)) + prior_norm * (
            float(torch.linalg.norm(theta)) + float(torch.linalg.norm(m))
        )
        scale = data_scale + prior_scale
        f = objective(theta)
        if not math.isfinite(f) or not math.isfinite(gnorm):
            raise NewtonConvergenceError(
                f"non-finite objective or gradient at iteration {iteration}"
            )
        if gnorm <= gtol * scale or dec2 <= decrement_tol:
            return theta, NewtonInfo(iteration, gnorm, scale, dec2, f, halvings)
        if iteration == max_iter:
            break
        H = model.hessian(theta, X, weights=w) + P
        try:
            if basis is None:
                step = cholesky_solve(H, -g, what="Hessian of the Newton objective")
            else:
                Hr = basis.T @ H @ basis
                step = basis @ cholesky_solve(Hr, -(basis.T @ g), what="reduced Hessian")
        except NotPositiveDefiniteError as err:
            raise NewtonConvergenceError(
                f"singular Hessian at iteration {iteration}: X̃ may be rank-deficient or the data "
                f"separable; add a positive prior precision ({err})"
            ) from err
        dec2 = float(-(g @ step))
        t = 1.0
        if dec2 > 1.0e-10 * (1.0 + abs(f)):
            while objective(theta + t * step) > f - 1.0e-4 * t * dec2:
                t *= 0.5
                halvings += 1
                if t < 1.0e-12:
                    raise NewtonConvergenceError(
                        f"line search failed at iteration {iteration} (gradient norm {gnorm:.3e}, "
                        f"Newton decrement² {dec2:.3e}); the problem may be badly conditioned"
                    )
        theta = theta + t * step
    raise NewtonConvergenceError(
        f"no convergence in {max_iter} Newton steps: gradient norm {gnorm:.3e} > "
        f"{gtol:.1e} × scale {scale:.3e}; the data may be (quasi-)separable or the Hessian "
        "ill-conditioned; add a prior precision or raise max_iter"
    )


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
