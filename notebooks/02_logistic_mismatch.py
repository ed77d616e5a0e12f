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
# # Logistic regression: a merge's error is its gradient mismatch
#
# For non-quadratic losses no merge rule is exact. The paper's key relation (Eq. 1–2) says what
# the error is made of: with the fine-tunes' stationarity ∇ℓ̄_t(θ_t) = −H_0(θ_t − θ_LLM), the
# gradient of the multi-task objective F(θ) = ½‖θ − θ_LLM‖²_{H_0} + Σ_t α_t ℓ̄_t(θ) at any
# candidate merge θ is
#
# R(θ) = ∇F(θ) = H_0(θ − θ_TA) + Σ_t α_t Δ_t(θ),   Δ_t(θ) = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)   (the gradient mismatch),
#
# and θ_{1:T} is the θ with R(θ) = 0. For task arithmetic (θ = θ_TA) the residual IS the
# gradient mismatch. Because F is μ-strongly convex and L-smooth (μ = λ_min(H_0); for the
# sigmoid, ∇²ℓ̄_t ⪯ ¼ X̃_tᵀX̃_t, so L = λ_max(H_0) + Σ_t α_t λ_max(X̃_tᵀX̃_t)/4), the error of
# ANY merge is pinned between two multiples of its residual:
#
# ‖R(θ)‖ / L ≤ ‖θ − θ_{1:T}‖ ≤ ‖R(θ)‖ / μ.
#
# Gradient matching (Eq. 6) removes the first-order part of the mismatch, Δ_t(θ) ≈ H_t(θ − θ_t),
# so its residual, and with it its error, is of second order in the task vectors.
#
# | paper | code |
# |---|---|
# | θ_LLM, θ_t, θ_{1:T} | `problem.theta_llm`, `problem.finetuned(t)`, `problem.target(alphas)` |
# | H_t (exact Hessian at θ_t, a SUM over examples) | `problem.hessian(t)`, wrapped as `gm.Dense` |
# | Δ_t(θ) | `gm.gradient_mismatch(theta, finetuned, gradient_fns).per_task[t]` |

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import gradmerge as gm
from gradmerge.theory import logistic
from gradmerge.theory.numeric._common import Layout

plt.switch_backend("Agg")
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)  # tiny systems: extra threads only wait on each other
ALPHAS = [1.0, 1.0, 1.0]


def merges(problem):
    """θ_TA, Eq. 6 with diagonal H_t, Eq. 6 with the exact H_t; all through gradmerge."""
    lay = Layout(problem.model.layout)
    base = lay.params(problem.theta_llm)
    fts = [lay.params(problem.finetuned(t)) for t in range(problem.num_tasks)]
    hessians = [problem.hessian(t) for t in range(problem.num_tasks)]
    prior = lay.dense(problem.prior_precision)
    diag = [gm.Diagonal(lay.params(torch.diagonal(h).clone())) for h in hessians]
    out = {
        "task arithmetic": gm.task_arithmetic(base, fts, alphas=ALPHAS),
        "GM, diagonal H_t": gm.gradient_matching(base, fts, diag, prior=prior, alphas=ALPHAS),
        "GM, exact H_t": gm.gradient_matching(
            base, fts, [lay.dense(h) for h in hessians], prior=prior, alphas=ALPHAS
        ),
    }
    return lay, fts, out


def residual(problem, lay, fts, theta, theta_ta):
    """‖R(θ)‖ = ‖H_0(θ − θ_TA) + Σ_t α_t Δ_t(θ)‖, Δ_t from gm.gradient_mismatch."""
    grads = lay.grad_fns(problem.gradient, problem.num_tasks)
    mismatch = gm.gradient_mismatch(theta, fts, grads, alphas=ALPHAS)
    flat = problem.prior_precision @ (lay.flat(theta) - lay.flat(theta_ta))
    for a, delta in zip(ALPHAS, mismatch.per_task, strict=True):
        flat = flat + a * lay.flat(delta)
    return float(torch.linalg.norm(flat))


def constants(problem):
    """μ and L of the multi-task objective F."""
    eig = torch.linalg.eigvalsh(problem.prior_precision)
    curv = 0.0
    for a, X in zip(ALPHAS, problem.X_tasks, strict=True):
        Xt = torch.cat([X, torch.ones(X.shape[0], 1)], dim=1)  # with the intercept column
        curv += a * float(torch.linalg.eigvalsh(Xt.T @ Xt)[-1]) / 4
    return float(eig[0]), float(eig[-1]) + curv


# %% [markdown]
# ## 1. Error against gradient mismatch on 30 random problems
#
# Binary logistic regression, d = 3 features (+ intercept), T = 3 tasks of 30 examples each whose
# true parameters move away from the pretraining ones by `shift` (0.25 to 4, times the size of
# the signal), with shifted feature means; H_0 = δI. Everything is solved by Newton to machine
# precision (`gradmerge.theory.logistic`).

