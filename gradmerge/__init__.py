"""gradmerge: merging and un-merging fine-tuned models by uncertainty-based gradient matching.

Daheim, Möllenhoff, Ponti, Gurevych & Khan, "Model Merging by Uncertainty-Based Gradient
Matching", ICLR 2024. See docs/architecture.md for the map from the paper's notation to these names.

The checkpoint machinery (``gm.run_merge``, ``gm.MergeConfig``, ... of ``gm.jobs``;
``gm.open_checkpoint`` of ``gm.io``) and ``gm.distributed`` load on first use, so that
``import gradmerge`` stays light for the in-memory rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradmerge import params
from gradmerge._lazy import lazy_names
from gradmerge._version import __version__ as __version__
from gradmerge.curvature import (
    KFAC,
    Blocks,
    Curvature,
    Dense,
    Diagonal,
    ScaledIdentity,
    Sum,
    load_curvature,
)
from gradmerge.diagnostics import GradientFn, GradientMismatch, gradient_mismatch
from gradmerge.elementwise import matching as _elementwise_matching
from gradmerge.errors import (
    ArgumentError,
    ConfigError,
    DeviceError,
    DTypeError,
    FileFormatError,
    GradmergeError,
    InputChangedError,
    InputWarning,
    MissingExtraError,
    MissingInputError,
    NonFiniteError,
    NotConvergedError,
    NotPositiveDefiniteError,
    OutputExistsError,
    OutputOverlapError,
    OutputWriteError,
    RemovedArgumentError,
    ResultOverflowError,
    SelectionWarning,
    StructureError,
)
from gradmerge.estimate import EstimateOptions, estimate_curvature, gradient_fn
from gradmerge.estimate.matrix_free import MatrixFree
from gradmerge.evaluation import Evaluation, evaluate
from gradmerge.merge.matching import Merged, fisher_average, gradient_matching, task_arithmetic
from gradmerge.merge.refinement import refine
from gradmerge.merge.regression import regmean
from gradmerge.merge.removal import influence_remove, remove
from gradmerge.merge.report import with_solution
from gradmerge.solvers import Solution, SolverSpec
from gradmerge.spectral import iso_c, iso_cts, tsv_merge

if TYPE_CHECKING:  # loaded lazily at run time (__getattr__ below)
    from gradmerge import distributed, io, jobs, kernels
    from gradmerge.io import open_checkpoint
    from gradmerge.jobs import MergeConfig, MergeReport, RemoveConfig, run_merge, run_remove
    from gradmerge.kernels import fused_kernels


_MODULES = ("distributed", "io", "jobs", "kernels")
_LAZY = {
    **{name: f"gradmerge.{name}" for name in _MODULES},
    "open_checkpoint": "gradmerge.io",
    "fused_kernels": "gradmerge.kernels",
    **{
        name: "gradmerge.jobs"
        for name in ("MergeConfig", "MergeReport", "RemoveConfig", "run_merge", "run_remove")
    },
}
"""Public names whose modules are imported on first access (PEP 562)."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, _MODULES)


def _engine_kernel(numels: Sequence[int]) -> _elementwise_matching.Kernel | None:
    """The kernel the streaming engine takes for tensors of these sizes
    (:func:`gradmerge.kernels.select`, from the mode in force), for the in-memory rules' default
    ``kernel=``; :mod:`gradmerge.kernels` loads on the first diagonal merge, not on import."""
    from gradmerge.kernels import select

    return select(numels)


# the core compiles nothing: the facade chooses
_elementwise_matching.SELECTED.choose = _engine_kernel


__all__ = [
    # merge and removal rules (Eq. 6, Eq. 13, Koh & Liang)
    "task_arithmetic",
    "fisher_average",
    "gradient_matching",
    "remove",
    "influence_remove",
    "refine",
    "regmean",
    # a solving rule's parameters with the report of its solve
    "with_solution",
    "Merged",
    # data-free merges in each weight matrix's singular basis (TSV-M, Iso-C, Iso-CTS)
    "tsv_merge",
    "iso_c",
    "iso_cts",
    "fused_kernels",
    "kernels",
    # curvature operators
    "Curvature",
    "ScaledIdentity",
    "Diagonal",
    "Dense",
    "KFAC",
    "Blocks",
    "Sum",
    "MatrixFree",
    "Solution",
    "SolverSpec",
    "load_curvature",
    # curvature estimation (SUMS over examples)
    "estimate_curvature",
    "EstimateOptions",
    "gradient_fn",
    # diagnostics (Eq. 2)
    "gradient_mismatch",
    "GradientMismatch",
    "GradientFn",
    # accuracy and mean loss of a model on data
    "evaluate",
    "Evaluation",
    # parameter-dict algebra
    "params",
    # data-parallel estimation on torch.distributed (gm.distributed.estimate_curvature, ...)
    "distributed",
    # errors
    "GradmergeError",
    "InputChangedError",
    "InputWarning",
    "SelectionWarning",
    "MissingExtraError",
    "StructureError",
    "DTypeError",
    "DeviceError",
    "FileFormatError",
    "NonFiniteError",
    "NotConvergedError",
    "NotPositiveDefiniteError",
    "ResultOverflowError",
    "ArgumentError",
    "RemovedArgumentError",
    # checkpoint files: lazy reading (gm.io), streaming merges and removals (gm.jobs)
    "io",
    "jobs",
    "open_checkpoint",
    "MergeConfig",
    "RemoveConfig",
    "run_merge",
    "run_remove",
    "MergeReport",
    "ConfigError",
    "MissingInputError",
    "OutputExistsError",
    "OutputOverlapError",
    "OutputWriteError",
]
