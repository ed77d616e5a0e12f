r"""Choosing a merge's scale (and δ, or the prior's scale) without test labels: a grid search.

A merge configuration (:class:`~gradmerge.jobs.config.MergeConfig`) is run once per SETTING of a
grid — the ``scale`` s that multiplies every α_t, and for gradient matching the prior's δ and the
scale c of its curvature, H_0 = δ·I + c·C — and each merged model θ(s, δ, c) is scored by a
CRITERION computed on every task's own TRAINING data D_t (its labels are the training labels; no
test or validation label is read), and on the base model's own training data D_0 when it is given
(the task θ_LLM was trained on, which Eq. 6's prior H_0 stands for). The criterion is a sum of one
TERM per task (:func:`term`; :mod:`gradmerge.commands.tune` computes its inputs on models), each
task weighted alike:

- ``loss`` (recommended): J(θ) = Σ_t L̄_t(θ), L̄_t = the mean loss of θ on D_t (per example for a
  classifier, per token for a causal LM), the base task's L̄_0 included when its data are given.
  On quadratic losses J(θ) − J(θ*) = ½‖θ − θ*‖²_Ā (Ā = Σ_t Ā_t, the tasks' mean Hessians,
  θ* the minimiser of J), so J ranks merges by their distance to the model trained on all the
  data with each data set weighted alike: the weighting of a mean accuracy over data sets.
- ``mismatch`` (a diagnostic, not recommended for choosing): J(θ) = Σ_t ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖₂
  / N_t, Eq. 2's gradient mismatch per task (ℓ̄_t a SUM over the N_t examples of D_t, so each term
  is a mismatch of MEAN gradients), the base task's against θ_LLM.

Why ``mismatch`` does not choose the scale (docs/guide.md, "Choosing the scale without labels"). On
quadratic losses a task's term is ‖Ā_t(θ − θ_t)‖, the distance of θ to that task's fine-tune: J is
least where θ is nearest to all the fine-tunes at once, whatever the data say beyond them. Take
every task and the base with mean Hessian aI, N_0 base examples and N_t per task, r = N_0/N_t, and
the fine-tunes trained under the base's prior (each stops at 1/(1 + r) of the way to its task's
optimum). On task arithmetic's line θ(s) = θ_LLM + s Σ_t τ_t the loss, base included, is least
at s* = (1 + r)/(T + 1); Σ_t ‖Ā_t(θ(s) − θ_t)‖² at s = 1/T (the fine-tunes' average), for any r,
and so is the mismatch when the task vectors are orthogonal and of equal length. Its choice is
too small whenever r > 1/T, and on the grid's lowest point when the base was trained on far
more data than each task (the paper's setting). Weighting the terms by α_t does not help:
Eq. 2's correction Σ_t α_t H_0⁻¹Δ_t is the error of the merge against ITS OWN target θ_{1:T}(α),
O(s), zero at s = 0 where every merge is exact (and, with equal curvatures, at s = 1/T, where
Eq. 6 is task arithmetic): it says how exact the rule is, not which target is good. The
well-founded form is Eq. 2's residual with the base term, R(θ) = Σ_t w_t ∇ℓ̄_t(θ) + w_0 ∇ℓ̄_0(θ),
the gradient of F = Σ_t w_t ℓ̄_t + w_0 ℓ̄_0, in the norm of the merge's error: ‖R(θ)‖²_{H̄⁻¹} =
2(F(θ) − F(θ*)) on quadratic losses (H̄ the Hessian of F). With w_t = 1/N_t that is the ``loss``
criterion with the base's data.

The chosen setting is the grid point of least J (the first one on ties). A point whose merge
fails (e.g. a δ too small for the systems to be solved) or whose criterion is NaN/Inf is
reported with its error and skipped. A choice on the edge of the grid (its lowest or highest
scale, δ or prior scale among the points scored) warns
(:class:`~gradmerge.errors.SelectionWarning`): the criterion may keep decreasing beyond it.

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
    Eq. 6); Ilharco et al., "Editing Models with Task Arithmetic", ICLR 2023 (their λ, the
    ``scale`` here, chosen on held-out data, which this replaces by the tasks' training data).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmerge import params as P
from gradmerge.errors import ArgumentError, GradmergeError, OutputWriteError, SelectionWarning
from gradmerge.foundation import guard
from gradmerge.foundation.guard import Output, publish_folder, write_error
from gradmerge.jobs.config import MergeConfig
from gradmerge.params import Params

Score = Callable[[Path], tuple[float, dict[str, Any]]]
"""A merged model's folder ↦ (criterion J, figures to report, e.g. ``{"tasks": [...]}``)."""

CRITERIA = ("loss", "mismatch")
"""The criteria, the recommended one first (module docstring)."""

DIAGNOSTIC_ONLY = {
    "mismatch": "--criterion mismatch is a diagnostic, not a way to choose: Eq. 2's gradient "
    "mismatch measures how far the merge is from each fine-tune, so it prefers the point nearest "
    "to them (scale = 1/T for tasks alike) whatever the data say, and chose the grid's lowest "
    "scale where tasks interfere; choose with --criterion loss and --base-data (the base model's own "
    "training data)"
}
"""The criteria kept to report, not to choose, each with the warning `gradmerge tune` prints."""

AXES = {"scale": "--scales", "delta": "--deltas", "prior_scale": "--prior-scales"}
"""The grid's axes (attributes of :class:`Setting`) and the flags of `gradmerge tune` that set
them."""


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


