"""Eq. 6, the uncertainty-based gradient-matching merge, and its special cases.

:func:`gradient_matching` is θ = θ_LLM + H̄⁻¹ Σ_t α_t (H_0 + H_t)(θ_t − θ_LLM) with
H̄ = H_0 + Σ_t α_t H_t, written once against the :class:`Curvature` interface: one fused
elementwise pass (:mod:`gradmerge.elementwise.matching`) where every curvature is diagonal or
δ·I, the operator algebra and its solve otherwise. :func:`task_arithmetic` (H_t = 0) and
:func:`fisher_average` (H_0 = 0) are that rule with those inputs. :class:`Merged` is what the
rules that solve a system return through :func:`gradmerge.merge.report.with_solution`.

Example:
    >>> import torch
    >>> from gradmerge.merge.matching import gradient_matching
    >>> gradient_matching({"w": torch.zeros(1)}, [{"w": torch.ones(1)}], [1.0], prior=1.0)
    {'w': tensor([1.])}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, ParamSpec, cast

from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import Curvature, ScaledIdentity
from gradmerge.elementwise import matching as elementwise_matching
from gradmerge.elementwise.matching import SELECTED, Kernel
from gradmerge.errors import ArgumentError
from gradmerge.merge.inputs import (
    CurvatureLike,
    checked_alphas,
    checked_curvature,
    dtype_of,
    negative_alphas_named,
    refuse_removed,
    task_vector,
)
from gradmerge.params import Params
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import KroneckerCG, Solver


@dataclass(frozen=True)
class Merged:
    """What a rule that solves a linear system returns through :func:`with_solution`.

    Attributes:
        params: the parameters the rule returns (merged, or with data removed).
        solution: the :class:`gradmerge.Solution` of its solve (H̄ x = rhs for Eq. 6, H̄_\\t x =
            rhs for removal): method, iterations, certified residual, success, per K-FAC layer
            in ``parts``; the elementwise paths solve exactly in the merge's own pass and report
            their method (and, for removal, what the pass measured) with an empty ``value``.
    """

    params: dict[str, Tensor]
    solution: Solution


_Args = ParamSpec("_Args")

SOLUTION = "__solution__"
"""The attribute of a public solving rule that holds its implementation with the report
(:func:`reports`), which :func:`gradmerge.with_solution` calls."""


def reports(
    rule: Callable[_Args, dict[str, Tensor]],
) -> Callable[[Callable[_Args, Merged]], Callable[_Args, Merged]]:
    """Declare the decorated function as ``rule`` with the report of its solve: the same
    parameters (checked by the type checker through the shared ``ParamSpec``), returning a
    :class:`Merged`; ``rule`` returns its ``params``. Each solving rule declares this where it
    is defined, so :func:`gradmerge.with_solution` needs no list of rules and no re-binding of
    arguments: it calls ``rule``'s implementation with the caller's arguments as they are.

    Example:
        >>> import torch, gradmerge as gm
        >>> getattr(gm.gradient_matching, SOLUTION).__name__
        '_gradient_matching'
    """

    def declare(solved: Callable[_Args, Merged]) -> Callable[_Args, Merged]:
        setattr(rule, SOLUTION, solved)
        return solved

    return declare


def task_arithmetic(
    base: Params,
    finetuned: Sequence[Params],
    *,
    alphas: float | Sequence[float] = 1.0,
    kernel: Kernel | None = SELECTED,
) -> dict[str, Tensor]:
    r"""Task arithmetic: θ_TA = θ_LLM + Σ_t α_t (θ_t − θ_LLM)  (Eq. 2, first term).

    Implemented as Eq. 6 with H_t = 0 and H_0 = I, which reduces to this closed form exactly
    (``kernel``: as in :func:`gradient_matching`).

    Example:
        >>> import torch, gradmerge as gm
        >>> base = {"w": torch.zeros(2)}
        >>> gm.task_arithmetic(base, [{"w": torch.ones(2)}, {"w": 3 * torch.ones(2)}], alphas=0.5)
        {'w': tensor([2., 2.])}
    """
    if len(finetuned) == 0:
        raise ArgumentError(
            "task_arithmetic needs at least one fine-tuned model, got none: pass "
            "finetuned=[θ_1, ...]"
        )
    zero = ScaledIdentity(0.0)
    return gradient_matching(
        base, finetuned, [zero] * len(finetuned), prior=1.0, alphas=alphas, kernel=kernel
    )


def fisher_average(
    finetuned: Sequence[Params],
    curvatures: Sequence[Curvature],
    *,
    alphas: float | Sequence[float] = 1.0,
    kernel: Kernel | None = SELECTED,
) -> dict[str, Tensor]:
    r"""Fisher-weighted averaging: θ = (Σ_t α_t H_t)⁻¹ Σ_t α_t H_t θ_t  (Matena & Raffel, 2022).

    Implemented as Eq. 6 with H_0 = 0 (and θ_LLM = 0, on which the result then does not depend;
    ``kernel``: as in :func:`gradient_matching`).
    Σ_t α_t H_t must be positive definite; with diagonal Fishers that have zero entries, damp them
    (``curvature + 1e-8``) or use :func:`gradient_matching` with a small prior.

    Example:
        >>> import torch, gradmerge as gm
        >>> F1, F2 = gm.Diagonal({"w": torch.tensor([1.0])}), gm.Diagonal({"w": torch.tensor([3.0])})
        >>> gm.fisher_average([{"w": torch.tensor([0.0])}, {"w": torch.tensor([4.0])}], [F1, F2])
        {'w': tensor([3.])}
    """
    if len(finetuned) == 0:
        raise ArgumentError("fisher_average needs at least one fine-tuned model, got none")
    origin = P.zeros_like(finetuned[0])
    return gradient_matching(origin, finetuned, curvatures, prior=0.0, alphas=alphas, kernel=kernel)


def gradient_matching(
    base: Params,
    finetuned: Sequence[Params],
    curvatures: Sequence[CurvatureLike],
    *,
    prior: CurvatureLike,
    alphas: float | Sequence[float] = 1.0,
    kernel: Kernel | None = SELECTED,
    solver: Solver | None = None,
    **removed: NoReturn,
) -> dict[str, Tensor]:
    r"""The uncertainty-based gradient-matching merge (Eq. 6).

    .. math::

        \hat\theta_{1:T} = \theta_{LLM}
            + \bar H^{-1} \sum_t \alpha_t (H_0 + H_t)(\theta_t - \theta_{LLM}),
        \qquad \bar H = H_0 + \sum_t \alpha_t H_t .

    It is exact (equals the multi-task MAP θ_{1:T}) when every loss is quadratic with Hessian
    H_t, and otherwise a first-order correction of task arithmetic for the gradient mismatch of
    Eq. 2.

    Where no model changed anything it returns the base, whatever the curvatures there: on a
    block g of parameters where every task vector τ_t = θ_t − θ_LLM is zero and that no
    curvature couples to the rest, the right-hand side Σ_t α_t (H_0 + H_t) τ_t is zero on g and
    H̄ is block diagonal across g, so θ_g = θ_LLM,g + H̄_gg⁻¹·0 = θ_LLM,g for any positive
    definite H̄_gg (always so with a δ·I prior, δ > 0); in floating point too, since every
    product with τ_g is an exact zero. This is why a LoRA adapter's curvature is needed only over
    the parameters it changes, and why the streaming merge copies such blocks from the base
    before any solve (:mod:`gradmerge.jobs.plan`), which also settles a singular H̄_gg (θ_LLM,g
    is then Eq. 6's minimum-norm solution, the limit δ → 0 of a δ·I prior).

    Args:
        base: θ_LLM.
        finetuned: θ_1, …, θ_T, each with the keys and shapes of ``base``.
        curvatures: H_1, …, H_T (SUM over each task's examples), or floats (δ·I).
        prior: H_0, the precision of the prior around ``base`` (a curvature, or a float δ: δ·I).
        alphas: one α for all tasks, or one per task.
        kernel: where every curvature is diagonal or δ·I, the evaluator of the elementwise
            merge. Default: the fastest certified one, as the streaming engine chooses it
            (:class:`gradmerge.elementwise.matching.Selected`: on a CPU the C loop of
            :mod:`gradmerge.kernels` for float32/float64 tensors of 4096 elements or more,
            bit-identical to the chunked pass and falling back to it wherever it cannot be built;
            ``gm.fused_kernels("off")`` or ``$GRADMERGE_FUSED=off`` turns it off, as for the
            engine). ``None``: the chunked torch pass of :mod:`gradmerge.elementwise.matching`
            alone, which compiles nothing. Or a :class:`gradmerge.kernels.Fused` (``Fused("on")``).
        solver: the solver object of H̄ x = rhs where it is iterative, passed to that solve:
            :class:`gradmerge.KroneckerCG` for K-FAC (its ``tol`` and ``maxiter`` also run the
            CG of sums), :class:`gradmerge.CG` for sums and matrix-free operators; ``None``:
            their defaults; direct solves use none. With ``KroneckerCG(warm_start=True)``,
            K-FAC layers may start from the task-arithmetic solution Σ_t α_t τ_t.

    Returns:
        The merged parameters, a new dict with the keys of ``base``. ``gm.with_solution(
        gm.gradient_matching, ...)`` returns them in a :class:`Merged` with the
        :class:`gradmerge.Solution` of H̄ x = rhs (per K-FAC layer: method, iterations,
        certified residual). The fused elementwise path (diagonal and δ·I curvatures) solves
        exactly in the same pass as the merge: its report has the method only and an empty
        ``value``.

    Raises:
        StructureError, DTypeError, DeviceError, NonFiniteError: inputs that do not fit together.
        NotPositiveDefiniteError: a curvature that is not PSD, or H̄ singular (add damping to H_0).
        ArgumentError: a wrong number of curvatures or alphas.

    Example:
        >>> import torch, gradmerge as gm
        >>> base = {"w": torch.zeros(2)}
        >>> fts = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}]
        >>> Hs = [gm.Diagonal({"w": torch.tensor([9.0, 0.0])}), gm.Diagonal({"w": torch.tensor([0.0, 9.0])})]
        >>> gm.gradient_matching(base, fts, Hs, prior=1.0)
        {'w': tensor([1., 1.])}
    """
    solved = _gradient_matching(
        base,
        finetuned,
        curvatures,
        prior=prior,
        alphas=alphas,
        kernel=kernel,
        solver=solver,
        **removed,
    )
    return solved.params


@reports(gradient_matching)
def _gradient_matching(
    base: Params,
    finetuned: Sequence[Params],
    curvatures: Sequence[CurvatureLike],
    *,
    prior: CurvatureLike,
    alphas: float | Sequence[float] = 1.0,
    kernel: Kernel | None = SELECTED,
    solver: Solver | None = None,
    **removed: NoReturn,
) -> Merged:
    """:func:`gradient_matching` with the solve's report (its arguments, checked here)."""
    refuse_removed("gradient_matching", removed)
    tasks = len(finetuned)
    if tasks == 0:
        raise ArgumentError("gradient_matching needs at least one fine-tuned model, got none")
    if len(curvatures) != tasks:
        raise ArgumentError(
            f"got {tasks} fine-tuned models but {len(curvatures)} curvatures: pass one per model"
        )
    P.check_params(base, name="base", finite=False)
    base, finetuned = P.detached(base), [P.detached(ft) for ft in finetuned]
    weights = checked_alphas(alphas, tasks, dtype=dtype_of(base))
    names = ["prior", *(f"curvatures[{t}]" for t in range(tasks))]
    h0, *hs = (
        checked_curvature(c, base, name=n, psd=False)
        for c, n in zip([prior, *curvatures], names, strict=True)
    )
    elementwise = [elementwise_matching.parts(h) for h in (h0, *hs)]
    with negative_alphas_named(weights):
        if all(part is not None for part in elementwise):  # diagonal / δ·I: one fused pass
            for t, ft in enumerate(finetuned):
                P.check_params(ft, name=f"finetuned[{t}]", finite=False)
                P.check_compatible(base, ft, ref_name="base", name=f"finetuned[{t}]")
            prior_part, *task_parts = cast(list[elementwise_matching.Part], elementwise)
            precisions = [h.coarsest_dtype for h in (h0, *hs)]
            merged = elementwise_matching.merge(
                base,
                finetuned,
                weights,
                prior_part,
                task_parts,
                names=names,
                precisions=precisions,
                kernel=kernel,
            )
            report = Solution({}, "exact (elementwise, fused with the merge)")
        else:
            merged, report = _generic_merge(base, finetuned, weights, h0, hs, names, solver)
    return Merged(merged, report)


