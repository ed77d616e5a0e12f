"""gradmerge: merging and un-merging fine-tuned models by uncertainty-based gradient matching.

Daheim, Möllenhoff, Ponti, Gurevych & Khan, "Model Merging by Uncertainty-Based Gradient
Matching", ICLR 2024. See docs/architecture.md for the map from the paper's notation to these names.

The checkpoint machinery (``gm.run_merge``, ``gm.MergeConfig``, ...) and ``gm.distributed`` load
on first use, so that ``import gradmerge`` stays light for the in-memory rules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradmerge import params
from gradmerge._fused import fused_kernels
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
from gradmerge.errors import (
    ArgumentError,
    DeviceError,
    DTypeError,
    FileFormatError,
    GradmergeError,
    InputWarning,
    NonFiniteError,
    NotConvergedError,
    NotPositiveDefiniteError,
    ResultOverflowError,
    StructureError,
)
from gradmerge.estimate import EstimateOptions, estimate_curvature, gradient_fn
from gradmerge.estimate.matrix_free import MatrixFree
from gradmerge.merge import (
    fisher_average,
    gradient_matching,
    influence_remove,
    refine,
    regmean,
    remove,
    task_arithmetic,
)
from gradmerge.solvers import Solution, SolverSpec

if TYPE_CHECKING:  # loaded lazily at run time (__getattr__ below)
    from gradmerge import distributed
    from gradmerge.checkpoints import (
        ConfigError,
        MergeConfig,
        MergeReport,
        MissingInputError,
        OutputExistsError,
        RemoveConfig,
        open_checkpoint,
        run_merge,
        run_remove,
    )

__version__ = "0.1.0"

_MODULES = ("distributed", "checkpoints")
_LAZY = {
    **{name: f"gradmerge.{name}" for name in _MODULES},
    **{
        name: "gradmerge.checkpoints"
        for name in (
            "ConfigError",
            "MergeConfig",
            "MergeReport",
            "MissingInputError",
            "OutputExistsError",
            "RemoveConfig",
            "open_checkpoint",
            "run_merge",
            "run_remove",
        )
    },
}
"""Public names whose modules are imported on first access (PEP 562)."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradmerge' has no attribute {name!r}")
    value = importlib.import_module(module)
    if name not in _MODULES:
        value = getattr(value, name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    # merge and removal rules (Eq. 6, Eq. 13, Koh & Liang)
    "task_arithmetic",
    "fisher_average",
    "gradient_matching",
    "remove",
    "influence_remove",
    "refine",
    "regmean",
    "fused_kernels",
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
    # parameter-dict algebra
    "params",
    # data-parallel estimation on torch.distributed (gm.distributed.estimate_curvature, ...)
    "distributed",
    # errors
    "GradmergeError",
    "InputWarning",
    "StructureError",
    "DTypeError",
    "DeviceError",
    "FileFormatError",
    "NonFiniteError",
    "NotConvergedError",
    "NotPositiveDefiniteError",
    "ResultOverflowError",
    "ArgumentError",
    # checkpoint files: lazy reading, streaming merges and removals
    "open_checkpoint",
    "MergeConfig",
    "RemoveConfig",
    "run_merge",
    "run_remove",
    "MergeReport",
    "ConfigError",
    "MissingInputError",
    "OutputExistsError",
]
