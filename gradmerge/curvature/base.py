"""The curvature operator interface every merge and removal method is written against.

A curvature ``C`` is a symmetric positive semi-definite linear operator over a parameter dict: a
Hessian, a generalised Gauss-Newton or a Fisher of a loss that is a SUM over examples (the paper's
H_t = Σ_i ∇²ℓ_i), or a prior precision H_0. The structure (scaled identity, diagonal, dense, ...)
only decides how ``mv`` and ``solve`` are computed.

Algebra: ``C1 + C2`` is the exact sum, ``c * C`` scales, ``C + δ`` adds δ·I. Sums of two different
structures give the richer structure (``ScaledIdentity`` ⊂ ``Diagonal`` ⊂ ``Dense``), exactly.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.errors import ArgumentError, NotPositiveDefiniteError, StructureError
from gradmerge.params import Layout, Params


class IncompatibleStructures(TypeError):
    """Raised by ``_promote`` when one structure cannot hold another exactly (internal)."""


class Curvature(ABC):
    """A symmetric PSD linear operator over a parameter dict.

    Subclasses implement ``mv``, ``solve``, ``to``, ``scaled``, ``min_eigenvalue`` and the exact
    same-structure sum ``_add_same``; ``rank`` orders structures for promotion in sums.
    """

    rank: int = 0

    @property
    @abstractmethod
    def layout(self) -> Layout | None:
        """Names and shapes covered, in order; ``None`` for an operator that covers any dict."""

    @abstractmethod
    def mv(self, v: Params) -> dict[str, Tensor]:
        """The product ``C v``."""

    @abstractmethod
    def solve(self, v: Params) -> dict[str, Tensor]:
        """The solution ``x`` of ``C x = v``.

        Raises:
            NotPositiveDefiniteError: ``C`` is singular or not positive definite.
        """

    @abstractmethod
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Any:
        """A copy on ``device`` and/or in ``dtype``."""

    @abstractmethod
    def scaled(self, c: float) -> Curvature:
        """The operator ``c · C``."""

    @abstractmethod
    def min_eigenvalue(self) -> float:
        """The smallest eigenvalue (exact for the structures implemented here)."""

    @abstractmethod
    def _add_same(self, other: Any) -> Curvature:
        """Exact sum with an operator of the same structure and layout."""

    @abstractmethod
    def _promote(self, other: Curvature) -> Curvature:
        """``other`` (of lower rank) expressed exactly in this structure and layout."""

    # ----- algebra ---------------------------------------------------------------------------
    def __add__(self, other: object) -> Curvature:
        from gradmerge.curvature.identity import ScaledIdentity

        if isinstance(other, (int, float)):
            other = ScaledIdentity(float(other))
        if not isinstance(other, Curvature):
            return NotImplemented
        if isinstance(other, ScaledIdentity) and other.delta == 0.0:
            return self  # adding the zero operator must not add a term (e.g. to K-FAC)
        if isinstance(self, ScaledIdentity) and self.delta == 0.0:
            return other
        high, low = (self, other) if self.rank >= other.rank else (other, self)
        if (
            low.layout is not None
            and high.layout is not None
            and dict(low.layout) != dict(high.layout)
        ):
            raise StructureError(
                "cannot add curvatures over different parameters: "
                f"{_describe(high.layout)} vs {_describe(low.layout)}"
            )
        try:
            if low.rank < high.rank:
                low = high._promote(low)
            return high._add_same(low)
        except (
            IncompatibleStructures
        ):  # no structure holds both exactly: keep them as a lazy exact sum
            from gradmerge.curvature.lazy import Sum

            return Sum([high, low])

    __radd__ = __add__

    def __mul__(self, c: object) -> Curvature:
        if not isinstance(c, (int, float)):
            return NotImplemented
        return self.scaled(float(c))

    __rmul__ = __mul__

    # ----- conveniences shared by all structures ------------------------------------------
    @property
    def meta(self) -> dict[str, str]:
        """What the estimator recorded (fisher type, loss, number of examples, ...); saved."""
        if "_meta" not in self.__dict__:
            self._meta: dict[str, str] = {}
        return self._meta

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write this curvature to a safetensors file (see :mod:`gradmerge.curvature.io`)."""
        from gradmerge.curvature.io import save_curvature

        return save_curvature(self, path)

    def dense(self, layout: Layout | None = None) -> Tensor:
        """The operator as a dense matrix over the flattened parameters (small models only)."""
        layout = layout if layout is not None else self.layout
        if layout is None:
            raise ArgumentError("a scaled identity has no size of its own: pass a layout")
        n = sum(s.numel() for _, s in layout)
        dtype, device = self._dtype_device()
        eye = torch.eye(n, dtype=dtype, device=device)
        cols = [P.flatten(self.mv(P.unflatten(eye[:, j], layout)), layout) for j in range(n)]
        return torch.stack(cols, dim=1)

    def verify_finite(self, *, name: str) -> None:
        """Raise :class:`NonFiniteError` for NaN/Inf values not checked when ``C`` was built
        (diagonals read lazily from a curvature file); a no-op for every other curvature."""
        return None

    def check_psd(self, *, name: str, rtol: float | None = None) -> None:
        """Raise :class:`NotPositiveDefiniteError` if ``C`` has a clearly negative eigenvalue.

        Eigenvalues down to ``−rtol · max(1, |λ_max|)`` are accepted as round-off (``rtol``
        defaults to 100 × the dtype's machine epsilon).
        """
        lam = self.min_eigenvalue()
        dtype, _ = self._dtype_device()
        eps = torch.finfo(dtype).eps if dtype is not None else torch.finfo(torch.float64).eps
        tol = (rtol if rtol is not None else 100 * eps) * max(1.0, self._scale())
        if lam < -tol:
            raise NotPositiveDefiniteError(
                f"{name} is not positive semi-definite: smallest eigenvalue {lam:.3e}. A curvature "
                "(Hessian/GGN/Fisher) must be PSD; a Hessian away from a minimum can be indefinite: "
                "use a GGN or Fisher estimate instead, or clip negative eigenvalues."
            )

    def check_covers(self, params: Params, *, name: str, ref_name: str = "base") -> None:
        """Check that the operator acts on exactly the keys, shapes, dtype and device of ``params``.

        Raises:
            StructureError, DTypeError, DeviceError: naming the first tensor that does not fit.
        """
        if self.layout is not None:
            P.check_compatible(params, self._like(), ref_name=ref_name, name=name)

    def _like(self) -> dict[str, Tensor]:
        """Tensors with the covered shapes, dtype and device (views; never written to)."""
        raise NotImplementedError

    def _scale(self) -> float:
        """A magnitude of the operator, used for relative tolerances."""
        return 1.0

    def _dtype_device(self) -> tuple[torch.dtype | None, torch.device | None]:
        return None, None


def _describe(layout: Layout) -> str:
    keys = [k for k, _ in layout]
    head = ", ".join(repr(k) for k in keys[:3])
    return f"[{head}{', ...' if len(keys) > 3 else ''}] ({len(keys)} tensors)"


def not_pd(what: str, detail: str) -> NotPositiveDefiniteError:
    """The error for a system that cannot be solved, with the usual fix in its message."""
    return NotPositiveDefiniteError(
        f"{what} is singular or not positive definite ({detail}). Add damping, e.g. a prior "
        "δ·I with δ > 0 (prior=1e-6 or curvature + 1e-6), or check that the curvatures are PSD."
    )
