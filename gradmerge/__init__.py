"""gradmerge: merging and un-merging fine-tuned models by uncertainty-based gradient matching.

Daheim, Möllenhoff, Ponti, Gurevych & Khan, "Model Merging by Uncertainty-Based Gradient
Matching", ICLR 2024. See docs/architecture.md for the map from the paper's notation to these names.
"""

from gradmerge import distributed, params
from gradmerge._fused import fused_kernels
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
from gradmerge.estimate import estimate_curvature, gradient_fn
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
from gradmerge.solvers import Solution

__version__ = "0.1.0"

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
    "load_curvature",
    # curvature estimation (SUMS over examples)
    "estimate_curvature",
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
