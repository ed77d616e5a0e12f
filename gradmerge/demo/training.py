r"""Training in the demo: every model is a MAP estimate, found by Newton's method to convergence.

Every model of the demo minimises a weighted sum of task losses and a Gaussian prior,

.. math::

    F(\theta) = \sum_j w_j \bar\ell_j(\theta) + \tfrac{\delta}{2}\lVert\theta - \mu\rVert^2,
    \qquad \bar\ell_j(\theta) = \sum_{i \in D_j} -\log p(y_i \mid x_i, \theta),

with ℓ̄_j a SUM over the examples of D_j (the paper's ℓ̄, matching the curvatures):

- the base model θ_LLM: w = 1 on the original images, μ = 0;
- a fine-tune θ_t (Eq. 15 with H_0 = δI): w = 1 on D_t, μ = θ_LLM;
- the multi-task target θ_{1:T} (the model Eq. 6 approximates): w_t = α_t on every D_t, μ = θ_LLM.

:func:`fit_map` first runs full-batch L-BFGS (cheap steps) until ‖∇F‖_∞ ≤ ``warm_gtol``, then
damped Newton: the exact Hessian ∇²F = δI + Σ_j w_j ∇²ℓ̄_j (:meth:`gradmerge.demo.mlp.MLP.hessian`),
shifted by a multiple of I when it is not positive definite, and a backtracking (Armijo) line
search on F. Near a minimum the shift is 0 and the step 1: quadratic convergence (two or three
Newton steps), so "converged" means ‖∇F‖_∞ ≤ ``gtol`` = 1e-9, a measured statement (the
results record every fit's final ‖∇F‖_∞). Deterministic for a given device.

Example:
    >>> from gradmerge.demo.data import make_splits
    >>> from gradmerge.demo.mlp import MLP
    >>> from gradmerge.demo.training import fit_map
    >>> splits = make_splits(("rotated",), n_base=60, n_train=20, n_test=20, seed=0)
    >>> mlp = MLP(hidden=4)
    >>> fit = fit_map(mlp, [(splits.base.train, 1.0)], init=mlp.init(seed=0), delta=1.0)
    >>> fit.converged, fit.grad_norm <= 1e-9
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge.demo.data import Split
from gradmerge.demo.mlp import MLP
from gradmerge.errors import ArgumentError, NonFiniteError
from gradmerge.params import Params

GTOL = 1e-9
"""Convergence tolerance: the max-norm of ∇F."""


@dataclass(frozen=True)
class Fit:
    """The result of :func:`fit_map`.

    Attributes:
        theta: θ⋆ (flat, in the MLP's parameter order).
        objective: F(θ⋆).
        grad_norm: ‖∇F(θ⋆)‖_∞.
        iterations: Newton steps taken.
        converged: ``grad_norm <= gtol``.
    """

    theta: Tensor
    objective: float
    grad_norm: float
    iterations: int
    converged: bool

    def summary(self) -> dict[str, float | int | bool]:
        """The convergence record written to results.json."""
        return {
            "objective": self.objective,
            "grad_norm": self.grad_norm,
            "newton_steps": self.iterations,
            "converged": self.converged,
        }


def stack(data: Sequence[tuple[Split, float]]) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate ``(split, w_j)`` pairs into inputs, labels and per-example weights."""
    kept = [(s, w) for s, w in data if w != 0.0]
    if not kept:
        raise ArgumentError(
            f"fit_map needs at least one (split, weight) pair with a nonzero weight, got "
            f"weights {[w for _, w in data]}"
        )
    x = torch.cat([s.x for s, _ in kept])
    y = torch.cat([s.y for s, _ in kept])
    w = torch.cat(
        [torch.full((len(s),), float(w), dtype=x.dtype, device=x.device) for s, w in kept]
    )
    return x, y, w


def objective_fn(
    mlp: MLP,
    data: Sequence[tuple[Split, float]],
    *,
    delta: float,
    prior_mean: Tensor | None = None,
) -> Callable[[Tensor], Tensor]:
    """θ ↦ F(θ) = Σ_j w_j ℓ̄_j(θ) + (δ/2)‖θ − μ‖² (μ = 0 when ``prior_mean`` is None)."""
    x, y, w = stack(data)

    def objective(theta: Tensor) -> Tensor:
        diff = theta if prior_mean is None else theta - prior_mean
        return (w * mlp.losses(theta, x, y)).sum() + 0.5 * delta * diff.square().sum()

    return objective


def fit_map(
    mlp: MLP,
    data: Sequence[tuple[Split, float]],
    *,
    init: Tensor,
    delta: float,
    prior_mean: Tensor | None = None,
    gtol: float = GTOL,
    max_iter: int = 100,
    warm_gtol: float = 1e-2,
    max_lbfgs: int = 3000,
) -> Fit:
    """Minimise F(θ) = Σ_j w_j ℓ̄_j(θ) + (δ/2)‖θ − μ‖² from ``init`` by damped Newton.

    Args:
        mlp: the architecture.
        data: ``(split, w_j)`` pairs (splits on θ's device).
        init: the starting point θ⁰ (flat).
        delta: δ > 0, the prior precision.
        prior_mean: μ (None: 0).
        gtol: stop when ‖∇F‖_∞ ≤ gtol.
        max_iter: the most Newton steps.
    """
    objective = objective_fn(mlp, data, delta=delta, prior_mean=prior_mean)
    x, y, w = stack(data)
    eye = torch.eye(init.numel(), dtype=init.dtype, device=init.device)
    theta = _lbfgs(objective, init, gtol=warm_gtol, max_iter=max_lbfgs)
    value, grad = _value_and_grad(objective, theta)
    steps = 0
    while float(grad.abs().max()) > gtol and steps < max_iter:
        hessian = mlp.hessian(theta, x, y, w) + delta * eye
        factor = _shifted_cholesky(hessian, eye, scale=delta)
        direction = -torch.cholesky_solve(grad[:, None], factor)[:, 0]  # −(∇²F)⁻¹∇F
        slope = float(grad @ direction)
        # F's rounding level: near the minimum a Newton step changes F by less than this, and
        # must still be taken (it is what reduces ‖∇F‖ from 1e-8 to 1e-15)
        floor = 64 * torch.finfo(theta.dtype).eps * max(1.0, abs(value))
        size = 1.0
        for _ in range(60):  # Armijo backtracking
            trial = theta + size * direction
            trial_value = float(objective(trial))
            if trial_value <= value + 1e-4 * size * slope + floor:
                break
            size /= 2
        else:
            break  # no decrease along a descent direction: at the precision floor
        theta = trial
        value, grad = _value_and_grad(objective, theta)
        steps += 1
    grad_norm = float(grad.abs().max())
    return Fit(theta, value, grad_norm, steps, grad_norm <= gtol)


def gradient_fn(mlp: MLP, data: Split) -> Callable[[Params], dict[str, Tensor]]:
    """θ ↦ ∇ℓ̄(θ) on ``data`` (a SUM over its examples), over parameter dicts (Eq. 2's ∇ℓ̄_t)."""

    def gradient(params: Params) -> dict[str, Tensor]:
        theta = mlp.flat(params).detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(mlp.losses(theta, data.x, data.y).sum(), theta)
        return mlp.params(grad)

    return gradient


def accuracy(mlp: MLP, theta: Tensor, data: Split) -> float:
    """The fraction of ``data`` that θ classifies correctly."""
    with torch.no_grad():
        return float((mlp.logits(theta, data.x).argmax(dim=1) == data.y).double().mean())


def _lbfgs(
    objective: Callable[[Tensor], Tensor], init: Tensor, *, gtol: float, max_iter: int
) -> Tensor:
    """L-BFGS (strong Wolfe) from ``init`` until ‖∇F‖_∞ ≤ gtol: the cheap way near a minimum."""
    theta = init.detach().clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [theta],
        lr=1.0,
        max_iter=max_iter,
        max_eval=2 * max_iter,
        tolerance_grad=gtol,
        tolerance_change=0.0,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        value = objective(theta)
        value.backward()
        return value

    optimizer.step(closure)
    return theta.detach()


def _value_and_grad(objective: Callable[[Tensor], Tensor], theta: Tensor) -> tuple[float, Tensor]:
    leaf = theta.detach().requires_grad_(True)
    value = objective(leaf)
    (grad,) = torch.autograd.grad(value, leaf)
    return float(value.detach()), grad


def _shifted_cholesky(hessian: Tensor, eye: Tensor, *, scale: float) -> Tensor:
    """Cholesky factor of H + τI with the smallest τ ∈ {0, scale·10⁻³·2^k} that is SPD.

    Raises:
        NonFiniteError: H has a NaN or an infinity (no shift makes it SPD).
    """
    if not bool(torch.isfinite(hessian).all()):
        raise NonFiniteError(
            "the Hessian of the training objective is not finite: the fit diverged. Check the "
            "data for NaNs or infinities, or raise delta (a stronger prior)"
        )
    shift = 0.0
    while True:
        factor, info = torch.linalg.cholesky_ex(hessian + shift * eye if shift else hessian)
        if int(info) == 0:
            return factor
        shift = max(2 * shift, 1e-3 * scale)
