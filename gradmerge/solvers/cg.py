"""Iterative solves over parameter dicts: preconditioned conjugate gradients with a report.

Structured curvatures solve exactly (elementwise, Cholesky, Kronecker eigendecompositions); sums
that no structure can solve exactly, and matrix-free operators, use :func:`conjugate_gradient`.
It never returns a silently wrong answer: ``solve`` methods raise when CG does not converge.
The settings come from the caller's solver object (:class:`gradmerge.solvers.spec.CG`:
:func:`solve_or_raise`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.errors import NotConvergedError, NotPositiveDefiniteError
from gradmerge.params import Params
from gradmerge.solvers.solution import Result, Solution
from gradmerge.solvers.spec import CG, DEFAULT_TOL, LOW_PRECISION_TOL, MAXITER

Operator = Callable[[Params], dict[str, Tensor]]


def default_tol(dtype: torch.dtype) -> float:
    """The relative residual CG aims for by default in ``dtype``: :data:`~gradmerge.solvers.spec.
    DEFAULT_TOL` (float64, float32), else :data:`~gradmerge.solvers.spec.LOW_PRECISION_TOL` (a
    true residual cannot fall much below κ·eps of the working precision).

    Example:
        >>> from gradmerge.solvers.spec import DEFAULT_TOL, LOW_PRECISION_TOL
        >>> default_tol(torch.float32) == DEFAULT_TOL["float32"] > DEFAULT_TOL["float64"]
        True
        >>> default_tol(torch.bfloat16) == LOW_PRECISION_TOL
        True
    """
    return DEFAULT_TOL.get(str(dtype).removeprefix("torch."), LOW_PRECISION_TOL)


def solve_or_raise(
    apply: Operator,
    b: Params,
    solver: CG,
    *,
    what: str,
    precondition: Operator | None = None,
) -> Solution:
    """:func:`conjugate_gradient` run as ``solver`` says (its ``tol``, ``None``:
    :func:`default_tol` of ``b``'s dtype; its ``maxiter``), raising :class:`NotConvergedError`
    if it does not converge."""
    dtype = next(iter(b.values())).dtype
    tol = default_tol(dtype) if solver.tol is None else solver.tol
    maxiter = solver.maxiter
    assert maxiter is not None  # CG resolves its default
    result = conjugate_gradient(
        apply, b, precondition=precondition, tol=tol, maxiter=maxiter, what=what
    )
    if not result.success:
        raise NotConvergedError(
            f"CG on {what} stopped at relative residual {result.residual:.2e} after "
            f"{result.iterations} iterations (tol {tol:.0e}, {dtype}); the system is "
            "ill-conditioned for this precision: add damping δ, work in float64, or raise maxiter"
        )
    return result


def conjugate_gradient(
    apply: Operator,
    b: Params,
    *,
    precondition: Operator | None = None,
    x0: Params | None = None,
    tol: float = DEFAULT_TOL["float64"],
    maxiter: int = MAXITER,
    what: str = "the system",
) -> Solution:
    """Solve K x = b for a symmetric positive definite K given as ``apply(v) = K v``.

    Args:
        apply: v ↦ K v.
        b: the right-hand side.
        precondition: v ↦ M⁻¹ v for an SPD M ≈ K (default: none).
        x0: the starting point (default: M⁻¹ b, or 0).
        tol: relative residual to reach.
        maxiter: iteration budget.
        what: how to name the system in errors.

    Raises:
        NotPositiveDefiniteError: a direction of non-positive curvature (pᵀKp ≤ 0): K is not
            positive definite (e.g. an indefinite Hessian, or missing damping).
    """
    prec = precondition if precondition is not None else (lambda v: dict(v))
    bnorm = P.norm(b)
    if bnorm == 0:
        return Solution(P.zeros_like(b), "CG", 0, 0.0)
    x = dict(x0) if x0 is not None else (prec(b) if precondition is not None else P.zeros_like(b))
    iterations, residual = 0, float("inf")
    # restart from the true residual whenever the recursive one has converged but drifted
    while iterations < maxiter:
        r = P.sub(b, apply(x))
        residual = P.norm(r) / bnorm
        if residual <= tol:
            break
        z = prec(r)
        p, rz = z, float(P.dot(r, z))
        while iterations < maxiter and P.norm(r) > tol * bnorm:
            kp = apply(p)
            pkp = float(P.dot(p, kp))
            if pkp <= 0:
                raise NotPositiveDefiniteError(
                    f"{what} is not positive definite: CG met a direction with pᵀKp = {pkp:.3e}. "
                    "Add damping (a prior δ·I with δ > 0) or use a PSD curvature (GGN/Fisher)."
                )
            step = rz / pkp
            x = P.axpy(step, p, x)
            r = P.axpy(-step, kp, r)
            z = prec(r)
            rz_next = float(P.dot(r, z))
            p = P.axpy(rz_next / rz, p, z)
            rz = rz_next
            iterations += 1
    residual = P.norm(P.sub(b, apply(x))) / bnorm
    method = "preconditioned CG" if precondition is not None else "CG"
    return Solution(x, method, iterations, residual, Result.of(residual <= tol))
