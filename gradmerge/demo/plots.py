r"""The demo's figures, drawn with matplotlib's object API (Agg canvas; no pyplot, no display).

- :func:`accuracy_figure` (``accuracy_vs_alpha.png``): held-out accuracy against α, one panel
  per task and one for the mean, a line per merge method, the exact target θ_{1:T}(α) dashed.
- :func:`mismatch_figure` (``error_vs_mismatch.png``): the paper's key relation. Left: held-out
  error on task t against the gradient mismatch ‖Δ_t(θ)‖ = ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖ of the merged
  model, one point per method, α and task (Spearman's ρ in the title). Right: Eq. 2 at the
  converged target — the distance of task arithmetic to the target against the mismatch term
  ‖Σ_t α_t H_0⁻¹ Δ_t(θ_{1:T})‖ — points on the diagonal: task arithmetic's error IS the mismatch.

Example:
    >>> from gradmerge.demo.plots import PLOTS
    >>> sorted(PLOTS)
    ['accuracy_vs_alpha.png', 'error_vs_mismatch.png']
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure

from gradmerge.demo.results import DemoResults, label

COLOURS = {
    "task_arithmetic": "tab:orange",
    "fisher_average": "tab:brown",
    "regmean": "tab:purple",
    "gm_diag": "tab:cyan",
    "gm_kfac": "tab:blue",
    "gm_full": "tab:green",
    "gm_refine": "tab:red",
    "target": "black",
}
MARKERS = ("o", "s", "^", "D", "v", "P")


def accuracy_figure(results: DemoResults) -> Figure:
    """Held-out accuracy against α, per task and averaged, for every method and the target."""
    tasks = results.tasks
    alphas = sorted({r["alpha"] for r in results.merge})
    methods = list(dict.fromkeys(r["method"] for r in results.merge))
    panels = [*tasks, "mean over tasks"]
    fig = Figure(figsize=(3.3 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True)

    def acc(method: str, alpha: float, panel: str) -> float:
        values = results.row(method, alpha)["accuracy"]
        if panel in values:
            return float(values[panel])
        return sum(values[t] for t in tasks) / len(tasks)

    for ax, panel in zip(axes, panels, strict=True):
        for method in methods:
            ax.plot(
                alphas,
                [acc(method, a, panel) for a in alphas],
                marker="o" if method != "target" else None,
                linestyle="--" if method == "target" else "-",
                color=COLOURS.get(method),
                label=label(method, results.config),
            )
        own = results.references["finetuned"]
        base = results.references["base"]
        if panel in tasks:
            finetuned, start = own[panel][panel], base[panel]
        else:
            finetuned = sum(own[t][t] for t in tasks) / len(tasks)
            start = sum(base[t] for t in tasks) / len(tasks)
        ax.axhline(finetuned, color="grey", linestyle=":", label="fine-tuned θ_t (own task)")
        ax.axhline(start, color="grey", linestyle="-.", linewidth=0.8, label="base θ_LLM")
        ax.set_title(panel)
        ax.set_xlabel("α (every task)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=5, fontsize=8)
    fig.suptitle("Merged models against α: accuracy on each task's held-out images")
    return fig


def mismatch_figure(results: DemoResults) -> Figure:
    """Error against gradient mismatch (left) and Eq. 2 at the target (right)."""
    tasks = results.tasks
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for row in results.merge:
        method = row["method"]
        for t, task in enumerate(tasks):
            left.scatter(
                row["mismatch"][t],
                1.0 - row["accuracy"][task],
                color=COLOURS.get(method),
                marker="*" if method == "target" else MARKERS[t % len(MARKERS)],
                s=70 if method == "target" else 28,
                alpha=0.8,
            )
    for method in dict.fromkeys(r["method"] for r in results.merge):
        left.scatter([], [], color=COLOURS.get(method), label=label(method, results.config))
    for t, task in enumerate(tasks):
        left.scatter([], [], color="grey", marker=MARKERS[t % len(MARKERS)], label=f"task {task}")
    rho = results.correlations["task_error_vs_task_mismatch"]
    left.set_xscale("log")
    left.set_xlabel("gradient mismatch ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖ of the merged θ")
    left.set_ylabel("held-out error on task t")
    left.set_title(
        f"Error against mismatch (methods × α × tasks): Spearman ρ = {rho['spearman']:.2f}"
        + "\n(★: the exact target θ_1:T, not in ρ)",
        fontsize=9,
    )
    left.legend(fontsize=7)
    left.grid(alpha=0.3)

    eq2 = results.eq2
    xs = [e["mismatch_term"] for e in eq2]
    ys = [e["task_arithmetic_error"] for e in eq2]
    top = max([*xs, *ys]) * 1.1
    right.plot([0, top], [0, top], color="grey", linestyle=":", label="y = x")
    right.scatter(xs, ys, color=COLOURS["task_arithmetic"], zorder=3)
    for e in eq2:
        right.annotate(
            f"α={e['alpha']:g}", (e["mismatch_term"], e["task_arithmetic_error"]), fontsize=8
        )
    worst = max(e["relative_residual"] for e in eq2)
    right.set_xlabel("mismatch term ‖Σ_t α_t H_0⁻¹ [∇ℓ̄_t(θ_1:T) − ∇ℓ̄_t(θ_t)]‖")
    right.set_ylabel("task arithmetic's error ‖θ_TA − θ_1:T‖")
    right.set_title(f"Eq. 2 on the trained MLP: largest relative residual {worst:.1e}", fontsize=9)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    return fig


PLOTS: dict[str, Callable[[DemoResults], Figure]] = {
    "accuracy_vs_alpha.png": accuracy_figure,
    "error_vs_mismatch.png": mismatch_figure,
}
"""File name → figure."""


def write_plots(results: DemoResults, directory: Path) -> list[Path]:
    """Draw every figure of :data:`PLOTS` into ``directory`` as PNG; returns the paths."""
    paths = []
    for name, draw in PLOTS.items():
        path = directory / name
        draw(results).savefig(path, dpi=120)
        paths.append(path)
    return paths
