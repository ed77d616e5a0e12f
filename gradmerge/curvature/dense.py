"""Dense curvature: a full symmetric matrix over the flattened parameters (small models)."""

from __future__ import annotations

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature.base import Curvature, IncompatibleStructures
from gradmerge.curvature.diagonal import Diagonal
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.errors import ArgumentError, StructureError, not_pd
from gradmerge.params import Layout, Params


class Dense(Curvature):
    """The operator given by a symmetric matrix ``M`` over ``flatten(like)``.

    ``mv`` is a matrix-vector product, ``solve`` a Cholesky solve (the factor is cached).
    Rows and columns follow the keys of ``like`` in order, each tensor flattened row-major — the
    order of :func:`gradmerge.params.flatten`.

    Args:
        matrix: ``(n, n)`` symmetric floating matrix, ``n`` the number of scalars in ``like``.
        like: a parameter dict (or any dict of tensors with the parameters' shapes).

    Example:
        >>> import torch, gradmerge as gm
        >>> H = gm.Dense(torch.tensor([[2.0, 1.0], [1.0, 2.0]]), like={"w": torch.zeros(2)})
        >>> H.mv({"w": torch.tensor([1.0, 0.0])})
        {'w': tensor([2., 1.])}
    """

    rank = 2

    def __init__(self, matrix: Tensor, like: Params) -> None:
        if not isinstance(matrix, Tensor):
            raise TypeError(f"Dense matrix must be a torch.Tensor, got {type(matrix).__name__}")
        P.check_params({"matrix": matrix}, name="Dense")
        self._layout = P.layout_of(like)
        n = sum(s.numel() for _, s in self._layout)
        if matrix.shape != (n, n):
            raise StructureError(
                f"Dense matrix has shape {tuple(matrix.shape)} but `like` has {n} scalars: "
                f"expected ({n}, {n}) over the flattened parameters in key order"
            )
        asym = float((matrix - matrix.T).abs().max()) if n else 0.0
        scale = float(matrix.abs().max()) if n else 0.0
        if asym > 1e3 * torch.finfo(matrix.dtype).eps * max(scale, 1e-300):
            raise ArgumentError(
                f"Dense matrix is not symmetric (max |M − Mᵀ| = {asym:.3e}, max |M| = {scale:.3e})"
                "; a curvature is symmetric: pass (M + M.T) / 2 if the asymmetry is round-off"
            )
        self.matrix = matrix
        self._cholesky: Tensor | None = None

    def __repr__(self) -> str:
        return f"Dense({self.matrix.shape[0]}×{self.matrix.shape[0]}, {self.matrix.dtype})"

    @property
    def layout(self) -> Layout:
        return self._layout

    def _flat(self, v: Params) -> Tensor:
        like = P.unflatten(self.matrix[0], self._layout)
        P.check_compatible(like, v, ref_name="the curvature", name="the vector")
        return P.flatten(v, self._layout)

    def mv(self, v: Params) -> dict[str, Tensor]:
        return P.unflatten(self.matrix @ self._flat(v), self._layout)

    def solve(self, v: Params) -> dict[str, Tensor]:
        x = self._flat(v)
        if self._cholesky is None:
            factor, info = torch.linalg.cholesky_ex(self.matrix)
            if int(info) != 0:
                lam = float(torch.linalg.eigvalsh(self.matrix)[0])
                raise not_pd("dense system", f"smallest eigenvalue {lam:.3e}")
            self._cholesky = factor
        return P.unflatten(torch.cholesky_solve(x[:, None], self._cholesky)[:, 0], self._layout)

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Dense:
        m = self.matrix.to(device=device, dtype=dtype)
        P.check_params({"matrix": m}, name="Dense")  # a cast to a narrower dtype can overflow
        # symmetry is not re-judged at the new dtype: a float32 matrix symmetric to float32's
        # precision keeps its (exact) asymmetry in float64, which float64's tolerance refuses
        out = Dense.__new__(Dense)
        out._layout, out.matrix, out._cholesky = self._layout, m, None
        return out

    def scaled(self, c: float) -> Dense:
        return Dense(c * self.matrix, self._like())

    @property
    def min_eigenvalue_exact(self) -> bool:
        return True

    def min_eigenvalue(self) -> float:
        return float(torch.linalg.eigvalsh(self.matrix)[0])

    def _scale(self) -> float:
        return float(self.matrix.abs().max())

    def _dtype_device(self) -> tuple[torch.dtype, torch.device]:
        return self.matrix.dtype, self.matrix.device

    def _like(self) -> dict[str, Tensor]:
        return P.unflatten(self.matrix[0], self._layout)

    def _add_same(self, other: Dense) -> Dense:
        P.check_compatible(self._like(), other._like(), ref_name="Dense", name="Dense")
        return Dense(self.matrix + other._in_order(self._layout), self._like())

    def _in_order(self, layout: Layout) -> Tensor:
        """The matrix with rows and columns in the flattening order of ``layout`` (same keys)."""
        if layout == self._layout:
            return self.matrix
        index = P.unflatten(
            torch.arange(self.matrix.shape[0], device=self.matrix.device), self._layout
        )
        perm = P.flatten(index, layout)
        return self.matrix[perm][:, perm]

    def _promote(self, other: Curvature) -> Dense:
        n = self.matrix.shape[0]
        if isinstance(other, ScaledIdentity):
            diag = torch.full((n,), other.delta, dtype=self.matrix.dtype, device=self.matrix.device)
        elif isinstance(other, Diagonal):
            P.check_compatible(self._like(), other.values, ref_name="Dense", name="Diagonal")
            diag = P.flatten(other.values, self._layout)
        else:
            raise IncompatibleStructures(f"cannot express {type(other).__name__} as a Dense matrix")
        return Dense(torch.diag(diag), self._like())
