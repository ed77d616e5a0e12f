"""The result of a solve K x = b: one type for every curvature structure and solver."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor


class Result(enum.Enum):
    """How a solve ended (lineax's ``RESULTS``), in :attr:`Solution.result`.

    - ``successful``: the residual met the solver's tolerance (direct solves: always).
    - ``max_iterations_reached``: an approximate K-FAC solve
      (``gm.KroneckerCG(approximate=True)``) stopped after its ``maxiter`` CG iterations above
      ``tol``; its residual is still measured and reported.

    Every other ending raises instead of returning a solution: a solve that misses its tolerance
    without ``approximate`` (:class:`~gradmerge.errors.NotConvergedError`), a singular or
    indefinite system (:class:`~gradmerge.errors.NotPositiveDefiniteError`).

    Example:
        >>> Result.successful.value, Result("max_iterations_reached").name
        ('successful', 'max_iterations_reached')
    """

    successful = "successful"
    max_iterations_reached = "max_iterations_reached"

    @staticmethod
    def of(met: bool) -> Result:
        """``successful`` where the tolerance was met, else ``max_iterations_reached``."""
        return Result.successful if met else Result.max_iterations_reached


@dataclass(frozen=True)
class Solution:
    """How a solve K x = b went.

    Attributes:
        value: x, a parameter dict (for a part: that block's tensors).
        method: how it was solved, e.g. ``"exact (diagonal)"``, ``"preconditioned CG"``.
        iterations: CG iterations (0 for direct solves; the sum over parts).
        residual: the relative residual ‖b − Kx‖ / ‖b‖ (the largest over parts), recomputed from
            x, not from a recursion; ``nan`` where it was not measured (direct exact solves of
            elementwise structures, whose residual is round-off).
        result: how it ended (:class:`Result`): ``successful``, or ``max_iterations_reached``
            where some part stopped above its tolerance (an approximate K-FAC solve).
        parts: per block (e.g. per K-FAC layer), the same report for that block alone.
        measured: figures a fused pass measured on the way, by name (the elementwise removal's
            step, task-vector and rounding sums: ``gradmerge.elementwise.removal.RemovalStats``).

    Example:
        >>> import torch, gradmerge as gm
        >>> K = gm.KFAC({"fc": (torch.diag(torch.tensor([1.0, 3.0])), 2 * torch.eye(2))}) + 2.0
        >>> s = K.solve_info({"fc.weight": torch.ones(2, 2)}, gm.KroneckerCG())
        >>> s.result, s.success, s.parts["fc"].method, s.value["fc.weight"][0]
        (<Result.successful: 'successful'>, True, '1-term eigendecomposition', tensor([0.2500, 0.1250]))
    """

    value: dict[str, Tensor]
    method: str
    iterations: int = 0
    residual: float = float("nan")
    result: Result = Result.successful
    parts: Mapping[str, Solution] = field(default_factory=dict)
    measured: Mapping[str, float] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        """Whether every part reached its tolerance: ``result is Result.successful``."""
        return self.result is Result.successful

    @property
    def max_residual(self) -> float:
        """The largest measured relative residual (0.0 when none was measured)."""
        values = [p.residual for p in self.parts.values()] or [self.residual]
        measured = [r for r in values if r == r]
        return max(measured, default=0.0)

    def summary(self) -> dict[str, object]:
        """A JSON-ready record per part (no tensors): method, iterations, residual, ``result``
        (:class:`Result`'s value) and ``success`` (``result == "successful"``)."""
        if not self.parts:
            return {
                "method": self.method,
                "iterations": self.iterations,
                "residual": self.residual,
                "result": self.result.value,
                "success": self.success,
            }
        return {name: part.summary() for name, part in self.parts.items()}
