"""Curvature operators: one file per structure, all behind :class:`Curvature`."""

from gradmerge.curvature.base import Curvature
from gradmerge.curvature.dense import Dense
from gradmerge.curvature.diagonal import Diagonal
from gradmerge.curvature.identity import ScaledIdentity

__all__ = ["Curvature", "Dense", "Diagonal", "ScaledIdentity"]
