"""What the demo measured: :class:`DemoResults`, its JSON form and its printed tables.

Example:
    >>> from gradmerge.demo.results import DemoResults
    >>> r = DemoResults(config={"alphas": [1.0], "delta": 5.0, "refine_steps": 1}, device="cpu",
    ...     tasks=["a"], training={}, references={"base": {"a": 0.1, "original": 0.9},
    ...     "finetuned": {"a": {"a": 0.9, "original": 0.5}}}, merge=[{"method": "target",
    ...     "alpha": 1.0, "accuracy": {"a": 0.8, "original": 0.6}, "relative_distance_to_target": 0.0,
    ...     "distance_to_target": 0.0, "mismatch": [0.5], "mismatch_total": 0.5}],
    ...     eq2=[], refinement=[], removal={"removed": "a", "rows": []}, correlations={}, timings={},
    ...     environment={})
    >>> r.row("target")["accuracy"]["a"], "target θ_1:T (exact)" in r.merge_table()
    (0.8, True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

METHOD_LABELS = {
    "task_arithmetic": "task arithmetic",
    "fisher_average": "Fisher averaging",
    "regmean": "RegMean",
    "gm_diag": "grad. matching, diag",
    "gm_kfac": "grad. matching, K-FAC",
    "gm_full": "grad. matching, full",
    "gm_refine": "grad. matching + refine (k steps)",
    "target": "target θ_1:T (exact)",
}
"""Printed names of the methods (``k``: the config's ``refine_steps``, see :func:`label`)."""


def label(method: str, config: dict[str, Any]) -> str:
    """The printed name of ``method``, with the number of refinement steps filled in."""
    text = METHOD_LABELS.get(method, method)
    if method == "gm_refine":
        steps = config["refine_steps"]
        text = text.replace("k steps", f"{steps} step" + ("s" if steps != 1 else ""))
    return text


LABEL_WIDTH = 35
"""Width of the method column of the tables."""


@dataclass
class DemoResults:
    """Every number of one demo run (``results.json`` is :meth:`to_dict`).

    Attributes:
        config: the :class:`~gradmerge.demo.config.DemoConfig` as a dict.
        device: where it ran.
        tasks: task names, in order.
        training: per trained model, its convergence record (objective, ‖∇F‖_∞, Newton steps).
        references: held-out accuracies of θ_LLM (``base``) and of each θ_t (``finetuned``).
        merge: one row per (α, method), the target included: ``accuracy`` (per task and
            ``original``), ``relative_distance_to_target`` ‖θ − θ_1:T‖/‖θ_1:T − θ_LLM‖,
            ``distance_to_target``, ``mismatch`` ‖Δ_t(θ)‖ per task and ``mismatch_total``.
        refinement: per α, the path of ``gm.refine`` from the full-curvature merge (``steps``:
            θ^0 … θ^k with mean accuracy, ``gap_closed`` share of the accuracy gap to the target,
            relative distance to the target, mismatch and stationarity residual ‖R‖), the
            target's mean accuracy and objective, and ``local_map``: the MAP Newton's method
            reaches from the merge on the same objective (at the table's α only, else None).
        eq2: per α, Eq. 2 at the target: ``task_arithmetic_error`` ‖θ_TA − θ_1:T‖, the
            ``mismatch_term`` ‖Σ_t α_t H_0⁻¹ Δ_t(θ_1:T)‖, and the identity's ``residual`` (absolute
            and ``relative_residual``).
        removal: ``removed`` (the task) and ``rows`` per method and structure: accuracies and
            ``relative_error`` ‖θ − θ_\\r‖/‖θ_\\r − θ_all‖ (1 for no removal, 0 for retraining).
        correlations: Spearman's ρ of error against gradient mismatch over the merged models.
        timings: seconds per stage (with ``environment``, the only entries that may differ
            between runs with the same seed on the same device).
        environment: torch version and CPU threads.
    """

    config: dict[str, Any]
    device: str
    tasks: list[str]
    training: dict[str, dict[str, Any]]
    references: dict[str, Any]
    merge: list[dict[str, Any]]
    eq2: list[dict[str, float]]
    refinement: list[dict[str, Any]]
    removal: dict[str, Any]
    correlations: dict[str, dict[str, float | int]]
    timings: dict[str, float]
    environment: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``results.json``)."""
        return asdict(self)

    def rows(self, alpha: float | None = None) -> list[dict[str, Any]]:
        """The merge rows at ``alpha`` (default: the table's α, the largest of the sweep)."""
        alpha = max(r["alpha"] for r in self.merge) if alpha is None else alpha
        return [r for r in self.merge if r["alpha"] == alpha]

    def row(self, method: str, alpha: float | None = None) -> dict[str, Any]:
        """The merge row of ``method`` at ``alpha``."""
        return next(r for r in self.rows(alpha) if r["method"] == method)

    def merge_table(self, alpha: float | None = None) -> str:
        """Accuracies, distance to the target and mismatch of every method at one α."""
        rows = self.rows(alpha)
        alpha = rows[0]["alpha"]
        width = max(8, *(len(t) for t in self.tasks))
        head = (
            f"{'method':<{LABEL_WIDTH}s}"
            + "".join(f"{t:>{width + 1}s}" for t in self.tasks)
            + "   mean  original  dist. to target  mismatch Σ‖Δ_t‖"
        )

        def line(name: str, acc: dict[str, float], dist: str, mismatch: str) -> str:
            mean = sum(acc[t] for t in self.tasks) / len(self.tasks)
            cells = "".join(f"{acc[t]:>{width + 1}.3f}" for t in self.tasks)
            original = f"{acc['original']:8.3f}" if "original" in acc else f"{'—':>8s}"
            return f"{name:<{LABEL_WIDTH}s}{cells}  {mean:5.3f}  {original}  {dist:>15s}  {mismatch:>16s}"

        own = {t: self.references["finetuned"][t][t] for t in self.tasks}
        lines = [
            f"Merging {len(self.tasks)} fine-tunes of θ_LLM, α = {alpha:g} for every task "
            f"(H_0 = δI, δ = {self.config['delta']:g}); held-out accuracy",
            "",
            head,
            line("base θ_LLM", self.references["base"], "1.000", "—"),
            line("fine-tuned θ_t (own)", own, "—", "—"),
        ]
        for r in rows:
            lines.append(
                line(
                    label(r["method"], self.config),
                    r["accuracy"],
                    f"{r['relative_distance_to_target']:.3f}",
                    f"{r['mismatch_total']:.2f}",
                )
            )
        lines.append(
            "dist. to target: ‖θ − θ_1:T‖ / ‖θ_1:T − θ_LLM‖ (θ_1:T trained on all tasks' data; "
            "1 = as far as θ_LLM). mismatch: Σ_t ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖ (Eq. 2). "
            "'fine-tuned (own)': each θ_t on its own task."
        )
        return "\n".join(lines)

    def alpha_table(self) -> str:
        """Mean held-out accuracy over the tasks, per method and α."""
        alphas = sorted({r["alpha"] for r in self.merge})
        methods = list(dict.fromkeys(r["method"] for r in self.merge))
        lines = [
            "Mean held-out accuracy over the tasks against α",
            "",
            f"{'method':<{LABEL_WIDTH}s}" + "".join(f"{'α=' + format(a, 'g'):>8s}" for a in alphas),
        ]
        for method in methods:
            cells = ""
            for a in alphas:
                acc = self.row(method, a)["accuracy"]
                cells += f"{sum(acc[t] for t in self.tasks) / len(self.tasks):8.3f}"
            lines.append(f"{label(method, self.config):<{LABEL_WIDTH}s}{cells}")
        return "\n".join(lines)

    def refine_table(self) -> str:
        """Mean accuracy along each α's refinement path, and the share of the gap closed."""
        steps = self.config["refine_steps"]
        lines = [
            f"Refinement (gm.refine, {steps} steps, full GGN and gradients re-estimated at each "
            "iterate) from grad. matching, full; mean held-out accuracy",
            "",
            f"{'α':>5s}  {'start':>6s}"
            + "".join(f"{'k=' + str(k):>7s}" for k in range(1, steps + 1))
            + f"  {'target':>6s}  {'gap closed':>10s}  {'‖R‖ start→end':>17s}"
            + "  local MAP (acc., dist., F − F(θ_1:T))",
        ]
        for r in self.refinement:
            path = r["steps"]
            closed = path[-1]["gap_closed"]
            local = r["local_map"]
            lines.append(
                f"{r['alpha']:5g}  {path[0]['mean_accuracy']:6.3f}"
                + "".join(f"{p['mean_accuracy']:7.3f}" for p in path[1:])
                + f"  {r['target_mean_accuracy']:6.3f}"
                + f"  {'—' if closed is None else format(closed, '.0%'):>10s}"
                + f"  {path[0]['residual']:7.1f}→{path[-1]['residual']:<8.1f}"
                + (
                    f"  {local['mean_accuracy']:.3f}, {local['relative_distance_to_target']:.3f}, "
                    f"{local['objective'] - r['target_objective']:+.2f}"
                    if local is not None
                    else "  —"
                )
            )
        lines.append(
            "gap closed: (acc(θ^k) − acc(θ^0)) / (acc(θ_1:T) − acc(θ^0)). ‖R‖: ‖δ(θ − θ_LLM) + "
            "Σ_t α ∇ℓ̄_t(θ)‖, 0 at every minimum of the multi-task objective. local MAP: the "
            "minimum Newton's method reaches from θ^0, at the table's α (dist.: "
            "‖θ − θ_1:T‖/‖θ_1:T − θ_LLM‖; F: the multi-task objective, θ_1:T trained from θ_LLM)."
        )
        return "\n".join(lines)

    def removal_table(self) -> str:
        """Accuracies and error to the retrained model of each removal method."""
        removed = self.removal["removed"]
        width = max(8, *(len(t) for t in self.tasks))
        tasks = [t + ("*" if t == removed else "") for t in self.tasks]
        lines = [
            f"Removing task '{removed}' (*) from θ_all, the model trained on every task",
            "",
            f"{'method':<26s}"
            + "".join(f"{t:>{width + 1}s}" for t in tasks)
            + "  original  error to retrained",
        ]
        labels = {"eq13": "Eq. 13", "koh_liang": "Koh & Liang"}
        for r in self.removal["rows"]:
            label = labels.get(r["method"], r["method"])
            if r["structure"] is not None:
                label = f"{label}, {r['structure']}"
            cells = "".join(f"{r['accuracy'][t]:>{width + 1}.3f}" for t in self.tasks)
            lines.append(
                f"{label:<26s}{cells}  {r['accuracy']['original']:8.3f}  "
                f"{r['relative_error']:18.3f}"
            )
        lines.append(
            "error to retrained: ‖θ − θ_\\r‖ / ‖θ_\\r − θ_all‖ (θ_\\r retrained without the task; "
            "1 = not removing at all)."
        )
        return "\n".join(lines)

    def summary(self) -> str:
        """The three tables, the correlations and the convergence of the trained models."""
        worst = max(v["grad_norm"] for v in self.training.values())
        unconverged = [k for k, v in self.training.items() if not v["converged"]]
        corr = self.correlations
        parts = [
            self.merge_table(),
            self.alpha_table(),
            self.refine_table(),
            self.removal_table(),
            "Gradient mismatch against error, over every merged model (methods × α): Spearman ρ = "
            + ", ".join(
                f"{v['spearman']:.2f} ({k.replace('_', ' ')}, {v['points']} points)"
                for k, v in corr.items()
            ),
            f"Every model trained to ‖∇F‖_∞ ≤ {worst:.1e}"
            + (f"; NOT converged: {', '.join(unconverged)}" if unconverged else "")
            + f". Device: {self.device}.",
        ]
        return "\n\n".join(parts)
