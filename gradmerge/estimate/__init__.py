"""Curvature of a model on data: ``estimate_curvature`` and the estimators behind it.

Every estimate is a SUM over examples (an example is one row of a batch; see
:mod:`gradmerge.estimate._data`); divide by ``int(C.meta["num_examples"])`` for the mean.

- :func:`estimate_curvature`, :func:`estimate_with`, :func:`kfac_curvature` — the one path from
  options to a curvature (:mod:`~gradmerge.estimate.estimator`);
- :class:`EstimateOptions` — every option of an estimate, declared and checked once
  (:mod:`~gradmerge.estimate.options`, which imports no torch: the command line reads its
  declarations to build ``gradmerge curvature``'s flags);
- :func:`estimate_diagonal`, :func:`estimate_kfac_factors`, :func:`estimate_dense`,
  :class:`MatrixFree`, :func:`gradient_fn` — the estimators, one module each.

The names above load on first access (PEP 562), so that importing
:mod:`gradmerge.estimate.options` loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradmerge.foundation.lazy import lazy_names

if TYPE_CHECKING:  # loaded on first access, so that gradmerge.estimate.options needs no torch
    from gradmerge.estimate.dense import estimate_dense
    from gradmerge.estimate.diagonal import estimate_diagonal
    from gradmerge.estimate.estimator import (
        MAX_DIAGONAL_FACTOR,
        estimate_curvature,
        estimate_with,
        kfac_curvature,
    )
    from gradmerge.estimate.gradient import gradient_fn
    from gradmerge.estimate.kfac import KFACFactors, estimate_kfac_factors
    from gradmerge.estimate.matrix_free import MatrixFree
    from gradmerge.estimate.options import MAX_FACTOR_SIDE, EstimateOptions

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "MAX_FACTOR_SIDE": "gradmerge.estimate.options",
        "EstimateOptions": "gradmerge.estimate.options",
        "MAX_DIAGONAL_FACTOR": "gradmerge.estimate.estimator",
        "estimate_curvature": "gradmerge.estimate.estimator",
        "estimate_with": "gradmerge.estimate.estimator",
        "kfac_curvature": "gradmerge.estimate.estimator",
        "estimate_dense": "gradmerge.estimate.dense",
        "estimate_diagonal": "gradmerge.estimate.diagonal",
        "estimate_kfac_factors": "gradmerge.estimate.kfac",
        "KFACFactors": "gradmerge.estimate.kfac",
        "MatrixFree": "gradmerge.estimate.matrix_free",
        "gradient_fn": "gradmerge.estimate.gradient",
    },
)

__all__ = [
    "MAX_DIAGONAL_FACTOR",
    "MAX_FACTOR_SIDE",
    "KFACFactors",
    "EstimateOptions",
    "MatrixFree",
    "estimate_curvature",
    "estimate_dense",
    "estimate_diagonal",
    "estimate_kfac_factors",
    "estimate_with",
    "gradient_fn",
    "kfac_curvature",
]
