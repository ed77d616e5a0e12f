r"""The systems a merge or removal will solve, checked before it runs (``--dry-run``).

Every merged unit (a tensor, a K-FAC layer, ...) solves one linear system:

- ``gradient_matching``: H̄ = H_0 + Σ_t α_t H_t (``prior`` is H_0 = δI + s·C);
- ``fisher_average``: Σ_t α_t (H_t + damping·I);
- ``remove`` / ``influence_remove``: H̄_\t (``remaining``).

:func:`check_systems` reads only the curvature files (never the models), forms each unit's system
and compares its smallest eigenvalue λ_min (exact for diagonal, dense and K-FAC with one or two
terms per layer; a lower bound for lazy sums) with the floor its solve needs: 0 for a diagonal
(it divides), 100·ε·‖C‖ for a factorised system (round-off of the compute dtype). A unit at or
below the floor would stop the run with "not positive definite"; the report names it and the
damping that lifts it: δ = 2·(floor − λ_min), at least 10⁻⁶·‖C‖, to be set with the YAML key the
method uses (``prior: {delta: ...}``, ``damping:``, ``remaining: {delta: ...}``). RegMean's
Gram systems are not checked.

For ``gradient_matching`` with diagonal curvatures it also compares δ with the curvature: where
δ ≪ Σ_t α_t H_t, H̄⁻¹(H_0 + H_t) ≈ H̄⁻¹H_t and gradient matching gives Fisher averaging's result
(:func:`delta_note`).

Example:
    >>> import tempfile, torch, gradmerge as gm
    >>> from pathlib import Path
    >>> from safetensors.torch import save_file
    >>> from gradmerge.jobs import MergeConfig
    >>> from gradmerge.jobs.conditioning import check_systems
    >>> with tempfile.TemporaryDirectory() as d:
    ...     for name, w in (("a", [1.0, 2.0]), ("b", [2.0, 0.0])):
    ...         save_file({"w": torch.tensor(w)}, f"{d}/{name}.safetensors")
    ...         _ = gm.Diagonal({"w": torch.tensor(w)}).save(f"{d}/{name}.c.safetensors")
    ...     cfg = MergeConfig.from_dict({"method": "fisher_average", "models": [
    ...         {"model": "a.safetensors", "curvature": "a.c.safetensors"},
    ...         {"model": "b.safetensors", "curvature": "b.c.safetensors"}]}, root=d)
    ...     [(c.keys, c.min_eigenvalue) for c in check_systems(cfg)]
    [(('w',), 2.0)]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge.curvature import Curvature, Diagonal, ScaledIdentity
from gradmerge.curvature.io import CurvatureFile
from gradmerge.jobs import methods
from gradmerge.jobs.config import CurvatureTerm, MergeConfig, RemoveConfig
from gradmerge.jobs.engine import open_job

SAMPLE = 4096
"""Values per unit kept for the δ comparison (a strided sample: memory stays bounded)."""


@dataclass(frozen=True)
class SystemCheck:
    """One unit's system: its smallest eigenvalue, the floor its solve needs, the damping that
    would lift it (0 when it is fine) and the YAML key that sets that damping."""

    keys: tuple[str, ...]
    min_eigenvalue: float
    floor: float
    needed: float
    key: str

    @property
    def ok(self) -> bool:
        """Whether the solve will succeed as configured."""
        return self.needed == 0.0

    def describe(self) -> str:
        """One line naming the unit, λ_min, the floor and the fix."""
        head = ", ".join(repr(k) for k in self.keys[:2]) + (" ..." if len(self.keys) > 2 else "")
        return (
            f"[{head}]: λ_min = {self.min_eigenvalue:.3g} ≤ {self.floor:.3g}, singular: set "
            f"`{self.key}` to at least {self.needed:.2g}"
        )


def check_systems(config: MergeConfig | RemoveConfig) -> list[SystemCheck]:
    """Every merged unit's system (module docstring), in the plan's order; empty for a method
    whose record has no ``system`` (task arithmetic, RegMean: :mod:`gradmerge.jobs.methods`)."""
    spec = methods.get(config.method)
    if spec.system is None:
        return []
    key = spec.damping_key or "damping"
    out = []
    for files, keys in _merged_units(config):
        terms = _inputs(config, files, keys, config.math_dtype)
        out.append(_check(keys, spec.system(terms), key, config.math_dtype))
    return out


def _merged_units(
    config: MergeConfig | RemoveConfig,
) -> Iterator[tuple[dict[str, CurvatureFile], tuple[str, ...]]]:
    """The curvature files and the keys of every merged unit of the plan, in its order (the
    files stay open while the iteration runs)."""
    with ExitStack() as stack:
        job = open_job(config, stack)
        for unit in job.plan.units:
            if unit.merged:
                yield job.curvatures, unit.keys


def delta_note(config: MergeConfig) -> str | None:
    """A warning when gradient matching's δ is so small next to diagonal curvatures that it
    equals Fisher averaging: δ below 10⁻³ of the 10th percentile of the positive entries of
    Σ_t α_t H_t. None otherwise (or with no diagonal curvature, or a method without a prior)."""
    if config.prior is None:
        return None
    samples: list[Tensor] = []
    for files, keys in _merged_units(config):
        parts = _models(config, files, keys, torch.float64)
        if parts and all(isinstance(p, Diagonal) for p in parts):
            total = sum(parts[1:], parts[0])
            assert isinstance(total, Diagonal)
            for values in total.values.values():
                flat = values.flatten()
                samples.append(flat[:: max(1, flat.numel() // SAMPLE)])
    if not samples:
        return None
    positive = torch.cat(samples)
    positive = positive[positive > 0]
    if positive.numel() == 0:
        return None
    p10 = float(torch.quantile(positive, 0.1))
    delta = config.prior.delta
    if delta >= 1e-3 * p10:
        return None
    return (
        f"prior δ = {delta:.3g} is below 10⁻³ of the curvatures' 10th percentile ({p10:.3g}, "
        "positive diagonal entries of Σ α_t H_t): on at least 90% of those coordinates gradient "
        "matching gives Fisher averaging's result to three digits. If that is not meant, choose δ "
        "as the fine-tunes' own prior precision (see 'Choosing δ' in docs/guide.md)"
    )


def _models(
    config: MergeConfig | RemoveConfig,
    files: dict[str, CurvatureFile],
    keys: tuple[str, ...],
    dtype: torch.dtype,
) -> list[Curvature]:
    """α_t·H_t of the merge's models on ``keys`` (those with a curvature there)."""
    assert isinstance(config, MergeConfig)
    parts = []
    for t, alpha in enumerate(config.alphas):
        f = files.get(f"models[{t}].curvature")
        c = f.restrict(keys, dtype=dtype) if f is not None else None
        if c is not None:
            parts.append(c.scaled(alpha))
    return parts


