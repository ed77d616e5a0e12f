"""The record of a numeric check, the random cases it runs on, and adapters to gradmerge.

A numeric check runs one statement of the appendix on an exact model (float64) drawn from a seed
and returns an ERROR: a relative residual that is ~1e-12 when the statement holds and O(1) when it
does not. ``expect=True`` marks a statement that holds (error ≤ ``tol`` on every case);
``expect=False`` marks a statement as printed that is wrong (error > ``tol`` on every case).
Where a check needs merge or removal results it calls the public gradmerge functions, so the
same code that runs on networks is what the theory verifies.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

import gradmerge as gm
from gradmerge import params as P

DTYPE = torch.float64


@dataclass(frozen=True)
class NumericCheck:
    """One numeric statement.

    Attributes:
        id: shared with the symbolic check of the same statement where there is one.
        where: location in the appendix.
        statement: one line.
        expect: ``True`` if it holds, ``False`` for an erratum as printed.
        run: spec ↦ error on the problem the spec describes; the spec's type is taken from
            ``run``'s annotation (a class of :mod:`gradmerge.theory.numeric.cases`).
        tol: the error below which the statement counts as holding.
    """

    id: str
    where: str
    statement: str
    expect: bool
    run: Callable[[Any], float]
    tol: float = 1e-9

    @property
    def spec_type(self) -> Any:
        """The spec class ``run`` takes (from its ``spec`` annotation)."""
        return typing.get_type_hints(self.run)["spec"]

    @property
    def model(self) -> str:
        """``"linear"`` or ``"logistic"``: the exact model the check runs on."""
        return "linear" if self.spec_type.__name__.startswith("Linear") else "logistic"

    def error(self, seed: int) -> float:
        """The error on the random case of ``seed`` (``spec_type.from_seed``)."""
        return self.run(self.spec_type.from_seed(seed))


def rel(a: Tensor, b: Tensor) -> float:
    """‖a − b‖ / ‖b‖ (b the reference), or ‖a − b‖ when b = 0."""
    ref = float(torch.linalg.norm(b))
    err = float(torch.linalg.norm(a - b))
    return err / ref if ref > 0 else err


def residual(lhs: Tensor, rhs: Tensor, *terms: Tensor) -> float:
    """‖lhs − rhs‖ relative to the sum of the norms of the identity's terms.

    The right measure for an identity between computed quantities whose terms are larger than
    their difference (cancellation) or which are differences themselves (errors of a rule):
    rounding is relative to the terms, not to the result.
    """
    scale = sum(float(torch.linalg.norm(x)) for x in (lhs, rhs, *terms))
    err = float(torch.linalg.norm(lhs - rhs))
    return err / scale if scale > 0 else err


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def alpha_not_one(r: np.random.Generator) -> float:
    """An α_t away from 1 (statements that hold only for α_t = 1 must visibly fail)."""
    return float(r.choice([r.uniform(0.2, 0.7), r.uniform(1.4, 3.0)]))


# ----- adapters between flat vectors (the exact models) and parameter dicts (gradmerge) --------
class Layout:
    """Maps flat θ ∈ R^p to the parameter dict gradmerge sees, and matrices to ``gm.Dense``."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.layout = tuple((k, torch.Size(s)) for k, s in shapes.items())

    def params(self, theta: Tensor) -> dict[str, Tensor]:
        return P.unflatten(theta, self.layout)

    def flat(self, params: gm.params.Params) -> Tensor:
        return P.flatten(params, self.layout)

    def dense(self, matrix: Tensor) -> gm.Dense:
        return gm.Dense(matrix, P.unflatten(matrix[0], self.layout))

    def grad_fns(
        self, gradient: Callable[[int, Tensor], Tensor], tasks: int
    ) -> list[gm.GradientFn]:
        """One θ ↦ ∇ℓ̄_t(θ) per task, over parameter dicts, from ``gradient(t, θ_flat)``."""

        def for_task(t: int) -> gm.GradientFn:
            return lambda p: self.params(gradient(t, self.flat(p)))

        return [for_task(t) for t in range(tasks)]


def vector_layout(p: int) -> Layout:
    """A single-tensor layout ``{"theta": (p,)}`` (linear regression has no bias here)."""
    return Layout({"theta": (p,)})
