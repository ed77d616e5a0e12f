"""Iterative refinement of a merge towards the exact multi-task MAP (the appendix's Sec. 1.5).

:func:`refine` takes damped Newton (or, with fixed curvatures, quasi-Newton) steps on the
multi-task objective from a merge θ^0, backtracking on the stationarity residual; ``gradmerge
refine`` (:mod:`gradmerge.jobs.refine`) runs it on models and data.

Example:
    >>> import torch
    >>> from gradmerge.merge.refinement import refine
    >>> base = {"w": torch.zeros(1)}
    >>> grads = [lambda th: {"w": th["w"] - 1.0}, lambda th: {"w": 3 * (th["w"] - 2.0)}]
    >>> refine(base, base, grads, [1.0, 3.0], prior=0.0)[0]["w"]  # quadratic: one exact step
    tensor([1.7500])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import Curvature
from gradmerge.errors import ArgumentError, NonFiniteError
from gradmerge.merge.inputs import CurvatureLike, checked_alphas, checked_curvature
from gradmerge.params import Params
from gradmerge.solvers.spec import Solver

MAX_BACKTRACKING = 30
"""Trial points per refinement step by default (:func:`refine`'s ``max_backtracking``, the
``refine`` YAML key of that name): step sizes 1, ½, …, 2^−29."""


def refine(
    theta: Params,
    base: Params,
    gradients: Sequence[Callable[[Params], Params]],
    curvatures: Sequence[CurvatureLike | Callable[[Params], CurvatureLike]],
    *,
    prior: CurvatureLike,
    alphas: float | Sequence[float] = 1.0,
    steps: int = 1,
    solver: Solver | None = None,
    max_backtracking: int = MAX_BACKTRACKING,
) -> list[dict[str, Tensor]]:
    r"""Iterative refinement of a merge towards the exact multi-task MAP (Sec. 1.5, future work).

    The appendix proposes to "take a few optimization steps aiming for the MAP estimate of the
    exact posterior, and then use the current iterate for the Taylor approximation in Eq. 2".
    Expanding each ∇ℓ̄_t around the current iterate θ^k instead of θ_t, the stationarity
    condition H_0(θ − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ) = 0 of θ_{1:T} becomes

    .. math::

        \theta^{k+1} = \theta^k - \big(H_0 + \sum_t \alpha_t H_t^k\big)^{-1}
            \Big[H_0(\theta^k - \theta_{LLM}) + \sum_t \alpha_t \nabla\bar\ell_t(\theta^k)\Big],

    a Newton step on the multi-task objective, taken with backtracking on the norm of the
    stationarity residual R(θ) = H_0(θ − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ): with d = H̄⁻¹R, the trial
    points θ^k − 2^{−j} d, j = 0, 1, …, ``max_backtracking`` − 1, are tried in turn and the
    first with ‖R‖ < ‖R(θ^k)‖ is taken (a trial point where a gradient is not finite counts as
    no decrease; when none decreases ‖R‖ the step is not taken and θ^{k+1} = θ^k).

    Cost: each trial is one gradient evaluation per task (a pass over its data), so a run
    spends at most 1 + ``steps``·``max_backtracking`` of them per task (the first at θ^0).
    Simple decrease suffices as acceptance test: where H̄ is the Jacobian of R (recomputed
    curvature), −d is a descent direction of ½‖R‖² with slope −‖R‖², so small steps
    decrease ‖R‖ by about t‖R‖ and an Armijo test ‖R(θ − t d)‖² ≤ (1 − 2ct)‖R‖² accepts
    the same trials for any small c; where H̄ is fixed (quasi-Newton) d may not descend at
    all, and it is then the bound on trials, not the test, that limits the cost. A non-finite
    gradient at θ^0 itself is an error. With curvatures recomputed at θ^k (pass
    callables θ ↦ H_t(θ)) it is damped Newton, which converges quadratically near θ_{1:T}; with
    fixed H_t (e.g. at θ_t) a quasi-Newton iteration. Start from θ^0 = :func:`gradient_matching`.

    Args:
        theta: θ^0, the starting merge.
        base: θ_LLM.
        gradients: θ ↦ ∇ℓ̄_t(θ), one per task (needs the tasks' data or a model of it).
        curvatures: H_t, or callables θ ↦ H_t(θ) evaluated at every iterate. They need not be
            PSD (exact Hessians of non-convex losses are not); H̄ must be positive definite.
        prior: H_0.
        alphas: α_t.
        steps: how many steps.
        solver: the solver object of each step's H̄ solve where it is iterative, passed to it
            (:class:`gradmerge.KroneckerCG` for K-FAC, :class:`gradmerge.CG` for sums and
            matrix-free operators); ``None``: their defaults.
        max_backtracking: trial points per step, at least 1 (1: the full step or none).

    Returns:
        The iterates θ^1, …, θ^steps.
    """
    tasks = len(gradients)
    if len(curvatures) != tasks:
        raise ArgumentError(f"got {tasks} gradient functions but {len(curvatures)} curvatures")
    if steps < 1:
        raise ArgumentError(f"steps must be at least 1, got {steps}")
    if isinstance(max_backtracking, bool) or not isinstance(max_backtracking, int):
        raise ArgumentError(f"max_backtracking must be an integer, got {max_backtracking!r}")
    if max_backtracking < 1:
        raise ArgumentError(
            f"max_backtracking must be at least 1 (trial points per step), got {max_backtracking}"
        )
    weights = checked_alphas(alphas, tasks)
    P.check_params(base, name="base")
    P.check_params(theta, name="theta")
    P.check_compatible(base, theta, ref_name="base", name="theta")
    h0 = checked_curvature(prior, base, name="prior")

    def stationarity(point: Params) -> dict[str, Tensor]:
        """R(θ) = H_0(θ − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ), zero at θ_{1:T}."""
        out = h0.mv(P.sub(point, base))
        for t, (alpha, grad) in enumerate(zip(weights, gradients, strict=True)):
            g = grad(point)
            P.check_params(g, name=f"gradients[{t}](theta)")
            P.check_compatible(base, g, ref_name="base", name=f"gradients[{t}](theta)")
            out = P.axpy(alpha, g, out)
        return out

    iterates = []
    current = dict(theta)
    residual = stationarity(current)
    for _ in range(steps):
        precision: Curvature = h0
        for t, (alpha, h) in enumerate(zip(weights, curvatures, strict=True)):
            h_t = h(current) if callable(h) else h
            # a Newton step needs H̄ positive definite, not each H_t: a task Hessian of a
            # non-convex loss may be indefinite (H̄'s solve refuses an indefinite sum)
            h_t = checked_curvature(h_t, base, name=f"curvatures[{t}]", psd=False)
            precision = precision + alpha * h_t
        direction = precision.solve_info(residual, solver).value
        # backtracking on ‖R‖, which a Newton direction decreases: far from θ_{1:T} a full step
        # can overshoot (the expansion is local)
        size, norm = 1.0, P.norm(residual)
        for _trial in range(max_backtracking):
            trial = P.axpy(-size, direction, current)
            try:
                trial_residual = stationarity(trial)
            except NonFiniteError:  # the step left the region where the loss is finite
                size /= 2
                continue
            if P.norm(trial_residual) < norm:
                break
            size /= 2
        else:  # no decrease: at the precision floor, or not a descent direction
            iterates.append(current)
            continue
        current, residual = trial, trial_residual
        iterates.append(current)
    return iterates
