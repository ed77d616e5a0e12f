"""Typed errors. Every message says what was expected, what came, and how to fix it."""

from __future__ import annotations


class GradmergeError(Exception):
    """Base class of every error gradmerge raises on bad input."""


class StructureError(GradmergeError, ValueError):
    """Parameter dicts or curvatures whose keys or shapes do not match."""


class DTypeError(GradmergeError, TypeError):
    """A tensor of the wrong (or of a mixed) floating-point dtype."""


class DeviceError(GradmergeError, ValueError):
    """Tensors that live on different devices."""


class NonFiniteError(GradmergeError, ValueError):
    """A NaN or an infinity in an input."""


class ResultOverflowError(NonFiniteError):
    """A computed result that overflowed its dtype to Inf/NaN although every input was finite."""


class NotPositiveDefiniteError(GradmergeError, ValueError):
    """A system that must be solved is singular or not positive definite.

    ``suggested_delta``: a damping δ that would make it solvable, when the check knows one (a
    system refused for eigenvalues below its round-off floor); ``None`` otherwise.
    """

    suggested_delta: float | None = None


class ArgumentError(GradmergeError, ValueError):
    """An argument of the right type but an unusable value (e.g. a wrong number of alphas)."""


class ComparisonError(ArgumentError):
    """A comparison of figures that measure different things (``gradmerge evaluate --compare``
    of a causal LM's next-token accuracy with a classifier's per-example accuracy)."""


class RemovedArgumentError(GradmergeError, TypeError):
    """A keyword argument gradmerge no longer takes (the package is 0.x); the message names what
    replaced it (e.g. ``KFAC(cg_tol=...)``: ``K.solve_info(v, gm.KroneckerCG(tol=...))``)."""


class MovedModuleError(GradmergeError, ModuleNotFoundError):
    """A module path gradmerge no longer has (the package is 0.x); the message names the module's
    new home (``import gradmerge.settings``: ``gradmerge.foundation.settings``)."""


class AdapterBaseError(ArgumentError):
    """A LoRA adapter whose base model cannot be told for certain: a relative
    ``base_model_name_or_path`` that names another model relative to the current directory than
    beside the adapter (name the base explicitly)."""


class EntryPointsNotAllowedError(ArgumentError):
    """A configuration file that names Python entry points (code it would run) read without
    the opt-in that says to trust it as a script (``--allow-entry-points``,
    ``GRADMERGE_ALLOW_ENTRY_POINTS=1``)."""


class DeviceUnavailableError(DeviceError, ArgumentError):
    """A device asked for that this machine does not have (a CUDA device without CUDA, or a
    CUDA index beyond the devices there are)."""


class FileFormatError(GradmergeError, ValueError):
    """A file that is not what it should be: another format, corrupt or truncated."""


class NotConvergedError(GradmergeError, RuntimeError):
    """An iterative solve (conjugate gradients) did not reach its tolerance."""


class MissingExtraError(GradmergeError, ImportError):
    """A feature whose optional dependencies are not installed. The message names the extra that
    brings them (``pip install '.[demo]'`` in a clone); ``extra`` and ``missing`` (the modules that
    failed to import) say the same to code."""

    def __init__(self, message: str, *, extra: str, missing: tuple[str, ...]) -> None:
        super().__init__(message)
        self.extra = extra
        self.missing = missing


class InputWarning(UserWarning):
    """Inputs that are accepted but are probably not what was meant (a model listed twice in a
    merge, a curvature estimated at other weights than the model it is paired with)."""


class SelectionWarning(InputWarning):
    """A label-free choice of a merge's setting (``gradmerge tune``) that may not be what it
    seems: the chosen point on the edge of its grid, or a criterion kept as a diagnostic only."""


class ConfigError(ArgumentError):
    """A merge/remove configuration with an unknown key, a missing one, or an unusable value."""


class MissingInputError(GradmergeError, FileNotFoundError):
    """A checkpoint, curvature or gradient path that does not exist."""


class OutputExistsError(GradmergeError, FileExistsError):
    """The output exists and overwriting was not asked for."""


class OutputOverlapError(ArgumentError):
    """An output that is, lies inside or contains one of the run's inputs: writing it would
    replace, delete or add to that input (:mod:`gradmerge.foundation.guard`). Refused with and
    without ``--overwrite``."""


class OutputWriteError(GradmergeError, OSError):
    """An output that cannot be written: a full disk, a read-only or unwritable folder, a parent
    that is a file, a folder where a file is to go (or the reverse). Nothing partial is left
    (:mod:`gradmerge.foundation.guard`)."""


class InputChangedError(GradmergeError, RuntimeError):
    """An input file that changed (size or modification time) while the run read it: the output
    could mix two versions of it, so it is not written
    (:class:`gradmerge.foundation.guard.Snapshot`)."""


class StepTooLargeError(GradmergeError, ValueError):
    """A removal step far larger than what it undoes: a near-zero curvature direction exploded."""


def not_pd(what: str, detail: str, *, delta: float | None = None) -> NotPositiveDefiniteError:
    """The error for a system that cannot be solved, with the usual fix in its message.

    ``delta``: a damping δ that would lift the system clear of round-off (e.g. 10× the floor it
    fell below), suggested instead of the generic 1e-6 and kept as the error's
    ``suggested_delta``.
    """
    example = f"δ ≥ {delta:.1e}" if delta is not None else "δ > 0 (prior=1e-6 or curvature + 1e-6)"
    err = NotPositiveDefiniteError(
        f"{what} is singular or not positive definite ({detail}). {PD_FIX} {example}, or check "
        "that the curvatures are PSD."
    )
    err.suggested_delta = delta
    return err


PD_FIX = "Add damping, e.g. a prior δ·I with"
"""The start of :func:`not_pd`'s fix, which callers with a better one replace."""
