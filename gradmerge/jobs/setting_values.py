"""One declared setting's value, read from a job's YAML (:func:`read_one`): a scalar checked by
its :class:`~gradmerge.foundation.settings.Setting`, a path, a size, a device, or a mapping of its
own — a precision term δ·I + s·C (:func:`read_term`), ``solver:`` (a
:class:`gradmerge.KroneckerCG`), a re-merge's ``without``.

Example:
    >>> from gradmerge.jobs.yaml_reader import Reader
    >>> r = Reader({"prior": {"delta": 1e-6}}, "the merge config", Path("."), False)
    >>> read_term(r, "prior", required=True)
    CurvatureTerm(delta=1e-06, curvature=None, scale=1.0)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradmerge.errors import ConfigError
from gradmerge.foundation.settings import REQUIRED, Setting, check, declared, default_of
from gradmerge.jobs.inputs import CurvatureTerm
from gradmerge.jobs.yaml_reader import Reader
from gradmerge.solvers.spec import KroneckerCG, refuse_renamed
from gradmerge.solvers.spec import checked as checked_solver


def read_one(r: Reader, key: str, s: Setting, default: Any) -> Any:
    """One setting's value (``default`` where it is absent), checked by its declaration."""
    if s.kind in ("path", "file"):
        return r.path(key, kind=s.kind if s.kind == "file" else "any", default=default)
    if s.kind == "size":
        return r.size(key, default=default)
    if s.kind == "device":
        return r.device(key)
    if s.kind in ("mapping", "selection"):
        return _NESTED[key](r, key, default)
    value = r._get(key, default)
    if value is None and default is None:
        return None
    return check(s, value, r._name(key), ConfigError)


def _term_or_default(r: Reader, key: str, default: Any) -> CurvatureTerm | None:
    return read_term(r, key, required=default is REQUIRED)


def _solver(r: Reader, key: str, default: Any) -> KroneckerCG:
    """``solver:``, the fields of :class:`gradmerge.KroneckerCG` (the K-FAC solves' solver) one
    to one, each checked by its declaration (:func:`gradmerge.solvers.spec.checked`, naming
    ``solver.KEY``)."""
    if r.data.get(key) is None:
        return KroneckerCG()
    s = r.sub(r.data[key], key)
    refuse_renamed(s.data, key, ConfigError)
    s.allow(*declared(KroneckerCG))
    given = {k: v for k, v in s.data.items() if v is not None}
    return KroneckerCG(**checked_solver(given, key, ConfigError))


def _curvature_sum(r: Reader, key: str, default: Any) -> Path | tuple[Path, ...] | None:
    """``curvature`` of a precision term: one file, or a non-empty list whose SUM is C."""
    listed = r.data.get(key)
    if not isinstance(listed, list):
        return r.path(key, kind="file", default=None)
    if not listed:
        raise ConfigError(
            f"`{r._name(key)}` is an empty list: give a curvature file, or a list of "
            "files whose sum is the curvature"
        )
    return tuple(r.sub({"": v}, f"{key}[{i}]").path("", kind="file") for i, v in enumerate(listed))


def _without(r: Reader, key: str, default: Any) -> list[Any]:
    """``without`` of ``remerge``, as listed
    (:func:`gradmerge.jobs.config.remerge_config` resolves each entry)."""
    listed = r.data.get(key)
    if not isinstance(listed, list) or not listed:
        raise ConfigError(
            f"`{key}` must be a non-empty list of the merge's models to leave out: indices into "
            "its `models` (0-based) or their `model` paths, e.g. `without: [1]`"
        )
    return listed


_NESTED = {
    "prior": _term_or_default,
    "remaining": _term_or_default,
    "solver": _solver,
    "without": _without,
}
"""Readers of the settings that are mappings (or lists) of their own."""


def read_term(r: Reader, key: str, *, required: bool) -> CurvatureTerm | None:
    """A precision term δ·I + s·C under ``key`` (:class:`CurvatureTerm`, read by its
    declarations); refused where it is zero."""
    if key not in r.data:
        if required:
            raise ConfigError(
                f"{r.where} needs `{key}`, e.g. `{key}: {{delta: 1.0e-6}}` (δ·I) or "
                f"`{key}: {{delta: 1.0e-6, curvature: path/to/file.curvature.safetensors}}`"
            )
        return None
    t = r.sub(r.data[key], key)
    settings = declared(CurvatureTerm)
    t.allow(*settings)
    term = CurvatureTerm(
        delta=read_one(t, "delta", settings["delta"], default_of(CurvatureTerm, "delta")),
        curvature=_curvature_sum(t, "curvature", None),
        scale=read_one(t, "scale", settings["scale"], default_of(CurvatureTerm, "scale")),
    )
    if term.delta == 0.0 and (term.curvature is None or term.scale == 0.0):
        raise ConfigError(
            f"{t.where} is zero: give `delta` > 0 (δ·I) and/or a `curvature` with scale > 0"
        )
    return term
