r"""Choosing a merge's α (and δ, or the prior's scale) without test labels: a grid search.

A merge configuration (:class:`~gradmerge.jobs.config.MergeConfig`) is run once per SETTING of a
grid — the ``scale`` s that multiplies every α_t, and for gradient matching the prior's δ and the
scale c of its curvature, H_0 = δ·I + c·C — and each merged model θ(s, δ, c) is scored by a
CRITERION computed on every task's own TRAINING data D_t (its labels are the training labels; no
test or validation label is read). Two criteria (:mod:`gradmerge.commands.tune` computes them):

- ``loss``: J(θ) = Σ_t L̄_t(θ), L̄_t = the mean loss of θ on D_t (per example for a classifier,
  per token for a causal LM). Eq. 6 approximates the minimiser of Σ_t α_t ℓ̄_t(θ) + ½‖θ − θ_LLM‖²_{H_0};
  J asks directly how well θ fits every task's data, each task weighted alike.
- ``mismatch``: J(θ) = Σ_t ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖₂ / N_t, Eq. 2's gradient mismatch per task
  (ℓ̄_t a SUM over the N_t examples of D_t, so each term is a mismatch of MEAN gradients): it is
  zero for every task exactly when θ is as stationary on each task's loss as θ_t, and Eq. 2 shows
  it is the error every merge rule makes.

The chosen setting is the grid point of least J (the first one on ties). A point whose merge
fails (e.g. a δ too small for the systems to be solved) or whose criterion is NaN/Inf is
reported with its error and skipped.

Example:
    >>> cfg = MergeConfig.from_dict({"method": "task_arithmetic", "base_model": "base",
    ...     "models": [{"model": "a"}, {"model": "b", "alpha": 0.5}]}, check_files=False)
    >>> points = settings(cfg, scales=[0.5, 1.0])
    >>> [p.apply(cfg).alphas for p in points]
    [[0.5, 0.25], [1.0, 0.5]]
    >>> choose([3.0, None, 2.0, 2.0])
    2

References:
    Daheim et al., "Model Merging by Uncertainty-Based Gradient Matching", ICLR 2024 (Eq. 2 and
    Eq. 6); Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023 (α chosen on held-out
    data, which this replaces by the tasks' training data).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmerge import _guard
from gradmerge._guard import Output, publish_folder, write_error
from gradmerge.errors import ArgumentError, GradmergeError, OutputWriteError
from gradmerge.jobs.config import MergeConfig

Score = Callable[[Path], tuple[float, dict[str, Any]]]
"""A merged model's folder ↦ (criterion J, figures to report, e.g. ``{"tasks": [...]}``)."""


@dataclass(frozen=True)
class Setting:
    """One grid point: ``scale`` s (every α_t becomes s·α_t); for gradient matching ``delta``
    (the prior's δ) and ``prior_scale`` (the scale c of its curvature), ``None`` = as in the
    configuration."""

    scale: float
    delta: float | None = None
    prior_scale: float | None = None

    def apply(self, config: MergeConfig) -> MergeConfig:
        """``config`` with this setting (validated by :func:`settings`)."""
        prior = config.prior
        if prior is not None and (self.delta is not None or self.prior_scale is not None):
            prior = dataclasses.replace(
                prior,
                delta=prior.delta if self.delta is None else self.delta,
                scale=prior.scale if self.prior_scale is None else self.prior_scale,
            )
        return dataclasses.replace(config, scale=self.scale, prior=prior)

    def describe(self, config: MergeConfig) -> dict[str, Any]:
        """The setting as JSON values: ``scale``, the effective ``alphas``, and the prior's
        ``delta`` and ``prior_scale`` when the method has a prior."""
        applied = self.apply(config)
        out: dict[str, Any] = {"scale": self.scale, "alphas": applied.alphas}
        if applied.prior is not None:
            out["delta"] = applied.prior.delta
            if applied.prior.curvature is not None:
                out["prior_scale"] = applied.prior.scale
        return out


def settings(
    config: MergeConfig,
    *,
    scales: Sequence[float],
    deltas: Sequence[float] | None = None,
    prior_scales: Sequence[float] | None = None,
) -> list[Setting]:
    """The grid scales × deltas × prior_scales, in that order (the last varies fastest).

    Raises:
        ArgumentError: an empty grid or a value that is not finite; a scale below 0; δ or a
            prior scale for a method without a prior (only ``gradient_matching`` has one), a
            prior scale without a prior curvature, a negative one; a setting whose prior is zero
            (δ = 0 with no curvature, or with scale 0).
    """
    grids = {"scales": scales, "deltas": deltas, "prior_scales": prior_scales}
    for name, grid in grids.items():
        if grid is None:
            continue
        if len(grid) == 0:
            raise ArgumentError(f"the {name} grid is empty: give at least one value")
        bad = [v for v in grid if not math.isfinite(v) or v < 0]
        if bad:
            raise ArgumentError(
                f"the {name} grid holds {bad}: every value must be a finite number >= 0"
            )
    if (deltas is not None or prior_scales is not None) and config.prior is None:
        raise ArgumentError(
            f"method {config.method} has no prior: --deltas and --prior-scales apply to "
            "gradient_matching (its `prior: {delta: ..., curvature: ..., scale: ...}`)"
        )
    if prior_scales is not None and config.prior is not None and not config.prior.files:
        raise ArgumentError(
            "--prior-scales scales the prior's curvature, but the configuration's prior has "
            "none (`prior: {delta: ..., curvature: base.curvature.safetensors}`)"
        )
    unset: list[float | None] = [None]
    points = [
        Setting(s, d, c)
        for s, d, c in itertools.product(
            scales,
            unset if deltas is None else deltas,
            unset if prior_scales is None else prior_scales,
        )
    ]
    for point in points:
        prior = point.apply(config).prior
        if prior is not None and prior.delta == 0 and (not prior.files or prior.scale == 0):
            raise ArgumentError(
                f"the setting {point.describe(config)} makes the prior H_0 zero: give δ > 0, or "
                "a prior curvature with a scale > 0"
            )
    return points


