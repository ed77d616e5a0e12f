"""δ·I: the isotropic prior precision H_0 = δ·I of the paper, and the zero curvature (δ = 0)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradmerge.curvature.base import Curvature
from gradmerge.errors import NonFiniteError, not_pd
from gradmerge.params import Layout, Params


class ScaledIdentity(Curvature):
    """The operator ``δ·I`` over any parameter dict.

    ``mv(v) = δ v`` and ``solve(v) = v / δ``. It has no layout of its own: it covers whatever dict
    it is applied to, and a sum with a structured curvature takes that curvature's structure.
    A float ``δ`` passed as ``prior`` or ``remaining`` to a merge function means
    ``ScaledIdentity(δ)``.

    Example:
        >>> import torch, gradmerge as gm
        >>> gm.ScaledIdentity(2.0).solve({"w": torch.tensor([4.0])})
        {'w': tensor([2.])}
    """

    rank = 0

    def __init__(self, delta: float) -> None:
        if not math.isfinite(delta):
            raise NonFiniteError(f"δ of a scaled identity must be finite, got {delta}")
        self.delta = float(delta)

    def __repr__(self) -> str:
        return f"ScaledIdentity({self.delta!r})"

    @property
    def layout(self) -> Layout | None:
        return None

    def mv(self, v: Params) -> dict[str, Tensor]:
        return {k: self.delta * x for k, x in v.items()}

    def solve(self, v: Params) -> dict[str, Tensor]:
        if self.delta <= 0:
            raise not_pd("δ·I", f"δ = {self.delta}")
        return {k: x / self.delta for k, x in v.items()}

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> ScaledIdentity:
        return self

    def scaled(self, c: float) -> ScaledIdentity:
        return ScaledIdentity(c * self.delta)

    @property
    def min_eigenvalue_exact(self) -> bool:
        return True

    def min_eigenvalue(self) -> float:
        return self.delta

    def _scale(self) -> float:
        return abs(self.delta)

    def _add_same(self, other: ScaledIdentity) -> ScaledIdentity:
        return ScaledIdentity(self.delta + other.delta)

    def _promote(self, other: Curvature) -> Curvature:  # nothing ranks below
        raise AssertionError("unreachable: ScaledIdentity has the lowest rank")
