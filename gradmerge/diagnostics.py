"""Diagnostics: the gradient mismatch of Eq. 2, which is the error of every merge rule.

Eq. 2 is exact for any loss, given the stationarity conditions of θ_t and θ_{1:T}:

    θ_{1:T} = θ_TA − Σ_t α_t H_0⁻¹ [∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t)],

so a merge θ is good for task t when Δ_t(θ) = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t) is small.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import Curvature
from gradmerge.errors import ArgumentError
from gradmerge.merge.inputs import CurvatureLike, checked_alphas, checked_curvature, task_vector
from gradmerge.params import Params

GradientFn = Callable[[Params], Params]
"""θ ↦ ∇ℓ̄_t(θ): the gradient of task t's loss (a SUM over its examples)."""


@dataclass(frozen=True)
class GradientMismatch:
    """The gradient mismatch of a candidate merge θ (Eq. 2).

    Attributes:
        per_task: Δ_t = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t), one dict per task.
        norms: ‖Δ_t‖₂ per task.
        correction: Σ_t α_t H_0⁻¹ Δ_t, the term Eq. 2 subtracts from task arithmetic (``None``
            when no prior was given). At the exact target, θ_{1:T} = θ_TA − correction.
    """

    per_task: list[dict[str, Tensor]]
    norms: list[float]
    correction: dict[str, Tensor] | None

    @property
    def total(self) -> float:
        """‖Σ_t α-free Δ_t‖ summed over tasks: Σ_t ‖Δ_t‖₂."""
        return sum(self.norms)


def gradient_mismatch(
    theta: Params,
    finetuned: Sequence[Params],
    gradients: Sequence[GradientFn],
    *,
    alphas: float | Sequence[float] = 1.0,
    prior: CurvatureLike | None = None,
) -> GradientMismatch:
    """The gradient mismatch Δ_t(θ) = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t) of a candidate merge θ (Eq. 2).

    Args:
        theta: the candidate merge.
        finetuned: θ_1, …, θ_T.
        gradients: one function θ ↦ ∇ℓ̄_t(θ) per task.
        alphas: α_t (used for the correction term).
        prior: H_0; when given, the correction Σ_t α_t H_0⁻¹ Δ_t is computed too.

    Example:
        >>> import torch, gradmerge as gm
        >>> grad = lambda p: {"w": 2 * (p["w"] - 1.0)}   # ℓ̄(θ) = ‖θ − 1‖²
        >>> gm.gradient_mismatch({"w": torch.zeros(1)}, [{"w": torch.ones(1)}], [grad]).norms
        [2.0]
    """
    tasks = len(finetuned)
    if len(gradients) != tasks:
        raise ArgumentError(
            f"got {tasks} fine-tuned models but {len(gradients)} gradient functions"
        )
    weights = checked_alphas(alphas, tasks)
    P.check_params(theta, name="theta")
    per_task = []
    for t, (ft, grad) in enumerate(zip(finetuned, gradients, strict=True)):
        task_vector(theta, ft, name=f"finetuned[{t}]")
        g_theta, g_t = grad(theta), grad(ft)
        for which, g in (("theta", g_theta), (f"finetuned[{t}]", g_t)):
            P.check_params(g, name=f"gradients[{t}]({which})")
            P.check_compatible(theta, g, ref_name="theta", name=f"gradients[{t}]({which})")
        per_task.append(P.sub(g_theta, g_t))
    correction = None
    if prior is not None:
        h0: Curvature = checked_curvature(prior, theta, name="prior")
        total = P.zeros_like(theta)
        for alpha, delta in zip(weights, per_task, strict=True):
            total = P.axpy(alpha, delta, total)
        correction = h0.solve(total)
    return GradientMismatch(per_task, [P.norm(d) for d in per_task], correction)
