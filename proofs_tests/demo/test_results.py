"""The quick demo's numbers: complete, in range, and consistent with what the math guarantees."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from gradmerge.demo import DemoConfig, DemoResults
from gradmerge.demo.methods import MERGE_METHODS, REFINED, STRUCTURES
from gradmerge.demo.mlp import MLP
from gradmerge.demo.results import METHOD_LABELS, label


def test_every_method_at_every_alpha(quick_results: DemoResults):
    config = DemoConfig.quick()
    assert quick_results.tasks == list(config.tasks)
    for alpha in config.alphas:
        methods = [r["method"] for r in quick_results.rows(alpha)]
        assert methods == [*MERGE_METHODS, REFINED, "target"]
    assert len(quick_results.merge) == len(config.alphas) * (len(MERGE_METHODS) + 2)


def test_accuracies_distances_and_mismatches_are_in_range(quick_results: DemoResults):
    keys = [*quick_results.tasks, "original"]
    accuracies = [quick_results.references["base"]]
    accuracies += list(quick_results.references["finetuned"].values())
    accuracies += [r["accuracy"] for r in quick_results.merge]
    accuracies += [r["accuracy"] for r in quick_results.removal["rows"]]
    for acc in accuracies:
        assert sorted(acc) == sorted(keys)
        assert all(0.0 <= acc[k] <= 1.0 for k in keys)
    for row in quick_results.merge:
        assert math.isfinite(row["distance_to_target"]) and row["distance_to_target"] >= 0
        assert len(row["mismatch"]) == len(quick_results.tasks)
        assert all(math.isfinite(m) and m >= 0 for m in row["mismatch"])
        assert row["mismatch_total"] == pytest.approx(sum(row["mismatch"]), rel=1e-12)
        if row["method"] == "target":
            assert row["distance_to_target"] == 0.0
        else:
            assert 0 < row["relative_distance_to_target"] < math.inf


def test_every_model_is_converged(quick_results: DemoResults):
    config = DemoConfig.quick()
    expected = {"base", "removal/retrained", f"removal/refinetuned/{config.remove}"}
    expected |= {f"finetuned/{t}" for t in config.tasks}
    expected |= {f"target/alpha={a:g}" for a in config.alphas} | {f"local/alpha={config.alpha:g}"}
    assert set(quick_results.training) == expected
    for record in quick_results.training.values():
        assert record["converged"] and record["grad_norm"] <= 1e-9


def test_uniform_alpha_leaves_fisher_averaging_and_regmean_unchanged(quick_results: DemoResults):
    """(Σ α F_t)⁻¹ Σ α F_t θ_t does not depend on a common α: same model, same numbers."""
    alphas = DemoConfig.quick().alphas
    for method in ("fisher_average", "regmean"):
        rows = [quick_results.row(method, a) for a in alphas]
        for row in rows[1:]:
            assert row["accuracy"] == rows[0]["accuracy"]
            assert row["mismatch"] == pytest.approx(rows[0]["mismatch"], rel=1e-9)
    ta = [quick_results.row("task_arithmetic", a) for a in alphas]
    assert ta[0]["mismatch"] != pytest.approx(ta[1]["mismatch"], rel=1e-3)  # it does move


def test_eq2_holds_at_the_target_up_to_training_residuals(quick_results: DemoResults):
    """θ_1:T = θ_TA − Σ α H_0⁻¹ Δ_t(θ_1:T): the residual is ‖Σ α r_t − r‖/δ (r: ∇F left)."""
    config = DemoConfig.quick()
    sqrt_p = math.sqrt(MLP(hidden=config.hidden).num_params)  # ‖r‖₂ ≤ √P ‖r‖_∞
    finetuned = [quick_results.training[f"finetuned/{t}"]["grad_norm"] for t in config.tasks]
    assert [e["alpha"] for e in quick_results.eq2] == sorted(config.alphas)
    for e in quick_results.eq2:
        target = quick_results.training[f"target/alpha={e['alpha']:g}"]["grad_norm"]
        bound = sqrt_p * (e["alpha"] * sum(finetuned) + target) / config.delta
        assert e["residual"] <= bound + 1e-12
        assert e["task_arithmetic_error"] == pytest.approx(e["mismatch_term"], abs=bound + 1e-12)
        assert e["task_arithmetic_error"] > 1e3 * (bound + 1e-12)  # a real, nonzero error
        row = quick_results.row("task_arithmetic", e["alpha"])
        assert row["distance_to_target"] == pytest.approx(e["task_arithmetic_error"], rel=1e-12)


def test_removal_rows(quick_results: DemoResults):
    rows = quick_results.removal["rows"]
    assert quick_results.removal["removed"] == DemoConfig.quick().remove
    found = {(r["method"], r["structure"]) for r in rows}
    assert found == {("none (θ_all)", None), ("retrained", None)} | {
        (m, s) for m in ("eq13", "koh_liang") for s in STRUCTURES
    }
    by_method = {(r["method"], r["structure"]): r for r in rows}
    assert by_method[("none (θ_all)", None)]["relative_error"] == 1.0
    assert by_method[("retrained", None)]["relative_error"] == 0.0
    assert all(math.isfinite(r["relative_error"]) for r in rows)


def test_correlations_and_tables(quick_results: DemoResults):
    config = DemoConfig.quick()
    merged_models = (len(MERGE_METHODS) + 1) * len(config.alphas)
    corr = quick_results.correlations
    assert corr["task_error_vs_task_mismatch"]["points"] == merged_models * len(config.tasks)
    assert corr["mean_error_vs_total_mismatch"]["points"] == merged_models
    assert all(-1.0 <= c["spearman"] <= 1.0 for c in corr.values())
    text = quick_results.summary()
    for method in METHOD_LABELS:
        assert label(method, quick_results.config) in text
    assert f"refine ({config.refine_steps} steps)" in text
    for line in ("Eq. 13, full", "Koh & Liang, kfac", "retrained", "Spearman"):
        assert line in text
    json.dumps(quick_results.to_dict(), allow_nan=False)  # strict JSON as it is


def test_refinement_paths(quick_results: DemoResults):
    """Each α's path starts at the full-curvature merge, ends at the refined row, and every
    step lowers the stationarity residual (gm.refine backtracks on it)."""
    config = DemoConfig.quick()
    assert [r["alpha"] for r in quick_results.refinement] == sorted(config.alphas)
    for r in quick_results.refinement:
        path = r["steps"]
        assert [p["step"] for p in path] == list(range(config.refine_steps + 1))
        for p, method in ((path[0], "gm_full"), (path[-1], REFINED)):
            row = quick_results.row(method, r["alpha"])
            mean = sum(row["accuracy"][t] for t in config.tasks) / len(config.tasks)
            assert p["mean_accuracy"] == mean
            assert p["mismatch_total"] == pytest.approx(row["mismatch_total"], rel=1e-12)
            assert p["relative_distance_to_target"] == row["relative_distance_to_target"]
        residuals = [p["residual"] for p in path]
        assert all(b <= a for a, b in itertools.pairwise(residuals))  # a step is taken or not
        assert residuals[-1] < residuals[0]
        target = quick_results.row("target", r["alpha"])
        assert r["target_mean_accuracy"] == (
            sum(target["accuracy"][t] for t in config.tasks) / len(config.tasks)
        )
        gap = r["target_mean_accuracy"] - path[0]["mean_accuracy"]
        for p in path:
            expected = (p["mean_accuracy"] - path[0]["mean_accuracy"]) / gap if gap > 0 else None
            assert p["gap_closed"] == expected
        local = r["local_map"]
        if r["alpha"] == config.alpha:
            assert local["relative_distance_to_target"] >= 0
            assert math.isfinite(local["objective"]) and math.isfinite(r["target_objective"])
            moved = local["mean_accuracy"] - path[0]["mean_accuracy"]
            assert local["gap_closed"] == (moved / gap if gap > 0 else None)
        else:
            assert local is None