def _generic_merge(
    base: Params,
    finetuned: Sequence[Params],
    weights: Sequence[float],
    h0: Curvature,
    hs: Sequence[Curvature],
    names: Sequence[str],
    solver: Solver | None,
) -> tuple[dict[str, Tensor], Solution]:
    """Eq. 6 through the operator algebra (any structure); inputs checked here."""
    P.check_finite(base, name="base")
    task_vectors = [task_vector(base, ft, name=f"finetuned[{t}]") for t, ft in enumerate(finetuned)]
    for h, n in zip([h0, *hs], names, strict=True):
        h.check_psd(name=n)

    merged_precision = h0  # H̄ = H_0 + Σ_t α_t H_t
    rhs = P.zeros_like(base)  # Σ_t α_t (H_0 + H_t)(θ_t − θ_LLM)
    for alpha, h, tau in zip(weights, hs, task_vectors, strict=True):
        merged_precision = merged_precision + alpha * h
        # α_t times the term, then added (two roundings, not the fused y + α·x of P.axpy): the
        # elementwise paths (elementwise.matching, kernels.fused) round the same way, so all
        # agree bit for bit
        rhs = P.add(rhs, P.scale(alpha, P.add(h0.mv(tau), h.mv(tau))))
    guess = None  # the task-arithmetic solution Σ_t α_t τ_t, where a warm start may use it
    if isinstance(solver, KroneckerCG) and solver.warm_start:
        guess = P.zeros_like(base)
        for alpha, tau in zip(weights, task_vectors, strict=True):
            guess = P.axpy(alpha, tau, guess)
    x, report = solve(merged_precision, rhs, solver, guess)
    merged = P.add(base, x)  # Eq. 6
    P.check_result_finite(merged, what="merged", alphas=weights)
    return merged, report


def solve(
    precision: Curvature, rhs: Params, solver: Solver | None, guess: Params | None = None
) -> tuple[dict[str, Tensor], Solution]:
    """(precision⁻¹ rhs, the solve's report), run as ``solver`` says (passed to the call that
    solves, :meth:`Curvature.solve_info`)."""
    solved = precision.solve_info(rhs, solver, guess=guess)
    return solved.value, solved
