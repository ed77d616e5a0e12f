"""Shared helpers of the exact reference models in :mod:`gradmerge.theory.linear` and
:mod:`gradmerge.theory.logistic`.

Everything here works in ``torch.float64`` on flat parameter vectors θ ∈ R^p and is deterministic
given a ``torch.Generator``. The helpers build the random ingredients of the merge and removal
problems (features with a controlled condition number, SPD matrices with a controlled condition
number), turn the ways a caller may specify a prior precision into a matrix, and solve SPD systems
by Cholesky with a clear error when the matrix is not positive definite.

Notation (paper → code): θ_LLM → ``theta_llm``, θ_t → ``finetuned(t)``, H_0 → ``prior_precision``,
H_t → ``hessian(t)`` (a SUM over the examples of task t), α_t → ``alphas``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

DTYPE = torch.float64

#: What a prior precision may be: a number δ (meaning δ·I), a 1-D tensor (a diagonal) or a p×p
#: symmetric positive (semi-)definite matrix.
PrecisionLike = float | int | Tensor


class NotPositiveDefiniteError(ValueError):
    """A linear system that must be solved by Cholesky is not (numerically) positive definite."""


def as_float64(x: Tensor | Sequence[float] | float) -> Tensor:
    """``x`` as a ``torch.float64`` tensor (no copy when it already is one)."""
    return torch.as_tensor(x, dtype=DTYPE)


def precision_matrix(precision: PrecisionLike, p: int) -> Tensor:
    """The p×p matrix of a prior precision given as δ (δ·I), a diagonal (1-D) or a matrix (2-D)."""
    if isinstance(precision, (int, float)):
        return float(precision) * torch.eye(p, dtype=DTYPE)
    P = as_float64(precision)
    if P.ndim == 0:
        return P * torch.eye(p, dtype=DTYPE)
    if P.ndim == 1:
        if P.shape != (p,):
            raise ValueError(
                f"diagonal prior precision must have shape ({p},), got {tuple(P.shape)}"
            )
        return torch.diag(P)
    if P.shape != (p, p):
        raise ValueError(f"prior precision must have shape ({p}, {p}), got {tuple(P.shape)}")
    return P


def prior_mean_vector(mean: Tensor | float | None, p: int) -> Tensor:
    """The prior mean m ∈ R^p: ``None`` means 0, a number c means c·1."""
    if mean is None:
        return torch.zeros(p, dtype=DTYPE)
    m = as_float64(mean)
    if m.ndim == 0:
        return m * torch.ones(p, dtype=DTYPE)
    if m.shape != (p,):
        raise ValueError(f"prior mean must have shape ({p},), got {tuple(m.shape)}")
    return m


def cholesky_solve(A: Tensor, b: Tensor, *, what: str = "system matrix") -> Tensor:
    """Solve A x = b for symmetric positive definite A by Cholesky (A = L Lᵀ).

    Raises:
        NotPositiveDefiniteError: when the factorisation fails; the message names ``what``.
    """
    A = 0.5 * (A + A.T)
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) != 0:
        raise NotPositiveDefiniteError(
            f"{what} ({A.shape[0]}×{A.shape[0]}) is not positive definite (Cholesky failed at "
            f"minor {int(info)}); add a positive prior precision or more data"
        )
    if b.ndim == 1:
        return torch.cholesky_solve(b[:, None], L)[:, 0]
    return torch.cholesky_solve(b, L)


def normalise_alphas(alphas: float | Sequence[float] | Tensor, num_tasks: int) -> Tensor:
    """α as a length-T float64 tensor; a single number is used for every task."""
    a = as_float64(alphas)
    if a.ndim == 0:
        return a.repeat(num_tasks)
    if a.shape != (num_tasks,):
        raise ValueError(f"need one alpha per task ({num_tasks}), got shape {tuple(a.shape)}")
    return a


def log_spaced(condition: float, size: int) -> Tensor:
    """``size`` numbers log-spaced from 1 down to 1/condition (just ``[1.]`` when size == 1)."""
    if condition < 1.0:
        raise ValueError(f"a condition number is >= 1, got {condition}")
    if size == 1:
        return torch.ones(1, dtype=DTYPE)
    return torch.logspace(0.0, -math.log10(condition), size, dtype=DTYPE)


def random_orthogonal(d: int, generator: torch.Generator) -> Tensor:
    """A Haar-distributed random d×d orthogonal matrix (QR of a Gaussian with sign fix)."""
    G = torch.randn(d, d, generator=generator, dtype=DTYPE)
    Q, R = torch.linalg.qr(G)
    return Q * torch.sign(torch.diagonal(R))[None, :]


def random_spd(d: int, *, condition: float, scale: float, generator: torch.Generator) -> Tensor:
    """A random SPD matrix V diag(λ) Vᵀ with Haar V and λ log-spaced from ``scale`` down to
    ``scale / condition``, so its 2-norm is ``scale`` and its condition number is ``condition``."""
    V = random_orthogonal(d, generator)
    lam = scale * log_spaced(condition, d)
    S = (V * lam[None, :]) @ V.T
    return 0.5 * (S + S.T)


def feature_scales(d: int, condition: float) -> Tensor:
    """Scales s with s_max/s_min = √condition: diag(s²) has condition number ``condition``."""
    return log_spaced(condition, d).sqrt()


def random_features(
    n: int,
    scales: Tensor,
    rotation: Tensor,
    generator: torch.Generator,
    *,
    mean: Tensor | None = None,
) -> Tensor:
    """Rows x_i = Qdiag(s) z_i (+ mean) with z_i ~ N(0, I): X = Z diag(s) Qᵀ.

    The population covariance is Σ = Q diag(s²) Qᵀ, whose condition number is (s_max/s_min)².
    """
    Z = torch.randn(n, scales.shape[0], generator=generator, dtype=DTYPE)
    X = (Z * scales[None, :]) @ rotation.T
    if mean is not None:
        X = X + mean[None, :]
    return X


def perturbed_rotation(Q: Tensor, amount: float, generator: torch.Generator) -> Tensor:
    """An orthogonal matrix near Q: the Q factor of Q + amount·G (G Gaussian); Q itself at 0."""
    if amount == 0.0:
        return Q
    G = torch.randn(Q.shape, generator=generator, dtype=DTYPE)
    Qn, R = torch.linalg.qr(Q + amount * G)
    return Qn * torch.sign(torch.diagonal(R))[None, :]


def relative_residual(residual: Tensor, *scales: Tensor) -> float:
    """‖residual‖ / (Σ ‖scale_k‖), the measure the tests compare with 1e-10."""
    denominator = sum(float(torch.linalg.norm(s)) for s in scales)
    return float(torch.linalg.norm(residual)) / max(denominator, torch.finfo(DTYPE).tiny)


def merged_precision(prior: Tensor, hessians: Sequence[Tensor], alphas: Tensor) -> Tensor:
    """H̄ = H_0 + Σ_t α_t H_t (Eq. 6)."""
    out = prior.clone()
    for a, h in zip(alphas, hessians, strict=True):
        out = out + a * h
    return out