def term(
    criterion: str,
    *,
    mean_loss: float,
    examples: int,
    gradient: Params | None = None,
    reference: Params | None = None,
) -> float:
    """One task's term of the criterion J (module docstring; J is the sum of the terms).

    Args:
        criterion: ``"loss"`` or ``"mismatch"``.
        mean_loss: L̄_t(θ), the task's mean training loss at the merge θ.
        examples: N_t, the examples (or tokens) L̄_t averages over.
        gradient: ∇ℓ̄_t(θ), the SUM of the examples' gradients at θ (``mismatch`` only).
        reference: ∇ℓ̄_t(θ_t), the same at the task's own model (``mismatch`` only).

    Returns:
        L̄_t(θ) for ``loss``; ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖₂ / N_t for ``mismatch``.

    Raises:
        ArgumentError: an unknown criterion, ``mismatch`` without both gradients, N_t < 1.

    Example:
        >>> import torch
        >>> term("mismatch", mean_loss=0.7, examples=2, gradient={"w": torch.tensor([3.0, 4.0])},
        ...      reference={"w": torch.zeros(2)})
        2.5
    """
    if criterion not in CRITERIA:
        raise ArgumentError(f"criterion must be one of {', '.join(CRITERIA)}; got {criterion!r}")
    if criterion == "loss":
        return float(mean_loss)
    if gradient is None or reference is None:
        raise ArgumentError("the mismatch term needs the gradient at θ and at the task's model")
    if examples < 1:
        raise ArgumentError(f"the mismatch term needs N_t >= 1 examples; got {examples}")
    return P.norm(P.sub(gradient, reference)) / examples


def grid_edges(
    settings: Sequence[Setting], criteria: Sequence[float | None], chosen: int
) -> list[dict[str, Any]]:
    """The axes of the grid on whose edge the chosen setting lies.

    An axis (``scale``, ``delta``, ``prior_scale``) counts when the scored points (criterion not
    ``None``) take at least two values on it and the chosen point holds the least or the
    greatest of them; a least value of 0 does not count (the grid cannot go below it).

    Returns:
        One ``{"axis", "side" ("lowest" | "highest"), "value", "flag"}`` per such axis.

    Example:
        >>> grid = [Setting(0.3), Setting(0.6), Setting(1.0)]
        >>> grid_edges(grid, [1.0, 2.0, None], 0)
        [{'axis': 'scale', 'side': 'lowest', 'value': 0.3, 'flag': '--scales'}]
        >>> grid_edges(grid, [2.0, 1.0, 3.0], 1)
        []
    """
    scored = [s for s, c in zip(settings, criteria, strict=True) if c is not None]
    edges = []
    for axis, flag in AXES.items():
        value = getattr(settings[chosen], axis)
        values = {getattr(s, axis) for s in scored} - {None}
        if value is None or len(values) < 2:
            continue
        if value == max(values):
            edges.append({"axis": axis, "side": "highest", "value": value, "flag": flag})
        elif value == min(values) and value > 0:
            edges.append({"axis": axis, "side": "lowest", "value": value, "flag": flag})
    return edges


def edge_message(edges: Sequence[dict[str, Any]]) -> str:
    """The warning for a choice on the grid's edge (:func:`grid_edges`), one line."""
    parts = [
        f"the {e['side']} {e['axis'].replace('_', ' ')} of the grid ({e['value']:g}; extend "
        f"{e['flag']} {'below' if e['side'] == 'lowest' else 'above'} it)"
        for e in edges
    ]
    return (
        f"the chosen setting is at {' and '.join(parts)}: the criterion may keep decreasing "
        "beyond the grid, so the best setting may lie outside it"
    )


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
    edges: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self, config: MergeConfig) -> dict[str, Any]:
        """JSON values: ``chosen`` (the setting), ``chosen_index``, ``at_grid_edge`` and
        ``grid_edges`` (:func:`grid_edges`) and every point."""
        return {
            "chosen": None
            if self.chosen is None
            else self.points[self.chosen].setting.describe(config),
            "chosen_index": self.chosen,
            "at_grid_edge": bool(self.edges),
            "grid_edges": self.edges,
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
    A choice on the grid's edge (:func:`grid_edges`) warns with a
    :class:`~gradmerge.errors.SelectionWarning`.

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
            guard, :mod:`gradmerge.foundation.guard`; with ``overwrite`` too).
        OutputWriteError: ``keep``'s folder cannot be written (before any merge), or a merge
            could not be written (a full disk: the grid stops there).
        ArgumentError: no points.
    """
    from gradmerge.jobs.engine import run_merge

    if not points:
        raise ArgumentError("no settings to try: give at least one grid point")
    if keep is not None:
        guard.check([Output("--out-dir", keep, "folder")], config.inputs(), overwrite=overwrite)
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
        edges = [] if best is None else grid_edges(points, [p.criterion for p in scored], best)
        if edges:
            warnings.warn(edge_message(edges), SelectionWarning, stacklevel=2)
        kept = None
        if keep is not None and best is not None:  # keep never holds a partial model
            publish_folder(work / f"point-{best}", keep, overwrite, "--out-dir")
            kept = keep
        return TuneResult(scored, best, kept, edges)
    finally:
        shutil.rmtree(work, ignore_errors=True)
