"""gradmerge: merging and un-merging fine-tuned models by uncertainty-based gradient matching.

Daheim, Möllenhoff, Ponti, Gurevych & Khan, "Model Merging by Uncertainty-Based Gradient
Matching", ICLR 2024. See docs/architecture.md for the map from the paper's notation to these names.

Every public name loads on first use (``gm.gradient_matching`` imports torch and the in-memory
rules; ``gm.run_merge``, ``gm.MergeConfig``, ... the checkpoint machinery of ``gm.jobs``;
``gm.open_checkpoint`` ``gm.io``), so that ``import gradmerge`` loads the errors and the version
only and the ``gradmerge`` command answers ``--help`` without importing torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gradmerge._version import __version__ as __version__
from gradmerge.errors import (
    ArgumentError,
    ComparisonError,
    ConfigError,
    DeviceError,
    DTypeError,
    FileFormatError,
    GradmergeError,
    InputChangedError,
    InputWarning,
    MissingExtraError,
    MissingInputError,
    MovedModuleError,
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
from gradmerge.foundation.lazy import lazy_names, refuse_moved

if TYPE_CHECKING:  # loaded lazily at run time (__getattr__ below)
    from gradmerge import distributed, io, jobs, kernels, params
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
    from gradmerge.estimate import EstimateOptions, estimate_curvature, gradient_fn
    from gradmerge.estimate.matrix_free import MatrixFree
    from gradmerge.evaluation import Evaluation, evaluate
    from gradmerge.io import open_checkpoint
    from gradmerge.jobs import MergeConfig, MergeReport, RemoveConfig, run_merge, run_remove
    from gradmerge.kernels import fused_kernels
    from gradmerge.merge.matching import (
        Merged,
        fisher_average,
        gradient_matching,
        task_arithmetic,
    )
    from gradmerge.merge.refinement import refine
    from gradmerge.merge.regression import regmean
    from gradmerge.merge.removal import influence_remove, remove
    from gradmerge.merge.report import with_solution
    from gradmerge.merge.spectral import iso_c, iso_cts, tsv_merge
    from gradmerge.solvers import CG, KroneckerCG, Result, Solution, Solver, SolverSpec

_MODULES = (
    *("distributed", "io", "jobs", "kernels", "params"),
    # subpackages named in the docs (gm.merge.REGMEAN_OFF_DIAGONAL, gm.curvature.io, ...)
    *("curvature", "merge", "spectral", "estimate", "solvers", "diagnostics", "evaluation"),
)
_LAZY = {
    **{name: f"gradmerge.{name}" for name in _MODULES},
    "spectral": "gradmerge.merge.spectral",  # gm.spectral: the module's home before merge/
    **dict.fromkeys(
        ("KFAC", "Blocks", "Curvature", "Dense", "Diagonal", "ScaledIdentity", "Sum"),
        "gradmerge.curvature",
    ),
    "load_curvature": "gradmerge.curvature",
    **dict.fromkeys(
        ("GradientFn", "GradientMismatch", "gradient_mismatch"), "gradmerge.diagnostics"
    ),
    **dict.fromkeys(("EstimateOptions", "estimate_curvature", "gradient_fn"), "gradmerge.estimate"),
    "MatrixFree": "gradmerge.estimate.matrix_free",
    **dict.fromkeys(("Evaluation", "evaluate"), "gradmerge.evaluation"),
    "open_checkpoint": "gradmerge.io",
    **dict.fromkeys(
        ("MergeConfig", "MergeReport", "RemoveConfig", "run_merge", "run_remove"), "gradmerge.jobs"
    ),
    "fused_kernels": "gradmerge.kernels",
    **dict.fromkeys(
        ("Merged", "fisher_average", "gradient_matching", "task_arithmetic"),
        "gradmerge.merge.matching",
    ),
    "refine": "gradmerge.merge.refinement",
    "regmean": "gradmerge.merge.regression",
    **dict.fromkeys(("influence_remove", "remove"), "gradmerge.merge.removal"),
    "with_solution": "gradmerge.merge.report",
    **dict.fromkeys(
        ("CG", "KroneckerCG", "Result", "Solution", "Solver", "SolverSpec"), "gradmerge.solvers"
    ),
    **dict.fromkeys(("iso_c", "iso_cts", "tsv_merge"), "gradmerge.merge.spectral"),
}
"""Public names whose modules are imported on first access (PEP 562): ``import gradmerge`` loads
the errors and the version only, so that the command line parses its arguments and prints its
help without torch (``gradmerge --help``); the first ``gm.NAME`` loads what NAME needs."""


_load, __dir__ = lazy_names(__name__, _LAZY, _MODULES)

# public module paths that moved, refused with their new home (MovedModuleError); the private
# helpers (gradmerge._guard, ...) moved to gradmerge.foundation without one
refuse_moved({"gradmerge.settings": "gradmerge.foundation.settings"})


def __getattr__(name: str) -> Any:
    """``gm.NAME``: its module imported on first access (:data:`_LAZY`); once the in-memory rules
    are loaded, their default ``kernel=`` asks the streaming engine's chooser (:func:`_plug`)."""
    value = _load(name)
    _plug()
    return value


def _plug() -> None:
    """The in-memory rules' default ``kernel=`` (``elementwise.matching.SELECTED``) asks
    :func:`_engine_kernel`, once their module is loaded (this imports nothing: a rule reached
    through ``gm.NAME`` loaded it): the core compiles nothing of itself, the facade chooses."""
    matching = sys.modules.get("gradmerge.elementwise.matching")
    if matching is not None and matching.SELECTED.choose is None:
        matching.SELECTED.choose = _engine_kernel


def _engine_kernel(numels: Sequence[int]) -> Any:
    """The kernel the streaming engine takes for tensors of these sizes
    (:func:`gradmerge.kernels.select`, from the mode in force), for the in-memory rules' default
    ``kernel=``; :mod:`gradmerge.kernels` loads on the first diagonal merge, not on import."""
    from gradmerge.kernels import select

    return select(numels)


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
    # solvers: one object per algorithm, passed to the call that solves; one Solution
    "Solver",
    "CG",
    "KroneckerCG",
    "SolverSpec",
    "Solution",
    "Result",
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
    "ComparisonError",
    "RemovedArgumentError",
    "MovedModuleError",
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