# %%
rows = []
for shift in (0.25, 0.5, 1.0, 2.0, 4.0):
    for seed in range(6):
        problem = logistic.make_logistic_merge_problem(
            seed, d=3, tasks=3, n_per_task=30, shift=shift, covariate_shift=0.5, delta=1.0
        )
        lay, fts, merged = merges(problem)
        target = problem.target(ALPHAS)
        mu, L = constants(problem)
        for method, theta in merged.items():
            r = residual(problem, lay, fts, theta, merged["task arithmetic"])
            err = float(torch.linalg.norm(lay.flat(theta) - target))
            rows.append(
                {"shift": shift, "seed": seed, "method": method, "R": r, "error": err, "mu": mu}
            )
            # the sandwich, up to the Newton solver's accuracy (1e-9 relative here)
            assert r / L <= err * (1 + 1e-9) and err <= r / mu * (1 + 1e-9), (method, shift, seed)

# %% [markdown]
# Every merge of every problem lies inside the band ‖R‖/L ≤ error ≤ ‖R‖/μ (asserted above):
# the error is governed by the (mismatch) residual, whatever the method. For task arithmetic,
# R is exactly the gradient mismatch Σ_t α_t Δ_t(θ_TA).

# %%
methods = ["task arithmetic", "GM, diagonal H_t", "GM, exact H_t"]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
for method, marker in zip(methods, "osD", strict=True):
    sel = [r for r in rows if r["method"] == method]
    ax1.loglog([r["R"] for r in sel], [r["error"] for r in sel], marker, alpha=0.7, label=method)
    shifts = sorted({r["shift"] for r in sel})
    medians = [np.median([r["error"] for r in sel if r["shift"] == s]) for s in shifts]
    ax2.loglog(shifts, medians, marker + "-", label=method)
lo, hi = min(r["R"] for r in rows), max(r["R"] for r in rows)
xs = np.geomspace(lo, hi, 50)
mus = {r["mu"] for r in rows}
assert len(mus) == 1  # H_0 = δI with δ = 1 in every problem: one μ
ax1.loglog(xs, xs / mus.pop(), "k--", lw=1, label="‖R‖/μ (upper bound)")
ax1.set_xlabel("gradient-mismatch residual ‖R(θ)‖")
ax1.set_ylabel("error ‖θ − θ_{1:T}‖")
ax1.set_title("error against gradient mismatch")
ax1.legend(fontsize=8)
ax2.set_xticks(shifts, [str(s) for s in shifts])
ax2.xaxis.set_minor_formatter(plt.NullFormatter())
ax2.set_xlabel("task shift")
ax2.set_ylabel("median error")
ax2.set_title("error against how far the tasks moved")
ax2.legend(fontsize=8)
fig.tight_layout()
fig.savefig("logistic_error_vs_mismatch.png", dpi=100)

# %% [markdown]
# ## 2. Orders: task arithmetic is first order, gradient matching second order
#
# Scaling the prior H_0 → λH_0 shrinks every task vector like 1/λ. Eq. 2 makes task arithmetic's
# relative error ‖θ − θ_{1:T}‖ / ‖θ_{1:T} − θ_LLM‖ decay like 1/λ, and the Taylor remainder
# makes that of Eq. 6 with exact Hessians decay like 1/λ². The orders fitted between λ and 10λ,
# deep in the asymptotic regime (λ ≥ 100 × max_t ‖H_t‖ / λ_min(H_0)), are within 0.1 of 1 and 2.

# %%
problem = logistic.make_logistic_merge_problem(0, d=3, tasks=3, n_per_task=30, covariate_shift=0.5)
H0 = problem.prior_precision
scale = max(float(torch.linalg.matrix_norm(problem.hessian(t), 2)) for t in range(3))
scale /= float(torch.linalg.eigvalsh(H0)[0])
relative = {m: [] for m in methods}
lambdas = [100 * scale, 1000 * scale]
for lam in lambdas:
    scaled = logistic.LogisticMergeProblem(
        model=problem.model,
        X_pt=problem.X_pt,
        y_pt=problem.y_pt,
        delta=problem.delta,
        X_tasks=problem.X_tasks,
        y_tasks=problem.y_tasks,
        prior_precision=lam * H0,
    )
    lay, _, merged = merges(scaled)
    target = scaled.target(ALPHAS)
    moved = float(torch.linalg.norm(target - scaled.theta_llm))
    for m in methods:
        relative[m].append(float(torch.linalg.norm(lay.flat(merged[m]) - target)) / moved)
orders = {m: math.log(v[0] / v[1]) / math.log(lambdas[1] / lambdas[0]) for m, v in relative.items()}
print({m: round(o, 3) for m, o in orders.items()})
assert abs(orders["task arithmetic"] - 1) < 0.1
assert abs(orders["GM, exact H_t"] - 2) < 0.1
