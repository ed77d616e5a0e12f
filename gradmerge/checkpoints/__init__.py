"""Checkpoint files: lazy reading, streaming merges and removals, sharded atomic output.

- :func:`open_checkpoint` — a ``.safetensors`` file, a shard folder with its index, or a Hugging
  Face model folder, read tensor by tensor (:mod:`~gradmerge.checkpoints.reader`);
- :class:`MergeConfig`, :class:`RemoveConfig` — strict YAML configurations
  (:mod:`~gradmerge.checkpoints.config`);
- :func:`run_merge`, :func:`run_remove` — the streaming engine: unit by unit (the smallest groups
  of tensors a curvature couples), through the pure rules of :mod:`gradmerge.merge`, into sharded
  safetensors written atomically (:mod:`~gradmerge.checkpoints.engine`).

Example:
    >>> from gradmerge.checkpoints import MergeConfig, run_merge      # doctest: +SKIP
    >>> report = run_merge(MergeConfig.from_yaml("merge.yaml"), "out_dir")  # doctest: +SKIP
"""

from gradmerge.checkpoints.config import (
    CurvatureTerm,
    MergeConfig,
    ModelInput,
    RemoveConfig,
    parse_size,
)
from gradmerge.checkpoints.engine import (
    MergeReport,
    plan_merge,
    plan_remove,
    resolve_device,
    run_merge,
    run_remove,
)
from gradmerge.checkpoints.errors import ConfigError, MissingInputError, OutputExistsError
from gradmerge.checkpoints.plan import Plan, Unit
from gradmerge.checkpoints.reader import Checkpoint, open_checkpoint
from gradmerge.checkpoints.writer import ShardedWriter, staged_output

__all__ = [
    # reading
    "open_checkpoint",
    "Checkpoint",
    # configuration
    "MergeConfig",
    "RemoveConfig",
    "ModelInput",
    "CurvatureTerm",
    "parse_size",
    # running
    "run_merge",
    "run_remove",
    "plan_merge",
    "plan_remove",
    "resolve_device",
    "MergeReport",
    "Plan",
    "Unit",
    # writing
    "ShardedWriter",
    "staged_output",
    # errors
    "ConfigError",
    "MissingInputError",
    "OutputExistsError",
]
