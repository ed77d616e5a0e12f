"""Diagonal curvature: one non-negative value per parameter (e.g. the paper's diagonal Fisher)."""

from __future__ import annotations

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature.base import Curvature, IncompatibleStructures
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.errors import not_pd
from gradmerge.params import Layout, Params


class Diagonal(Curvature):
    """The operator ``diag(d)`` with ``d`` given per parameter tensor.

    ``values[k]`` has the shape of parameter ``k``; ``mv(v)[k] = values[k] * v[k]`` and
    ``solve(v)[k] = v[k] / values[k]`` (exact, elementwise).

    Args:
        values: dict of finite floating tensors on one device, in one dtype.

    Example:
        >>> import torch, gradmerge as gm
        >>> F = gm.Diagonal({"w": torch.tensor([1.0, 4.0])})
        >>> (F + 1.0).solve({"w": torch.tensor([2.0, 5.0])})
        {'w': tensor([1., 1.])}
    """

    rank = 1

    def __init__(self, values: Params) -> None:
        P.check_params(values, name="Diagonal values")
        self.values: dict[str, Tensor] = dict(values)
        self._layout = P.layout_of(self.values)

    @classmethod
    def _of(cls, values: dict[str, Tensor]) -> Diagonal:
        """A Diagonal over ``values`` without the pass that checks them: values derived from
        checked ones (the algebra builds many intermediates, and re-checking each would re-read
        every value), or read from a file whose reader checks them where they are used
        (:func:`unchecked`)."""
        out = cls.__new__(cls)
        out.values = values
        out._layout = P.layout_of(values)
        return out

    def __repr__(self) -> str:
        return f"Diagonal({len(self.values)} tensors, {P.numel(self.values)} values)"

    @property
    def layout(self) -> Layout:
        return self._layout

    def _check(self, v: Params) -> None:
        P.check_compatible(self.values, v, ref_name="the curvature", name="the vector")

    def mv(self, v: Params) -> dict[str, Tensor]:
        self._check(v)
        return {k: self.values[k] * v[k] for k in self.values}

    def solve(self, v: Params) -> dict[str, Tensor]:
        self._check(v)
        for k, d in self.values.items():
            if not bool((d > 0).all()):
                bad = int((d <= 0).sum())
                raise not_pd(
                    "diagonal system",
                    f"{bad} of {d.numel()} entries of {k!r} are ≤ 0, smallest {float(d.min()):.3e}",
                )
        return {k: v[k] / self.values[k] for k in self.values}

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Diagonal:
        moved = {k: d.to(device=device, dtype=dtype) for k, d in self.values.items()}
        # a cast to a dtype of no smaller range (and any move) keeps finite values finite
        same_range = all(
            torch.finfo(m.dtype).max >= torch.finfo(d.dtype).max
            for m, d in zip(moved.values(), self.values.values(), strict=True)
        )
        return Diagonal._of(moved) if same_range else Diagonal(moved)

    def scaled(self, c: float) -> Diagonal:
        if c == 1.0:  # 1·d = d exactly: no pass over memory
            return Diagonal._of(dict(self.values))
        return Diagonal._of({k: c * d for k, d in self.values.items()})

    def shifted(self, scale: float, delta: float) -> Curvature:
        """``scale·D + δ·I`` (a prior δ·I + s·C), its values formed only where they are used.

        The result is a :class:`ShiftedDiagonal`: any use of its values forms them exactly as
        ``self.scaled(scale) + delta`` does (the same tensors, bit for bit), while the diagonal
        merge (:func:`gradmerge.gradient_matching` with elementwise curvatures) reads D once and
        forms each value inside its loop, never writing them to memory. Values of other dtypes
        than float32/float64, and δ = 0, are formed at once.

        Example:
            >>> import torch, gradmerge as gm
            >>> C = gm.Diagonal({"w": torch.tensor([1.0, 4.0])})
            >>> H0 = C.shifted(0.5, 1e-3)
            >>> torch.equal(H0.values["w"], (C.scaled(0.5) + 1e-3).values["w"])
            True
        """
        formed = delta == 0.0 or any(
            d.dtype not in (torch.float32, torch.float64) for d in self.values.values()
        )
        if formed:
            return self.scaled(scale) + float(delta)
        return ShiftedDiagonal(self, scale, delta)

    @property
    def min_eigenvalue_exact(self) -> bool:
        return True

    def __add__(self, other: object) -> Curvature:
        """``D + δ·I`` in one pass over memory for float32/float64 values (``d + δ`` rounds δ to
        the values' dtype, as the promoted full tensor of δ would: the same result bit for bit);
        any other sum as :meth:`Curvature.__add__`."""
        delta = other.delta if isinstance(other, ScaledIdentity) else other
        if (
            isinstance(delta, (int, float))
            and delta != 0.0
            and all(d.dtype in (torch.float32, torch.float64) for d in self.values.values())
        ):
            total = Diagonal._of({k: d + float(delta) for k, d in self.values.items()})
            total._remember_precision(self.coarsest_dtype)
            return total
        return super().__add__(other)

    __radd__ = __add__

    def min_eigenvalue(self) -> float:
        return min(float(d.min()) for d in self.values.values())

    def _scale(self) -> float:
        return max(float(d.abs().max()) for d in self.values.values())

    def _dtype_device(self) -> tuple[torch.dtype, torch.device]:
        d = next(iter(self.values.values()))
        return d.dtype, d.device

    def _like(self) -> dict[str, Tensor]:
        return self.values

    def _add_same(self, other: Diagonal) -> Diagonal:
        P.check_compatible(self.values, other.values, ref_name="Diagonal", name="Diagonal")
        return Diagonal._of(P.add(self.values, other.values))

    def _promote(self, other: Curvature) -> Diagonal:
        if not isinstance(other, ScaledIdentity):
            raise IncompatibleStructures(f"cannot express {type(other).__name__} as a Diagonal")
        return Diagonal._of({k: torch.full_like(d, other.delta) for k, d in self.values.items()})


