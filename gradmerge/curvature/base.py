"""The curvature operator interface every merge and removal method is written against.

A curvature ``C`` is a symmetric positive semi-definite linear operator over a parameter dict: a
Hessian, a generalised Gauss-Newton or a Fisher of a loss that is a SUM over examples (the paper's
H_t = Σ_i ∇²ℓ_i), or a prior precision H_0. The structure (scaled identity, diagonal, dense, ...)
only decides how ``mv`` and ``solve`` are computed.

Algebra: ``C1 + C2`` is the exact sum, ``c * C`` scales, ``C + δ`` adds δ·I. Sums of two different
structures give the richer structure (``ScaledIdentity`` ⊂ ``Diagonal`` ⊂ ``Dense``), exactly.

Precision provenance. A curvature estimated in float32 has eigenvalues perturbed by round-off of
order ε₃₂‖C‖ (ε the machine epsilon), so a PSD one can show eigenvalues down to about −ε₃₂‖C‖.
Casting it to float64 does not make those digits right: :attr:`Curvature.coarsest_dtype` remembers
the coarsest floating dtype the values have passed through — the dtype a curvature is built in,
carried by ``to`` and ``scaled`` (enforced here for every subclass, see
:meth:`Curvature.__init_subclass__`), by sums (``__add__``) and by the composite structures
(``Blocks``, ``Sum``: the coarsest of their parts) — and :meth:`Curvature.check_psd` judges
negative eigenvalues at that precision, not at the current dtype's.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.errors import ArgumentError, NotPositiveDefiniteError, StructureError
from gradmerge.foundation.text import key_list
from gradmerge.params import Layout, Params
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import Solver, solver_for

if TYPE_CHECKING:  # the types of PROVIDED only: at run time the package provides them
    from gradmerge.curvature.identity import ScaledIdentity
    from gradmerge.curvature.lazy import Sum


class IncompatibleStructures(TypeError):
    """Raised by ``_promote`` when one structure cannot hold another exactly (internal)."""


class Curvature(ABC):
    """A symmetric PSD linear operator over a parameter dict.

    Subclasses implement ``mv``, ``solve``, ``to``, ``scaled``, ``min_eigenvalue`` and the exact
    same-structure sum ``_add_same``; ``rank`` orders structures for promotion in sums.
    """

    rank: int = 0

    _coarsest_seen: torch.dtype | None = None
    """The coarsest dtype the values had before the current one (recorded by ``to``, ``scaled``
    and sums; ``None``: nothing coarser). A class default, so that instances made without
    ``__init__`` (``cls.__new__``) have it too."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make every structure's ``to`` and ``scaled`` pass the precision on to their result.

        Done once here, so that no structure — nor one defined outside this package — can drop
        the record: the result of ``C.to(...)`` or ``C.scaled(c)`` (a new operator with the same
        values, cast or scaled) remembers ``C.coarsest_dtype``.
        """
        super().__init_subclass__(**kwargs)
        for name in ("to", "scaled"):
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "_carries_precision", False):
                setattr(cls, name, _carrying_precision(method))

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

    def solve_info(
        self, v: Params, solver: Solver | None = None, *, guess: Params | None = None
    ) -> Solution:
        """:meth:`solve` with its report (:class:`gradmerge.Solution`): method, iterations,
        residual, :class:`~gradmerge.solvers.solution.Result` and per-block parts.

        The one call that takes a solver (the settings of one algorithm,
        :mod:`gradmerge.solvers.spec`): K-FAC runs a :class:`gradmerge.KroneckerCG`, sums and
        matrix-free operators a :class:`gradmerge.CG` (a ``KroneckerCG`` is one), each with
        its defaults for ``None``, and measure their residual; a solver that does not fit the
        structure is an :class:`~gradmerge.errors.ArgumentError`. Direct solves of elementwise
        and dense structures take any solver and use none: they report the method only (their
        residual is round-off). ``guess`` (an estimate of x) may start an iterative solve
        (K-FAC with ``warm_start``) and is otherwise unused.

        Example:
            >>> import torch, gradmerge as gm
            >>> D = gm.Diagonal({"w": torch.tensor([2.0, 4.0])})
            >>> s = D.solve_info({"w": torch.ones(2)}, gm.KroneckerCG())
            >>> s.value["w"], s.method, s.result
            (tensor([0.5000, 0.2500]), 'exact (Diagonal)', <Result.successful: 'successful'>)
        """
        solver_for(solver, Solver, type(self).__name__)
        return Solution(self.solve(v), f"exact ({type(self).__name__})")

    @abstractmethod
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Any:
        """A copy on ``device`` and/or in ``dtype``."""

    @abstractmethod
    def scaled(self, c: float) -> Curvature:
        """The operator ``c · C``."""

    @abstractmethod
    def min_eigenvalue(self) -> float:
        """A lower bound λ_low ≤ λ_min(C) on the smallest eigenvalue, equal to it where
        :attr:`min_eigenvalue_exact` is true.

        Exact for ``ScaledIdentity``, ``Diagonal``, ``Dense``, one-term K-FAC layers and small
        multi-term ones, and ``Blocks`` of exact parts. A lower bound (Weyl: λ_min(X + Y) ≥
        λ_min(X) + λ_min(Y)) for ``Sum`` and for K-FAC layers with several Kronecker terms above
        :data:`gradmerge.curvature.kfac.EXACT_EIG_MAX_SIZE` parameters. ``MatrixFree`` computes
        nothing: it returns 0 for a non-negative multiple (a bound for a GGN, PSD by construction,
        and for a PSD Hessian; an indefinite Hessian is not checked up front, its CG solve
        detects negative curvature) and −∞ for a negative multiple.

        Example:
            >>> import torch, gradmerge as gm
            >>> C = gm.Diagonal({"w": torch.tensor([2.0, 5.0])}) + gm.Dense(
            ...     torch.eye(2, dtype=torch.float32), {"w": torch.zeros(2)})
            >>> C.min_eigenvalue(), C.min_eigenvalue_exact
            (3.0, True)
        """

    @property
    def min_eigenvalue_exact(self) -> bool:
        """Whether :meth:`min_eigenvalue` is λ_min itself rather than a lower bound (default:
        a bound; the structures that compute it exactly say so)."""
        return False

    @abstractmethod
    def _add_same(self, other: Any) -> Curvature:
        """Exact sum with an operator of the same structure and layout."""

    @abstractmethod
    def _promote(self, other: Curvature) -> Curvature:
        """``other`` (of lower rank) expressed exactly in this structure and layout."""

    # ----- algebra ---------------------------------------------------------------------------
    def __add__(self, other: object) -> Curvature:
        identity = PROVIDED.identity  # ScaledIdentity
        if isinstance(other, (int, float)):
            other = identity(float(other))
        if not isinstance(other, Curvature):
            return NotImplemented
        if isinstance(other, identity) and other.delta == 0.0:
            return self  # adding the zero operator must not add a term (e.g. to K-FAC)
        if isinstance(self, identity) and self.delta == 0.0:
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
            promoted = high._promote(low) if low.rank < high.rank else low
            total = high._add_same(promoted)
        except (
            IncompatibleStructures
        ):  # no structure holds both exactly: keep them as a lazy exact sum
            total = PROVIDED.lazy_sum([high, low])
        if total is not self and total is not other:  # never re-label an operand
            total._remember_precision(self.coarsest_dtype, other.coarsest_dtype)
        return total

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
        return PROVIDED.save(self, path)

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

    @property
    def coarsest_dtype(self) -> torch.dtype | None:
        """The coarsest floating dtype (largest machine epsilon) this curvature's values have
        passed through: its own dtype, or a coarser one it was built in before a ``to(dtype)``,
        or that of a term of a sum or of a block. ``None`` for δ·I (a Python float).

        Example:
            >>> import torch, gradmerge as gm
            >>> F = gm.Diagonal({"w": torch.tensor([1.0, 2.0])})             # float32
            >>> (F.to(dtype=torch.float64) + 1.0).coarsest_dtype
            torch.float32
        """
        own, _ = self._dtype_device()
        parts = (c.coarsest_dtype for c in self._components())
        return coarsest_dtype(own, self._coarsest_seen, *parts)

    def _remember_precision(self, *dtypes: torch.dtype | None) -> None:
        """Record that this operator's values have passed through ``dtypes``."""
        self._coarsest_seen = coarsest_dtype(self._coarsest_seen, *dtypes)

    def _components(self) -> Sequence[Curvature]:
        """The operators a composite structure is made of (blocks, terms); none by default."""
        return ()

    def check_psd(self, *, name: str, rtol: float | None = None) -> None:
        """Raise :class:`NotPositiveDefiniteError` if ``C`` has a clearly negative eigenvalue.

        Eigenvalues down to ``−rtol · max(1, |λ_max|)`` are accepted as round-off. ``rtol``
        defaults to 100 × the machine epsilon of :attr:`coarsest_dtype`: a float32 estimate
        cast to float64 is still judged at float32's precision, which is all its values carry
        (its round-off eigenvalues reach about −ε₃₂‖C‖, far below float64's tolerance).
        """
        lam = self.min_eigenvalue()
        dtype = self.coarsest_dtype
        eps = torch.finfo(dtype if dtype is not None else torch.float64).eps
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


