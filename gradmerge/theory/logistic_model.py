"""Exact logistic-regression reference model (binary and softmax) and its Newton fit.

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
    ∇²ℓ̄(θ) = Σ_i w_i J_iᵀ (diag(p_i) − p_i p_iᵀ) J_i
              (= Σ_i w_i (diag p_i − p_i p_iᵀ) ⊗ x̃_i x̃_iᵀ up to the ordering of the flat layout),
    F(θ)    = Σ_i w_i E_{y ~ p(·|x_i, θ)} [∇ℓ_i ∇ℓ_iᵀ]  (the true Fisher), which equals ∇²ℓ̄(θ)
              because the link is canonical. :meth:`LogisticModel.fisher` computes it as the
              expectation (an independent route), so tests can check the identity.

All tensors are ``torch.float64``.
The merge and removal problems built on this model are in :mod:`gradmerge.theory.logistic`,
which also re-exports this module's names (its public import path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge.theory.problems import (
    DTYPE,
    NotPositiveDefiniteError,
    PrecisionLike,
    as_float64,
    cholesky_solve,
    precision_matrix,
    prior_mean_vector,
)

__all__ = [
    "LogisticModel",
    "NewtonConvergenceError",
    "NewtonInfo",
    "NotIdentifiableError",
    "newton_fit",
]


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
            magnitudes of the gradient's terms (the last: P(θ − m) is no more accurate than θ), so
            that the rounding floor of ‖∇f‖ is about 1e-16 of it. (Relative to it, a separable data
            set never converges: its terms shrink but do not cancel.)
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
    prior_precision: PrecisionLike,
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