class ShiftedDiagonal(Diagonal):
    """``scale·diag(c) + δ·I`` kept as (``unshifted`` = diag(c), ``scale``, ``delta``) until its
    values are needed; made by :meth:`Diagonal.shifted`.

    ``values`` forms (once) ``unshifted.scaled(scale) + delta``: every operation of
    :class:`Diagonal` sees exactly the values of that eager expression. The diagonal merge of
    :mod:`gradmerge.elementwise.matching` instead hands c, scale and δ to its C loop, which forms
    each h = (c·scale) + δ with the same roundings where it is used (one read of c, no write).
    The coarsest dtype is that of ``unshifted`` (as for the eager sum).

    Example:
        >>> import torch, gradmerge as gm
        >>> H0 = gm.Diagonal({"w": torch.tensor([1.0, 4.0])}).shifted(2.0, 1.0)
        >>> H0.formed, H0.values["w"].tolist(), H0.formed
        (False, [3.0, 9.0], True)
    """

    def __init__(self, unshifted: Diagonal, scale: float, delta: float) -> None:
        self.unshifted, self.scale, self.delta = unshifted, float(scale), float(delta)
        self._layout = unshifted.layout
        self._formed: dict[str, Tensor] | None = None
        self._remember_precision(unshifted.coarsest_dtype)

    def __repr__(self) -> str:
        return f"{self.scale:g}·{self.unshifted!r} + {self.delta:g}·I"

    @property
    def formed(self) -> bool:
        """Whether the values have been formed (in memory)."""
        return self._formed is not None

    @property
    def values(self) -> dict[str, Tensor]:
        if self._formed is None:
            total = self.unshifted.scaled(self.scale) + self.delta
            assert isinstance(total, Diagonal)  # D + δ·I, δ ≠ 0, float32/float64: Diagonal.__add__
            self._formed = total.values
        return self._formed

    @values.setter
    def values(self, values: dict[str, Tensor]) -> None:
        self._formed = values

    def _dtype_device(self) -> tuple[torch.dtype, torch.device]:
        return self.unshifted._dtype_device()

    def _like(self) -> dict[str, Tensor]:
        return self.unshifted._like()


def unchecked(values: Params) -> Diagonal:
    """A Diagonal whose values' NaN/Inf check is left to whoever uses them: the streaming engine
    reads curvature files this way (``CurvatureFile.restrict(check_finite=False)``), names a
    non-finite value when a unit's merge fails (:mod:`gradmerge.jobs.opening`), and the diagonal
    merge's own pass catches one without a separate read. Structure (a dict of float tensors on
    one device) is checked.

    Example:
        >>> import torch
        >>> unchecked({"w": torch.tensor([1.0, float("nan")])}).min_eigenvalue_exact
        True
    """
    P.check_params(values, name="Diagonal values", finite=False)
    return Diagonal._of(dict(values))
