"""Deprecated alias of :mod:`gradmerge.io` and :mod:`gradmerge.jobs` (the package was split).

Importing it warns (:class:`DeprecationWarning`) and gives the public names it used to hold; its
modules moved: ``checkpoints.reader``/``writer``/``lora``/``official`` → ``gradmerge.io.reader``/
``writer``/``lora``/``official``; ``checkpoints.config``/``plan``/``engine``/
``conditioning``/``refine``/``rules`` → ``gradmerge.jobs.*``; ``checkpoints.errors`` →
:mod:`gradmerge.errors`.

Example:
    >>> from gradmerge.jobs import MergeConfig, run_merge   # instead of gradmerge.checkpoints
"""

import warnings

from gradmerge._devices import resolve_device
from gradmerge.errors import ConfigError, MissingInputError, OutputExistsError
from gradmerge.io import Checkpoint, ShardedWriter, open_checkpoint, staged_output
from gradmerge.jobs import (
    CurvatureTerm,
    MergeConfig,
    MergeReport,
    ModelInput,
    Plan,
    RemoveConfig,
    Unit,
    parse_size,
    plan_merge,
    plan_remove,
    run_merge,
    run_remove,
)

warnings.warn(
    "gradmerge.checkpoints is deprecated: import from gradmerge.io (reading, writing) and "
    "gradmerge.jobs (configurations, run_merge, run_remove) instead",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "open_checkpoint",
    "Checkpoint",
    "MergeConfig",
    "RemoveConfig",
    "ModelInput",
    "CurvatureTerm",
    "parse_size",
    "run_merge",
    "run_remove",
    "plan_merge",
    "plan_remove",
    "resolve_device",
    "MergeReport",
    "Plan",
    "Unit",
    "ShardedWriter",
    "staged_output",
    "ConfigError",
    "MissingInputError",
    "OutputExistsError",
]
