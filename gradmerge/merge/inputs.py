"""The inputs of the merge and removal rules, checked and prepared the same way for every rule.

α_t (real, finite, representable in the parameters' dtype), curvatures (a :class:`Curvature` or a
float δ meaning δ·I, covering the parameters, PSD where asked), task vectors θ_t − θ_LLM, and the
keywords a rule no longer takes; every failure a typed error (:mod:`gradmerge.errors`) naming the
argument. Used by every rule of :mod:`gradmerge.merge` and by :mod:`gradmerge.diagnostics` and
:mod:`gradmerge.merge.spectral`.

Example:
    >>> import torch
    >>> from gradmerge.merge.inputs import checked_alphas
    >>> checked_alphas(0.5, 3)
    [0.5, 0.5, 0.5]
    >>> checked_alphas(["0.5"], 1)
    Traceback (most recent call last):
    ...
    gradmerge.errors.ArgumentError: alphas must be numbers, got '0.5' (str): pass e.g. 0.5, not '0.5'
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import cast

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import Curvature, ScaledIdentity
from gradmerge.errors import PD_FIX, ArgumentError, NotPositiveDefiniteError
from gradmerge.params import Params

CurvatureLike = Curvature | float
"""A curvature operator, or a float δ meaning δ·I."""


def checked_alphas(
    alphas: float | Sequence[float],
    tasks: int,
    *,
    dtype: torch.dtype = torch.float64,
    name: str = "alphas",
) -> list[float]:
    """α_t as floats: real numbers (not strings or bools), finite and representable in ``dtype``
    (the parameters' dtype, in which each α multiplies a tensor)."""
    if isinstance(alphas, Tensor):
        alphas = alphas.tolist()
    iterable = isinstance(alphas, Iterable) and not isinstance(alphas, (str, bytes))
    values: list[object] = list(cast(Iterable[float], alphas)) if iterable else [alphas] * tasks
    if len(values) != tasks:
        raise ArgumentError(
            f"got {len(values)} {name} for {tasks} fine-tuned models: pass one α per model, "
            "or a single number for all"
        )
    for a in values:
        if isinstance(a, bool) or not isinstance(a, numbers.Real):
            raise ArgumentError(
                f"{name} must be numbers, got {a!r} ({type(a).__name__}): pass e.g. 0.5, not '0.5'"
            )
    floats = [float(cast(float, a)) for a in values]
    largest = torch.finfo(dtype).max
    bad = [a for a in floats if not math.isfinite(a) or abs(a) > largest]
    if bad:
        raise ArgumentError(
            f"{name} must be finite numbers of magnitude ≤ {largest:.3e} (the largest "
            f"{str(dtype).removeprefix('torch.')}), got {bad[0]!r}: use a moderate α "
            "(typically 0 < α ≤ 1)"
        )
    return floats


def dtype_of(params: Params) -> torch.dtype:
    return next(iter(params.values())).dtype


@contextmanager
def negative_alphas_named(alphas: Sequence[float]) -> Iterator[None]:
    """Add to a singular-system error that negative α_t subtract curvature from H̄ — the likely
    cause, for which a larger prior is not the first fix."""
    try:
        yield
    except NotPositiveDefiniteError as err:
        negative = [f"alphas[{t}] = {a:g}" for t, a in enumerate(alphas) if a < 0]
        if not negative:
            raise
        cause = str(err).split(PD_FIX)[0]
        raise NotPositiveDefiniteError(
            f"{cause}{', '.join(negative)} < 0 subtracts that task's curvature from "
            "H̄ = H_0 + Σ_t α_t H_t: make |α_t| smaller (or α_t ≥ 0), or make the prior larger "
            "than |α_t| times that curvature."
        ) from err


def task_vector(base: Params, finetuned: Params, *, name: str) -> dict[str, Tensor]:
    P.check_params(finetuned, name=name)
    P.check_compatible(base, finetuned, ref_name="base", name=name)
    return P.sub(finetuned, base)


def checked_curvature(
    value: CurvatureLike, base: Params, *, name: str, psd: bool = True
) -> Curvature:
    if isinstance(value, bool) or not isinstance(value, (Curvature, int, float)):
        raise TypeError(
            f"{name} must be a curvature (gm.Diagonal, gm.Dense, ...) or a float δ meaning δ·I, "
            f"got {type(value).__name__}"
        )
    if isinstance(value, (int, float)):
        check_delta(float(value), dtype_of(base), name=name)
    curvature = ScaledIdentity(float(value)) if isinstance(value, (int, float)) else value
    curvature.check_covers(base, name=name)
    if psd:
        curvature.check_psd(name=name)
    return curvature


def check_delta(delta: float, dtype: torch.dtype, *, name: str) -> None:
    """A float δ (δ·I) must be ≥ 0 (a precision) and, if not 0, a normal number of ``dtype``:
    a subnormal δ carries few significant bits, so products with it are rounded coarsely and
    its reciprocal overflows."""
    if delta < 0:
        raise NotPositiveDefiniteError(
            f"{name} is not positive semi-definite: {name} = {delta:g} is a negative precision "
            f"δ·I, and a prior or curvature precision must be ≥ 0; pass δ ≥ 0 (e.g. "
            f"{name}=1e-6)"
        )
    tiny = torch.finfo(dtype).tiny
    if 0 < delta < tiny:
        raise ArgumentError(
            f"{name} = {delta:g} is below the smallest normal {str(dtype).removeprefix('torch.')} "
            f"number ({tiny:.3e}): products with it lose their precision and its reciprocal "
            f"overflows; pass δ ≥ {tiny:.3e} (typically 1e-6), 0, or float64 parameters"
        )


def refuse_removed(rule: str, removed: Mapping[str, object]) -> None:
    """Name the replacement of a removed keyword (``return_solution``); any other unknown keyword
    is a TypeError, as Python raises it."""
    if "return_solution" in removed:
        raise ArgumentError(
            f"{rule}(return_solution=...) no longer exists: {rule} returns the parameters; for "
            f"them with the solve's report call gm.with_solution(gm.{rule}, <the same "
            "arguments>), which returns a gm.Merged (.params, .solution)"
        )
    if removed:
        raise TypeError(f"{rule}() got an unexpected keyword argument {next(iter(removed))!r}")