class _Provided:
    """What the algebra and ``save`` need from modules that import this one (so this one cannot
    import them): δ·I (:class:`~gradmerge.curvature.identity.ScaledIdentity`), the lazy exact
    sum (:class:`~gradmerge.curvature.lazy.Sum`) and the file writer
    (:func:`~gradmerge.curvature.io.save_curvature`). The package's ``__init__``, which Python
    runs before any of its modules, provides them (:func:`provide`) once it has imported them."""

    identity: type[ScaledIdentity]
    lazy_sum: type[Sum]
    save: Callable[[Curvature, str | os.PathLike[str]], Path]


PROVIDED = _Provided()


def provide(
    *,
    identity: type[ScaledIdentity],
    lazy_sum: type[Sum],
    save: Callable[[Curvature, str | os.PathLike[str]], Path],
) -> None:
    """Give the algebra its δ·I and lazy-sum structures and ``save`` its writer
    (:class:`_Provided`)."""
    PROVIDED.identity, PROVIDED.lazy_sum, PROVIDED.save = identity, lazy_sum, save


def coarsest_dtype(*dtypes: torch.dtype | None) -> torch.dtype | None:
    """The floating dtype with the largest machine epsilon among ``dtypes`` (``None`` ignored;
    ``None`` if there is none).

    Example:
        >>> import torch
        >>> coarsest_dtype(torch.float64, None, torch.float32)
        torch.float32
    """
    known = [d for d in dtypes if d is not None]
    return max(known, key=lambda d: torch.finfo(d).eps) if known else None


def _carrying_precision(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a ``to`` or ``scaled``), its result remembering the operand's precision."""

    @functools.wraps(method)
    def derived(self: Curvature, *args: Any, **kwargs: Any) -> Any:
        out = method(self, *args, **kwargs)
        if isinstance(out, Curvature) and out is not self:
            out._remember_precision(self.coarsest_dtype)
        return out

    derived._carries_precision = True  # type: ignore[attr-defined]
    return derived


def _describe(layout: Layout) -> str:
    """The first names of a layout and how many tensors it covers, for messages."""
    return f"{key_list([k for k, _ in layout], 3)} ({len(layout)} tensors)"