def _term(
    term: CurvatureTerm | None,
    name: str,
    files: dict[str, CurvatureFile],
    keys: tuple[str, ...],
    dtype: torch.dtype,
) -> Curvature | None:
    if term is None:
        return None
    parts = [
        c
        for n, f in files.items()
        if n.startswith(f"{name}.curvature") and (c := f.restrict(keys, dtype=dtype)) is not None
    ]
    if not parts:
        return ScaledIdentity(term.delta) if term.delta > 0 else None
    total = sum(parts[1:], parts[0]).scaled(term.scale)
    return total + term.delta if term.delta > 0 else total


def _inputs(
    config: MergeConfig | RemoveConfig,
    files: dict[str, CurvatureFile],
    keys: tuple[str, ...],
    dtype: torch.dtype,
) -> methods.SystemInputs:
    """The unit's curvature terms, which the method's ``system`` combines."""
    if isinstance(config, RemoveConfig):
        return methods.SystemInputs(
            prior=_term(config.prior, "prior", files, keys, dtype),
            remaining=_term(config.remaining, "remaining", files, keys, dtype),
        )
    return methods.SystemInputs(
        models=tuple(_models(config, files, keys, dtype)),
        alphas=tuple(config.alphas),
        prior=_term(config.prior, "prior", files, keys, dtype),
        damping=config.damping,
    )


def _check(
    keys: tuple[str, ...], system: Curvature | None, key: str, dtype: torch.dtype
) -> SystemCheck:
    if system is None:
        return SystemCheck(keys, 0.0, 0.0, math.inf, key)
    lowest = float(system.min_eigenvalue())
    scale = max(float(system._scale()), 1e-30)
    floor = (
        0.0
        if isinstance(system, (Diagonal, ScaledIdentity))
        else 100 * torch.finfo(dtype).eps * scale
    )
    if lowest > floor:
        return SystemCheck(keys, lowest, floor, 0.0, key)
    return SystemCheck(keys, lowest, floor, max(2 * (floor - lowest), 1e-6 * scale), key)
