# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The demo: merging and removing domain-shifted digit tasks
#
# `gradmerge demo --out runs/demo` (or `gradmerge.demo.run_demo`) runs the whole pipeline on
# scikit-learn's handwritten digits: a base MLP θ_LLM trained on original images, one fine-tune
# θ_t per domain shift (rotated, mirrored, shifted images of the same ten classes) with the prior
# (δ/2)‖θ − θ_LLM‖² (Eq. 15), curvatures H_t at θ_t (GGN: diagonal, K-FAC and full), every merge
# method, the exact multi-task target θ_{1:T} = argmin Σ_t α ℓ̄_t(θ) + (δ/2)‖θ − θ_LLM‖², and the
# removal of one task by Eq. 13 and by Koh & Liang against retraining without it. Every model is
# a MAP fitted by Newton's method to ‖∇F‖_∞ ≤ 1e-9, so the identities of the paper can be checked
# on a real network, not only on linear models.
#
# This notebook runs the quick preset (seconds) and checks what must hold whatever the numbers:
#
# - Eq. 2 at the converged target: θ_{1:T} = θ_TA − Σ_t α_t H_0⁻¹ Δ_t(θ_{1:T}), Δ_t the gradient
#   mismatch; so ‖θ_TA − θ_{1:T}‖ and ‖Σ_t α_t H_0⁻¹ Δ_t‖ differ by at most the identity's
#   residual, which is the fits' leftover gradient over δ;
# - the reference rows are what they claim (the target is at distance 0 from itself, retraining
#   is at removal error 0, not removing at 1);
# - `results.json` holds the same numbers as the returned `DemoResults`.
#
# | paper | demo |
# |---|---|
# | θ_LLM, θ_t, θ_{1:T} | `base`, `finetuned`, the `target` row |
# | H_0 = δI | `config["delta"]` |
# | Δ_t(θ) = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t) | each row's `mismatch` (per task) and `mismatch_total` |
# | Eq. 13 / Koh & Liang | removal rows `eq13` / `koh_liang`, per curvature structure |

# %%
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt

from gradmerge.demo import run_demo
from gradmerge.demo.plots import accuracy_figure, mismatch_figure

plt.switch_backend("Agg")

# %%
out = Path("demo")
results = run_demo(out, quick=True, log=None, overwrite=True)
print(results.summary())

# %% [markdown]
# ## What was written
#
# The same files as `gradmerge demo --quick --out demo`: the table, the numbers and two plots.

# %%
assert sorted(p.name for p in out.iterdir()) == [
    "accuracy_vs_alpha.png",
    "error_vs_mismatch.png",
    "results.json",
    "table.txt",
]
saved = json.loads((out / "results.json").read_text())


def same(a, b):
    """JSON value a equals Python value b (non-finite floats are written as null)."""
    if isinstance(b, float):
        return a is None if not math.isfinite(b) else math.isclose(a, b, rel_tol=0, abs_tol=0)
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


assert same(saved, results.to_dict())
assert (out / "table.txt").read_text().strip() == results.summary().strip()

# %% [markdown]
# ## Eq. 2 on a real network
#
# With a = θ_TA − θ_{1:T} and b = Σ_t α_t H_0⁻¹ Δ_t(θ_{1:T}) (the `mismatch_term`), Eq. 2 says
# a = b; the triangle inequality bounds | ‖a‖ − ‖b‖ | by the residual ‖a − b‖, and the residual is
# at the level of the fits' convergence (relative to ‖θ_{1:T} − θ_LLM‖).

# %%
for row in results.eq2:
    gap = abs(row["task_arithmetic_error"] - row["mismatch_term"])
    print(
        f"α = {row['alpha']}: ‖θ_TA − θ_1:T‖ = {row['task_arithmetic_error']:.6f}, "
        f"‖Σ α H_0⁻¹ Δ_t‖ = {row['mismatch_term']:.6f}, residual {row['relative_residual']:.1e}"
    )
    assert gap <= row["residual"] * (1 + 1e-9) + 1e-15
    assert row["relative_residual"] < 1e-6
    assert row["task_arithmetic_error"] > 1e3 * row["residual"]  # the identity is not vacuous

# %% [markdown]
# ## The reference rows, and every number in range

# %%
worst = max(v["grad_norm"] for v in results.training.values())
assert all(v["converged"] for v in results.training.values()) and worst <= 1e-9
for alpha in results.config["alphas"]:
    target = results.row("target", alpha)
    assert target["relative_distance_to_target"] == 0.0
for row in results.merge:
    assert all(0.0 <= acc <= 1.0 for acc in row["accuracy"].values())
    assert all(math.isfinite(m) and m >= 0 for m in row["mismatch"])
    assert math.isclose(row["mismatch_total"], sum(row["mismatch"]), rel_tol=1e-12)
removal = {(r["method"], r["structure"]): r for r in results.removal["rows"]}
assert removal[("retrained", None)]["relative_error"] == 0.0
assert removal[("none (θ_all)", None)]["relative_error"] == 1.0
print(results.correlations)

# %% [markdown]
# ## The plots
#
# Accuracy against α for each method, and held-out error against gradient mismatch (the paper's
# key relation): the merges that match the tasks' gradients better sit lower.

# %%
for name, figure in (
    ("accuracy_vs_alpha", accuracy_figure),
    ("error_vs_mismatch", mismatch_figure),
):
    fig = figure(results)
    fig.savefig(f"{name}.png", dpi=80)
    plt.close(fig)
assert Path("accuracy_vs_alpha.png").stat().st_size > 0
