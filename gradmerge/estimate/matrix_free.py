"""Matrix-free exact curvature of a model on data: Hessian- and GGN-vector products.

For models too large for a dense matrix, ``MatrixFree`` is a curvature operator whose ``mv``
passes over the data: H v = Σ_i ∇²ℓ_i v (forward-over-reverse) or G v = Σ_i J_iᵀ Λ_i J_i v (a
Jacobian-vector product, the output Hessian, a vector-Jacobian product). ``solve`` runs CG and
raises if it does not converge (an indefinite Hessian is detected as a direction of
non-positive curvature). Sums with δ·I or other curvatures are lazy (:class:`gm.Sum`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import grad, jvp, vjp

from gradmerge import params as P
from gradmerge.curvature.base import Curvature
from gradmerge.errors import ArgumentError
from gradmerge.estimate._data import Inputs, Loss, batches, forward, per_example_loss
from gradmerge.estimate._functional import _Bound, trainable
from gradmerge.estimate._output_hessian import OutputHessian
from gradmerge.estimate.options import EstimateOptions, LossFunction, LossName
from gradmerge.params import Layout, Params
from gradmerge.solvers.cg import solve_or_raise
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import CG, Solver, refuse_settings, solver_for


class MatrixFree(Curvature):
    """The exact Hessian or GGN of ``model`` on ``data`` (a SUM over examples), never formed.

    Args:
        model: any ``nn.Module``; its current parameters are the expansion point.
        data: a re-iterable collection of batches (e.g. a list), passed over at every ``mv``.
        kind: ``"ggn"`` (PSD by construction) or ``"hessian"``.
        loss: ``"cross_entropy"`` or ``"mse"``.
        params: names of the parameters covered (default: all trainable ones).

    It holds no solver settings: ``H.solve_info(v, gm.CG(tol=..., maxiter=...))`` (or a rule's
    ``solver=``) runs CG as that solver says; ``H.solve(v)`` with ``gm.CG()`` (its defaults:
    :data:`gradmerge.solvers.spec.DEFAULT_TOL` by the dtype, :data:`gradmerge.solvers.spec.
    MAXITER` iterations). The keywords ``tol`` and ``maxiter`` of gradmerge 0.1.0 are refused
    with :class:`~gradmerge.errors.RemovedArgumentError`.

    Example:
        >>> import torch, gradmerge as gm
        >>> model = torch.nn.Linear(2, 1, bias=False).double()
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> H = gm.MatrixFree(model, [(X, torch.zeros(2, 1, dtype=torch.float64))], loss="mse")
        >>> H.mv({"weight": torch.tensor([[1.0, 1.0]], dtype=torch.float64)})["weight"]
        tensor([[1., 4.]], dtype=torch.float64)
    """

    rank = 5

    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Any],
        *,
        kind: Literal["ggn", "hessian"] = "ggn",
        loss: LossFunction | LossName = EstimateOptions.loss,
        ignore_index: int = EstimateOptions.ignore_index,
        params: Sequence[str] | None = None,
        **removed: object,
    ) -> None:
        refuse_settings("MatrixFree", removed)
        if kind not in ("ggn", "hessian"):
            raise ArgumentError(f"kind must be 'ggn' or 'hessian', got {kind!r}")
        self.model, self.kind, self.loss = model, kind, Loss(loss, ignore_index)
        self.params = {k: v.detach() for k, v in trainable(model, params).items()}
        device = next(iter(self.params.values())).device
        self.data = list(batches(data, device=device))  # validated once, on the model's device
        self.coefficient = 1.0  # c in c·H (scalar multiples stay matrix-free)

    def __repr__(self) -> str:
        return (
            f"MatrixFree({self.kind}, {P.numel(self.params)} parameters, {len(self.data)} batches)"
        )

    @property
    def layout(self) -> Layout:
        return P.layout_of(self.params)

    def _like(self) -> dict[str, Tensor]:
        return self.params

    def _dtype_device(self) -> tuple[torch.dtype, torch.device]:
        first = next(iter(self.params.values()))
        return first.dtype, first.device

    def _outputs(self, p: Params, inputs: Inputs) -> Tensor:
        return forward(_Bound(self.model, dict(p)), inputs)

    def mv(self, v: Params) -> dict[str, Tensor]:
        self.check_covers(v, name="the vector", ref_name="the curvature's parameters")
        total = P.zeros_like(self.params)
        for index, inputs, targets in self.data:
            total = P.add(total, self._batch_mv(v, index, inputs, targets))
        return total if self.coefficient == 1.0 else P.scale(self.coefficient, total)

    def _batch_mv(self, v: Params, index: int, inputs: Inputs, targets: Tensor) -> Params:
        if self.kind == "hessian":

            def batch_grad(p: Params) -> dict[str, Tensor]:
                return grad(
                    lambda q: per_example_loss(
                        self._outputs(q, inputs), targets, self.loss, batch=index
                    ).sum()
                )(p)

            return jvp(batch_grad, (self.params,), (dict(v),))[1]
        forward_pass = jvp(lambda p: self._outputs(p, inputs), (self.params,), (dict(v),))
        out, jv = forward_pass[0].detach(), forward_pass[1]  # f and J v
        per_example_loss(out, targets, self.loss, batch=index)  # validates the batch
        pullback = vjp(lambda p: self._outputs(p, inputs), self.params)[1]
        return pullback(OutputHessian(out, targets, self.loss).mv(jv))[0]  # Jᵀ Λ J v

    def solve_info(
        self, v: Params, solver: Solver | None = None, *, guess: Params | None = None
    ) -> Solution:
        """CG on this operator as ``solver`` says (:class:`gradmerge.CG`, or a
        :class:`gradmerge.KroneckerCG`: its ``tol`` and ``maxiter``; ``None``: ``CG()``);
        raises :class:`NotConvergedError` if it does not converge."""
        cg = solver_for(solver, CG, "MatrixFree")
        return solve_or_raise(self.mv, v, cg, what=f"the {self.kind}")

    def solve(self, v: Params) -> dict[str, Tensor]:
        return self.solve_info(v).value

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Any:
        raise ArgumentError(
            "move the model and data instead: MatrixFree computes on them as they are"
        )

    def scaled(self, c: float) -> MatrixFree:
        out = copy.copy(self)
        out.coefficient = self.coefficient * c
        return out

    def min_eigenvalue(self) -> float:
        """Not computed (it would need an eigensolver pass over the data).

        Returns 0.0 for a non-negative multiple of the GGN, which is PSD by construction; for the
        Hessian, CG detects negative curvature when it meets it, so no check is made up front.
        """
        return 0.0 if self.coefficient >= 0 else -float("inf")

    @property
    def min_eigenvalue_exact(self) -> bool:
        return False

    def _add_same(self, other: Curvature) -> Curvature:
        from gradmerge.curvature.lazy import Sum

        return Sum([self, other])

    def _promote(self, other: Curvature) -> Curvature:
        return other
