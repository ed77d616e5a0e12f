"""A lazy exact sum of curvatures of different structures, solved by conjugate gradients.

Structures that can absorb each other sum exactly into one structure (δ·I into anything, a
diagonal into a dense matrix, K-FAC terms into K-FAC). Any other pair — K-FAC plus a diagonal,
a dense matrix plus a matrix-free Hessian — becomes a :class:`Sum`: ``mv`` adds the terms'
products, ``solve_info(v, solver)`` runs CG (:func:`gradmerge.solvers.cg.conjugate_gradient`) as
the solver given says (a :class:`gradmerge.CG`, its defaults for ``None``) and raises if it does
not reach its ``tol``; ``solve`` is that with the defaults.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature.base import Curvature
from gradmerge.errors import StructureError
from gradmerge.params import Layout, Params
from gradmerge.solvers.cg import solve_or_raise
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import CG, Solver, refuse_settings, solver_for


class Sum(Curvature):
    """The exact sum Σ_k C_k of curvatures over the same parameters, kept as its terms.

    Example:
        >>> import torch, gradmerge as gm
        >>> K = gm.KFAC({"fc": (torch.eye(2), torch.eye(1))})
        >>> S = K + gm.Diagonal({"fc.weight": torch.tensor([[1.0, 3.0]])})   # no common structure
        >>> S.solve({"fc.weight": torch.tensor([[2.0, 4.0]])})["fc.weight"].round(decimals=4)
        tensor([[1., 1.]])
    """

    rank = 5

    def __init__(self, terms: list[Curvature], **removed: object) -> None:
        refuse_settings("Sum", removed)
        layouts = [dict(t.layout) for t in terms if t.layout is not None]
        if not layouts:
            raise StructureError("a Sum needs at least one term that covers parameters")
        if any(lay != layouts[0] for lay in layouts):
            raise StructureError("cannot add curvatures over different parameters")
        structured = [t for t in terms if t.layout is not None]
        for t in structured[1:]:
            P.check_compatible(
                structured[0]._like(), t._like(), ref_name="the first term", name="a term"
            )
        self.terms = list(terms)

    def __repr__(self) -> str:
        return f"Sum({' + '.join(repr(t) for t in self.terms)})"

    @property
    def layout(self) -> Layout:
        return next(t.layout for t in self.terms if t.layout is not None)

    def _structured(self) -> Curvature:
        return next(t for t in self.terms if t.layout is not None)

    def _like(self) -> dict[str, Tensor]:
        return self._structured()._like()

    def _dtype_device(self) -> tuple[torch.dtype | None, torch.device | None]:
        return self._structured()._dtype_device()

    def _components(self) -> list[Curvature]:
        return self.terms

    def mv(self, v: Params) -> dict[str, Tensor]:
        out = self.terms[0].mv(v)
        for term in self.terms[1:]:
            out = P.add(out, term.mv(v))
        return out

    def solve_info(
        self, v: Params, solver: Solver | None = None, *, guess: Params | None = None
    ) -> Solution:
        """CG on Σ_k C_k x = v (unpreconditioned) as ``solver`` says (:class:`gradmerge.CG`,
        or a :class:`gradmerge.KroneckerCG`: its ``tol`` and ``maxiter``; ``None``: ``CG()``,
        which aims for :data:`gradmerge.solvers.spec.DEFAULT_TOL` of the dtype); raises
        :class:`NotConvergedError` if it fails."""
        cg = solver_for(solver, CG, "a Sum")
        self.check_covers(v, name="the vector", ref_name="the vector")
        return solve_or_raise(self.mv, v, cg, what="a sum of curvatures")

    def solve(self, v: Params) -> dict[str, Tensor]:
        return self.solve_info(v).value

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Sum:
        return Sum([t.to(device=device, dtype=dtype) for t in self.terms])

    def scaled(self, c: float) -> Sum:
        return Sum([t.scaled(c) for t in self.terms])

    def min_eigenvalue(self) -> float:
        """A lower bound: the sum of the terms' smallest eigenvalues (Weyl), exact only for a
        single exact term."""
        return sum(t.min_eigenvalue() for t in self.terms)

    @property
    def min_eigenvalue_exact(self) -> bool:
        return len(self.terms) == 1 and self.terms[0].min_eigenvalue_exact

    def _scale(self) -> float:
        return sum(t._scale() for t in self.terms)

    def _add_same(self, other: Curvature) -> Sum:
        extra = other.terms if isinstance(other, Sum) else [other]
        return Sum([*self.terms, *extra])

    def _promote(self, other: Curvature) -> Curvature:
        return other  # a Sum takes any term as it is
