"""Curvature operators: one file per structure, all behind :class:`Curvature`."""

from gradmerge.curvature.base import Curvature, provide
from gradmerge.curvature.blocks import Blocks
from gradmerge.curvature.dense import Dense
from gradmerge.curvature.diagonal import Diagonal
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.curvature.io import load_curvature, save_curvature
from gradmerge.curvature.kfac import KFAC
from gradmerge.curvature.lazy import Sum

provide(identity=ScaledIdentity, lazy_sum=Sum, save=save_curvature)  # base.py cannot import them

__all__ = [
    "KFAC",
    "Blocks",
    "Curvature",
    "Dense",
    "Diagonal",
    "ScaledIdentity",
    "Sum",
    "load_curvature",
    "save_curvature",
]