def choose(criteria: Sequence[float | None]) -> int | None:
    """The index of the least criterion (the first on ties); ``None`` values (failed points)
    are skipped; ``None`` when every point failed."""
    best: int | None = None
    for index, value in enumerate(criteria):
        if value is not None and (best is None or value < criteria[best]):  # type: ignore[operator]
            best = index
    return best


@dataclass
class Point:
    """A scored grid point: its setting, criterion J (``None`` when it failed), the figures the
    score reported (per task), the error that made it fail, and the seconds the merge and the
    scoring took."""

    setting: Setting
    criterion: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    merge_seconds: float = 0.0
    score_seconds: float = 0.0


@dataclass
class TuneResult:
    """Every point of the grid and the chosen one (``chosen``: an index, ``None`` if all failed)."""

    points: list[Point]
    chosen: int | None
    kept: Path | None = None

    def to_dict(self, config: MergeConfig) -> dict[str, Any]:
        """JSON values: ``chosen`` (the setting), ``chosen_index`` and every point."""
        return {
            "chosen": None
            if self.chosen is None
            else self.points[self.chosen].setting.describe(config),
            "chosen_index": self.chosen,
            "merged_model": None if self.kept is None else str(self.kept),
            "points": [
                {
                    **p.setting.describe(config),
                    "criterion": p.criterion,
                    **p.figures,
                    "error": p.error,
                    "merge_seconds": round(p.merge_seconds, 3),
                    "score_seconds": round(p.score_seconds, 3),
                }
                for p in self.points
            ],
        }


def tune(
    config: MergeConfig,
    points: Sequence[Setting],
    score: Score,
    *,
    keep: Path | None = None,
    overwrite: bool = False,
    report: Callable[[int, Point], None] | None = None,
) -> TuneResult:
    """Merge ``config`` at every setting of ``points``, score each merged model with ``score``,
    and choose the least criterion (module docstring).

    Each merge is written to a temporary folder (beside ``keep``, else in the system's temporary
    folder) that is removed once scored, except the best so far; with ``keep``, the chosen
    merge is moved there at the end (a Hugging Face folder with its ``gradmerge_merge.json``).

    Args:
        config: the merge (any method).
        points: the settings (:func:`settings`).
        score: folder ↦ (criterion, figures to report); a :class:`GradmergeError` it raises,
            or a non-finite criterion, marks the point failed.
        keep: where to write the chosen merged model; ``None``: nowhere.
        overwrite: replace an existing ``keep``.
        report: called with each point once it is scored (progress lines).

    Raises:
        OutputExistsError: ``keep`` exists and not ``overwrite`` (checked before any merge).
        OutputOverlapError: ``keep`` is, lies inside or contains an input of ``config`` (the
            guard, :mod:`gradmerge._guard`; with ``overwrite`` too).
        OutputWriteError: ``keep``'s folder cannot be written (before any merge), or a merge
            could not be written (a full disk: the grid stops there).
        ArgumentError: no points.
    """
    from gradmerge.jobs.engine import run_merge

    if not points:
        raise ArgumentError("no settings to try: give at least one grid point")
    if keep is not None:
        _guard.check([Output("--out-dir", keep, "folder")], config.inputs(), overwrite=overwrite)
        keep.parent.mkdir(parents=True, exist_ok=True)
    work = Path(
        tempfile.mkdtemp(prefix=".gradmerge-tune-", dir=None if keep is None else keep.parent)
    )
    scored: list[Point] = []
    best: int | None = None
    try:
        for index, setting in enumerate(points):
            point, folder = Point(setting), work / f"point-{index}"
            start = time.perf_counter()
            try:
                run_merge(setting.apply(config), folder, progress=False)
                point.merge_seconds = time.perf_counter() - start
                criterion, point.figures = score(folder)
                point.score_seconds = time.perf_counter() - start - point.merge_seconds
                if math.isfinite(criterion):
                    point.criterion = float(criterion)
                else:
                    point.error = f"the criterion is {criterion} (non-finite)"
            except OutputWriteError as err:  # a full or read-only disk fails every point: stop
                if keep is None:
                    raise
                raise write_error("--out-dir", keep, err) from err
            except GradmergeError as err:
                point.error = f"{type(err).__name__}: {err}"
            scored.append(point)
            if report is not None:
                report(index, point)
            now = choose([p.criterion for p in scored])
            if now != best and best is not None:
                shutil.rmtree(work / f"point-{best}", ignore_errors=True)
            if now != index:
                shutil.rmtree(folder, ignore_errors=True)
            best = now
        kept = None
        if keep is not None and best is not None:  # keep never holds a partial model
            publish_folder(work / f"point-{best}", keep, overwrite, "--out-dir")
            kept = keep
        return TuneResult(scored, best, kept)
    finally:
        shutil.rmtree(work, ignore_errors=True)
