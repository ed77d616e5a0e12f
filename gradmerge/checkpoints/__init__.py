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

from gradmerge import io, jobs
from gradmerge._lazy import lazy_names

_NAMES = {
    **dict.fromkeys(io.__all__, "gradmerge.io"),
    **dict.fromkeys(jobs.__all__, "gradmerge.jobs"),
    **dict.fromkeys(("ConfigError", "MissingInputError", "OutputExistsError"), "gradmerge.errors"),
    "resolve_device": "gradmerge._devices",
}
"""Each public name the package held, and where it lives now."""

__getattr__, __dir__ = lazy_names(__name__, _NAMES)
__all__ = list(_NAMES)

warnings.warn(
    "gradmerge.checkpoints is deprecated: import from gradmerge.io (reading, writing) and "
    "gradmerge.jobs (configurations, run_merge, run_remove) instead",
    DeprecationWarning,
    stacklevel=2,
)
