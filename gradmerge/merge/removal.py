"""Removing data from a model: Eq. 13 by gradient matching, and Koh & Liang's influence step.

:func:`remove` is θ_\\t = θ_LLM − α_t H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM): one fused elementwise
pass (:mod:`gradmerge.elementwise.removal`) where every curvature is diagonal or δ·I, the
operator algebra otherwise; :func:`influence_remove` is θ_\\t = θ_LLM + α_t H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM)
(Sec. 1.4).

Example:
    >>> import torch
    >>> from gradmerge.merge.removal import influence_remove
    >>> influence_remove({"w": torch.tensor([1.0])}, {"w": torch.tensor([-2.0])}, remaining=4.0)
    {'w': tensor([0.5000])}
"""

from __future__ import annotations

from typing import NoReturn

from torch import Tensor

from gradmerge import params as P
from gradmerge.elementwise import matching as elementwise_matching
from gradmerge.elementwise import removal as elementwise_removal
from gradmerge.merge.inputs import (
    CurvatureLike,
    checked_alphas,
    checked_curvature,
    dtype_of,
    refuse_removed,
    task_vector,
)
from gradmerge.merge.matching import Merged, reports, solve
from gradmerge.params import Params
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import Solver


def remove(
    base: Params,
    finetuned: Params,
    curvature: CurvatureLike,
    *,
    remaining: CurvatureLike,
    prior: CurvatureLike,
    alpha: float = 1.0,
    solver: Solver | None = None,
    **removed: NoReturn,
) -> dict[str, Tensor]:
    r"""Remove data (or a task) D_t from a model by gradient matching (Eq. 13).

    .. math::

        \hat\theta_{\setminus t} = \theta_{LLM}
            - \alpha_t \bar H_{\setminus t}^{-1} (H_0 + H_t)(\theta_t - \theta_{LLM}),

    where θ_t was fine-tuned on D_t from θ_LLM with prior precision H_0 (Eq. 15), H_t is the
    curvature of D_t, and α_t the weight D_t had in θ_LLM's training loss (Eq. 9). Exact for
    linear regression, where it reproduces Cook's formula (Eq. 14–16).

    Args:
        base: θ_LLM, trained on all data including D_t.
        finetuned: θ_t.
        curvature: H_t (SUM over D_t's examples), or a float (δ·I).
        remaining: H̄_\t = δI + ∇²ℓ̄_\t(θ_LLM), the curvature at ``base`` of the data that stays,
            INCLUDING the base model's own regulariser δ·I (``C_remaining + delta``).
        prior: H_0 used when fine-tuning θ_t.
        alpha: α_t.
        solver: the solver object of H̄_\t x = rhs where it is iterative
            (:class:`gradmerge.KroneckerCG` for K-FAC, :class:`gradmerge.CG` for sums and
            matrix-free operators); ``None``: their defaults.

    Returns:
        The parameters without D_t; ``gm.with_solution(gm.remove, ...)`` returns them in a
        :class:`Merged` with the solve's report (the elementwise path: what its pass measured).

    Example:
        >>> import torch, gradmerge as gm
        >>> base, ft = {"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}
        >>> gm.remove(base, ft, gm.Diagonal({"w": torch.tensor([1.0])}), remaining=4.0, prior=1.0)
        {'w': tensor([0.5000])}
    """
    return _remove(
        base,
        finetuned,
        curvature,
        remaining=remaining,
        prior=prior,
        alpha=alpha,
        solver=solver,
        **removed,
    ).params


