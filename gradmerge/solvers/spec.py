"""How an iterative solve K x = b is to be run: one frozen record, passed to each solve.

The YAML ``solver:`` block of a merge or removal config maps onto it key for key; the
streaming engine builds one per job and hands it to every unit's solve (no setting travels on
the operators). The in-memory rules take it as ``solver=``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gradmerge.errors import ArgumentError

ArithmeticMode = Literal["auto", "working", "bfloat16"]
"""The floating-point arithmetic of the K-FAC solves (the ``precision`` setting): ``"working"``, the
operator's dtype throughout; ``"bfloat16"``, bfloat16 Kronecker products inside a working-dtype
refinement; ``"auto"``, bfloat16 where the device's bfloat16 products are measurably faster.
"Precision" as a type name is kept for precision MATRICES (the prior H_0, the merged H̄)."""
ARITHMETIC_MODES: tuple[ArithmeticMode, ...] = ("auto", "working", "bfloat16")


@dataclass(frozen=True)
class SolverSpec:
    """Settings of the iterative (K-FAC, CG) solves of a merge or removal.

    Attributes:
        tol: the relative residual ‖b − Kx‖/‖b‖ every solve must reach, certified in float64;
            ``None``: 1e-10 in float64, 1e-5 in float32 (:func:`gradmerge.solvers.cg.default_tol`).
        maxiter: CG iterations per round before :class:`NotConvergedError` (≥ 1; ≥ 0 with
            ``approximate``).
        approximate: accept each K-FAC layer's solve after at most ``maxiter`` CG iterations
            with whatever residual it has, still measured and reported; never the default.
        precision: the dtype of the K-FAC CG's inner Kronecker products: ``"working"`` (the
            factors' dtype), ``"bfloat16"`` (products in bfloat16 inside an iterative
            refinement whose residual is formed in float32 and certified in float64: the
            certified residual and its tolerance are the same either way) or ``"auto"``
            (default): ``"bfloat16"`` for float32 layers with both sides ≥
            :data:`gradmerge.solvers.kfac_cg.LOW_MIN_SIDE` on a device whose bfloat16 GEMMs
            are measurably faster than its float32 ones (a CUDA device that supports
            bfloat16; a CPU where a timed 512² product is ≥ 1.5× faster in bfloat16),
            else ``"working"``.
        warm_start: start each K-FAC layer's CG from the best of the caller's guess (the
            task-arithmetic solution for a merge) and the eigenbasis preconditioner's solve,
            judged by their residuals; ``False`` (default): the preconditioner's solve alone.

    Example:
        >>> import gradmerge as gm
        >>> gm.SolverSpec(tol=1e-4, maxiter=200)
        SolverSpec(tol=0.0001, maxiter=200, approximate=False, precision='auto', warm_start=False)
        >>> gm.SolverSpec(tol=2.0)
        Traceback (most recent call last):
        ...
        gradmerge.errors.ArgumentError: SolverSpec.tol is a relative residual: it must be > 0 and < 1, got 2.0
    """

    tol: float | None = None
    maxiter: int = 1000
    approximate: bool = False
    precision: ArithmeticMode = "auto"
    warm_start: bool = False

    def __post_init__(self) -> None:
        tol = self.tol
        if tol is not None and (
            isinstance(tol, bool)
            or not isinstance(tol, (int, float))
            or not math.isfinite(tol)
            or not 0 < tol < 1
        ):
            raise ArgumentError(
                f"SolverSpec.tol is a relative residual: it must be > 0 and < 1, got {tol!r}"
            )
        low = 0 if self.approximate else 1
        if (
            isinstance(self.maxiter, bool)
            or not isinstance(self.maxiter, int)
            or self.maxiter < low
        ):
            raise ArgumentError(
                f"SolverSpec.maxiter must be a whole number ≥ {low}"
                f"{' with approximate' if low == 0 else ' (0 only with approximate=True)'}, "
                f"got {self.maxiter!r}"
            )
        for name in ("approximate", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentError(
                    f"SolverSpec.{name} must be true or false, got {getattr(self, name)!r}"
                )
        if self.precision not in ARITHMETIC_MODES:
            raise ArgumentError(
                f"SolverSpec.precision must be one of {', '.join(ARITHMETIC_MODES)}, "
                f"got {self.precision!r}"
            )
