"""Errors of the checkpoint layer (configuration files, missing inputs, existing outputs).

Each is a :class:`gradmerge.errors.GradmergeError` and also the built-in exception a caller would
catch for the same situation (``FileNotFoundError``, ``FileExistsError``, ``ValueError``).
"""

from __future__ import annotations

from gradmerge.errors import ArgumentError, GradmergeError


class ConfigError(ArgumentError):
    """A merge/remove configuration with an unknown key, a missing one, or an unusable value."""


class MissingInputError(GradmergeError, FileNotFoundError):
    """A checkpoint, curvature or gradient path that does not exist."""


class OutputExistsError(GradmergeError, FileExistsError):
    """The output folder exists and overwriting was not asked for."""
