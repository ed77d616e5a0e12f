"""Jobs over checkpoint files: YAML configurations, planning, the streaming engine, dry runs,
refine.

- :class:`MergeConfig`, :class:`RemoveConfig` — strict YAML configurations
  (:mod:`~gradmerge.jobs.config`);
- :func:`run_merge`, :func:`run_remove` — the streaming engine: unit by unit (the smallest groups
  of tensors a curvature couples, :mod:`~gradmerge.jobs.plan`), through the pure rules of
  :mod:`gradmerge.merge` (each method's rule, :mod:`gradmerge.methods`), into sharded safetensors
  written atomically (:mod:`~gradmerge.jobs.engine`);
- :mod:`~gradmerge.jobs.conditioning` — the ``--dry-run`` check of every unit's linear system;
- :mod:`~gradmerge.jobs.refine` — the refinement workflow over files (data, estimation, merge).

Files are read and written through :mod:`gradmerge.io`.

Example:
    >>> from gradmerge.jobs import MergeConfig, run_merge             # doctest: +SKIP
    >>> report = run_merge(MergeConfig.from_yaml("merge.yaml"), "out_dir")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradmerge.foundation.lazy import lazy_names

if TYPE_CHECKING:  # loaded on first access (__getattr__ below)
    from gradmerge.jobs.config import MergeConfig, RemoveConfig
    from gradmerge.jobs.engine import (
        MergeReport,
        plan_merge,
        plan_remove,
        run_merge,
        run_remove,
    )
    from gradmerge.jobs.inputs import CurvatureTerm, ModelInput
    from gradmerge.jobs.plan import Plan, Unit
    from gradmerge.jobs.yaml_reader import parse_size

_LAZY = {
    **dict.fromkeys(("MergeConfig", "RemoveConfig"), "config"),
    **dict.fromkeys(("CurvatureTerm", "ModelInput"), "inputs"),
    "parse_size": "yaml_reader",
    **dict.fromkeys(("MergeReport", "plan_merge", "plan_remove", "run_merge"), "engine"),
    "run_remove": "engine",
    "Plan": "plan",
    "Unit": "plan",
}
"""Public names and their modules, imported on first access (PEP 562), so that a command that
only lists the methods (:mod:`gradmerge.methods.registry`) does not load the engine."""


__getattr__, __dir__ = lazy_names(__name__, {n: f"{__name__}.{m}" for n, m in _LAZY.items()})


__all__ = [
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
    "MergeReport",
    "Plan",
    "Unit",
]