@reports(remove)
def _remove(
    base: Params,
    finetuned: Params,
    curvature: CurvatureLike,
    *,
    remaining: CurvatureLike,
    prior: CurvatureLike,
    alpha: float = 1.0,
    solver: Solver | None = None,
    **removed: NoReturn,
) -> Merged:
    """:func:`remove` with the solve's report (its arguments, checked here)."""
    refuse_removed("remove", removed)
    P.check_params(base, name="base", finite=False)
    base, finetuned = P.detached(base), P.detached(finetuned)
    (weight,) = checked_alphas([alpha], 1, dtype=dtype_of(base), name="alpha")
    fast = _remove_elementwise(base, finetuned, (prior, curvature, remaining), weight)
    if fast is not None:  # an elementwise division: exact; the pass measured the step
        out, stats = fast
        report = Solution(
            {}, "exact (elementwise, fused with the removal)", measured=stats.as_dict()
        )
        return Merged(out, report)
    P.check_params(base, name="base")
    tau = task_vector(base, finetuned, name="finetuned")
    h0 = checked_curvature(prior, base, name="prior")
    ht = checked_curvature(curvature, base, name="curvature")
    rest = checked_curvature(remaining, base, name="remaining")
    correction, report = solve(rest, P.add(h0.mv(tau), ht.mv(tau)), solver)
    result = P.axpy(-weight, correction, base)  # Eq. 13
    P.check_result_finite(result, what="removal result", alphas=[weight], small="remaining")
    return Merged(result, report)


def _remove_elementwise(
    base: Params,
    finetuned: Params,
    curvatures: tuple[CurvatureLike, CurvatureLike, CurvatureLike],
    alpha: float,
) -> tuple[dict[str, Tensor], elementwise_removal.RemovalStats] | None:
    """Eq. 13 in one fused pass (:mod:`gradmerge.elementwise.removal`) when every curvature —
    ``(prior, curvature, remaining)`` — is diagonal or δ·I, with what the pass measured; None
    otherwise, or when a value check fails (the generic path then names the cause)."""
    P.check_params(finetuned, name="finetuned", finite=False)
    P.check_compatible(base, finetuned, ref_name="base", name="finetuned")
    terms = []
    for value, name in zip(curvatures, ("prior", "curvature", "remaining"), strict=True):
        c = checked_curvature(value, base, name=name, psd=False)
        part = elementwise_matching.parts(c)
        if part is None:
            return None
        terms.append(part)
    return elementwise_removal.remove(base, finetuned, *terms, alpha=alpha)


def influence_remove(
    base: Params,
    gradient: Params,
    *,
    remaining: CurvatureLike,
    alpha: float = 1.0,
    solver: Solver | None = None,
    **removed: NoReturn,
) -> dict[str, Tensor]:
    r"""Remove data D_t with the influence-function step of Koh & Liang (2017) (Sec. 1.4).

    .. math::

        \hat\theta_{\setminus t} = \theta_{LLM} + \alpha_t \bar H_{\setminus t}^{-1} g_t,
        \qquad g_t = \nabla \bar\ell_t(\theta_{LLM}).

    The appendix prints it without α_t (the case α_t = 1); the α_t follows from Eq. 11 without
    the Taylor step of Eq. 12 (see theory/ERRATA.md). Exact for linear regression. ``solver`` and
    :func:`with_solution` as for :func:`remove`.

    Example:
        >>> import torch, gradmerge as gm
        >>> gm.influence_remove({"w": torch.tensor([1.0])}, {"w": torch.tensor([-2.0])}, remaining=4.0)
        {'w': tensor([0.5000])}
    """
    return _influence_remove(
        base, gradient, remaining=remaining, alpha=alpha, solver=solver, **removed
    ).params


@reports(influence_remove)
def _influence_remove(
    base: Params,
    gradient: Params,
    *,
    remaining: CurvatureLike,
    alpha: float = 1.0,
    solver: Solver | None = None,
    **removed: NoReturn,
) -> Merged:
    """:func:`influence_remove` with the solve's report (its arguments, checked here)."""
    refuse_removed("influence_remove", removed)
    P.check_params(base, name="base")
    P.check_params(gradient, name="gradient")
    P.check_compatible(base, gradient, ref_name="base", name="gradient")
    base, gradient = P.detached(base), P.detached(gradient)
    (weight,) = checked_alphas([alpha], 1, dtype=dtype_of(base), name="alpha")
    rest = checked_curvature(remaining, base, name="remaining")
    x, report = solve(rest, gradient, solver)
    result = P.axpy(weight, x, base)
    P.check_result_finite(result, what="removal result", alphas=[weight], small="remaining")
    return Merged(result, report)
