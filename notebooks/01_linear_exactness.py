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
# # Linear regression: merging (Eq. 6) and removal (Eq. 13) are exact
#
# For quadratic losses the Taylor expansion behind the paper's rules has no remainder, so the
# merge rule and the removal rule are *identities*. This notebook checks them through the public
# `gradmerge` functions against closed forms solved here with `torch.linalg.solve` (and, for
# leave-one-out removal, against Cook's formula and statsmodels).
#
# | paper | code | here |
# |---|---|---|
# | θ_LLM | `base` | ridge fit on pretraining data, (X_ptᵀX_pt + δI)⁻¹X_ptᵀy_pt (Eq. 7) |
# | θ_t | `finetuned[t]` | argmin ½‖y_t − X_tθ‖² + ½‖θ − θ_LLM‖²_{H_0} (Eq. 15) |
# | H_t | `curvatures[t]` | X_tᵀX_t, a SUM over task t's examples |
# | H_0 | `prior` | an SPD matrix (the fine-tuning prior's precision) |
# | α_t | `alphas` | task weights |
# | θ_{1:T} | target | argmin Σ_t α_t ½‖y_t − X_tθ‖² + ½‖θ − θ_LLM‖²_{H_0} |
#
# Eq. 6: θ = θ_LLM + H̄⁻¹ Σ_t α_t (H_0 + H_t)(θ_t − θ_LLM), H̄ = H_0 + Σ_t α_t H_t.

# %%
import matplotlib.pyplot as plt
import statsmodels.api as sm
import torch

import gradmerge as gm
from gradmerge.theory import linear

plt.switch_backend("Agg")
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)  # tiny systems: extra threads only wait on each other


def as_params(theta):
    """A flat θ as the parameter dict gradmerge works on."""
    return {"theta": theta}


def as_curvature(matrix):
    """A p×p matrix as a dense curvature over that dict."""
    return gm.Dense(matrix, as_params(torch.zeros(matrix.shape[0])))


def rel(a, b):
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


# %% [markdown]
# ## 1. The merge equals the multi-task MAP
#
# Three tasks with 4 examples each in d = 6 dimensions: every H_t = X_tᵀX_t is singular (rank
# 4), the features are ill-conditioned (condition number 10³) and each task has its own feature
# rotation, so the tasks pull in different directions. H_0 keeps every system definite.

# %%
problem = linear.make_linear_merge_problem(
    0, d=6, tasks=3, n_per_task=4, condition=1e3, covariate_shift=0.5
)
alphas = [0.5, 1.0, 1.5]
H0 = problem.prior_precision
base = as_params(problem.theta_llm)
finetuned = [as_params(problem.finetuned(t)) for t in range(3)]
curvatures = [as_curvature(problem.X_tasks[t].T @ problem.X_tasks[t]) for t in range(3)]

# the reference: the normal equations of the multi-task objective, solved directly
lhs = H0 + sum(a * X.T @ X for a, X in zip(alphas, problem.X_tasks, strict=True))
rhs = H0 @ problem.theta_llm + sum(
    a * X.T @ y for a, X, y in zip(alphas, problem.X_tasks, problem.y_tasks, strict=True)
)
target = torch.linalg.solve(lhs, rhs)

merged = gm.gradient_matching(base, finetuned, curvatures, prior=as_curvature(H0), alphas=alphas)
ta = gm.task_arithmetic(base, finetuned, alphas=alphas)
print(f"gradient matching (Eq. 6): relative error {rel(merged['theta'], target):.1e}")
print(f"task arithmetic:           relative error {rel(ta['theta'], target):.1e}")
assert rel(merged["theta"], target) < 1e-10
assert rel(ta["theta"], target) > 1e-2  # task arithmetic is not exact, even here

# %% [markdown]
# ## 2. Eq. 2: task arithmetic's error is the gradient mismatch
#
# At the exact target, θ_{1:T} = θ_TA − Σ_t α_t H_0⁻¹ [∇ℓ̄_t(θ_{1:T}) − ∇ℓ̄_t(θ_t)], for any loss.
# `gm.gradient_mismatch` returns the per-task Δ_t and this correction.

# %%
gradients = [
    (lambda p, t=t: as_params(problem.gradient(t, p["theta"]))) for t in range(3)
]  # θ ↦ ∇ℓ̄_t(θ) = X_tᵀ(X_tθ − y_t)
mismatch = gm.gradient_mismatch(
    as_params(target), finetuned, gradients, alphas=alphas, prior=as_curvature(H0)
)
print("‖Δ_t‖ at the target:", [f"{n:.3f}" for n in mismatch.norms])
assert rel(ta["theta"] - mismatch.correction["theta"], target) < 1e-10

# %% [markdown]
# ## 3. Exact for every α, unlike task arithmetic
#
# Scaling every α_t by s moves the target; Eq. 6 follows it exactly.

# %%
scales = torch.linspace(0.1, 2.0, 12)
errors = {"task arithmetic": [], "gradient matching (Eq. 6)": []}
for s in scales.tolist():
    a = [s * x for x in alphas]
    goal = problem.target(a)
    errors["task arithmetic"].append(
        rel(gm.task_arithmetic(base, finetuned, alphas=a)["theta"], goal)
    )
    gm_merge = gm.gradient_matching(base, finetuned, curvatures, prior=as_curvature(H0), alphas=a)
    errors["gradient matching (Eq. 6)"].append(rel(gm_merge["theta"], goal))
assert max(errors["gradient matching (Eq. 6)"]) < 1e-10

fig, ax = plt.subplots(figsize=(5, 3.2))
for name, values in errors.items():
    ax.semilogy(scales, [max(v, 1e-17) for v in values], "o-", label=name)
ax.set_xlabel("α scale s (α_t = s · α_t⁰)")
ax.set_ylabel("‖θ − θ_{1:T}‖ / ‖θ_{1:T}‖")
ax.set_title("Linear regression: Eq. 6 is exact")
ax.legend()
fig.tight_layout()
fig.savefig("linear_merge_exactness.png", dpi=100)

# %% [markdown]
# ## 4. Removal (Eq. 13) equals retraining without the data
#
# A model trained on D_\t ∪ D_t with weight α_t on D_t (Eq. 9); D_t is removed with
#
# θ_\t = θ_LLM − α_t H̄_\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM),   H̄_\t = δI + X_\tᵀX_\t   (Eq. 13),
#
# where θ_t is the fine-tune of Eq. 15. Koh & Liang's influence step
# θ_LLM + α_t H̄_\t⁻¹ ∇ℓ̄_t(θ_LLM) is exact as well. The reference is the ridge refit on the
# data that stay.

# %%
for alpha in (1.0, 0.4):
    rp = linear.make_linear_removal_problem(1, d=6, n_keep=30, n_remove=5, alpha=alpha)
    refit = torch.linalg.solve(
        rp.delta * torch.eye(6) + rp.X_keep.T @ rp.X_keep, rp.X_keep.T @ rp.y_keep
    )
    remaining = as_curvature(rp.delta * torch.eye(6) + rp.X_keep.T @ rp.X_keep)  # H̄_\t
    removed = gm.remove(
        as_params(rp.theta_llm),
        as_params(rp.finetuned),
        as_curvature(rp.X_t.T @ rp.X_t),
        remaining=remaining,
        prior=as_curvature(rp.prior_precision),
        alpha=alpha,
    )
    influence = gm.influence_remove(
        as_params(rp.theta_llm),
        as_params(rp.task_gradient_at_llm()),
        remaining=remaining,
        alpha=alpha,
    )
    moved = rel(rp.theta_llm, refit)
    print(
        f"α_t = {alpha}: removal moves θ by {moved:.2f} (relative); error of Eq. 13 "
        f"{rel(removed['theta'], refit):.1e}, of Koh & Liang {rel(influence['theta'], refit):.1e}"
    )
    assert rel(removed["theta"], refit) < 1e-10 and rel(influence["theta"], refit) < 1e-10

# %% [markdown]
# ## 5. Leave-one-out: Eq. 13 is Cook's formula
#
# Removing one example (x_i, y_i) from a ridge fit θ = H̄⁻¹Xᵀy, H̄ = XᵀX + δI, has the classical
# closed form (Sherman–Morrison; Cook, 1977)
#
# θ_{−i} = θ − H̄⁻¹ x_i e_i / (1 − h_ii),   e_i = y_i − x_iᵀθ,   h_ii = x_iᵀH̄⁻¹x_i.
#
# Eq. 13 (α_t = 1, H_t = x_i x_iᵀ, any SPD H_0 for the fine-tune) gives the same, for every i.
# With δ = 0 (ordinary least squares) both are also compared with statsmodels'
# exact leave-one-out parameters (`get_influence().params_not_obsi`).

# %%
g = torch.Generator().manual_seed(2)
n, d = 12, 4
X = torch.randn(n, d, generator=g)
y = X @ torch.randn(d, generator=g) + 0.3 * torch.randn(n, generator=g)
prior = torch.eye(d) + 0.5 * torch.ones(d, d)  # H_0 of the one-example fine-tunes (SPD)

for delta in (0.7, 0.0):
    Hbar = X.T @ X + delta * torch.eye(d)
    theta = torch.linalg.solve(Hbar, X.T @ y)
    if delta == 0.0:
        oracle = torch.as_tensor(sm.OLS(y.numpy(), X.numpy()).fit().get_influence().params_not_obsi)
    worst = 0.0
    for i in range(n):
        x_i, y_i = X[i], y[i]
        keep = torch.arange(n) != i
        h_ii = x_i @ torch.linalg.solve(Hbar, x_i)
        cook = theta - torch.linalg.solve(Hbar, x_i) * (y_i - x_i @ theta) / (1 - h_ii)
        # θ_t: the fine-tune of θ on {(x_i, y_i)} with prior H_0 (Eq. 15), in closed form
        theta_t = torch.linalg.solve(prior + torch.outer(x_i, x_i), prior @ theta + x_i * y_i)
        removed = gm.remove(
            as_params(theta),
            as_params(theta_t),
            as_curvature(torch.outer(x_i, x_i)),
            remaining=as_curvature(X[keep].T @ X[keep] + delta * torch.eye(d)),
            prior=as_curvature(prior),
        )["theta"]
        worst = max(worst, rel(removed, cook))
        if delta == 0.0:
            worst = max(worst, rel(removed, oracle[i]))
    print(f"δ = {delta}: largest relative difference over the {n} removals: {worst:.1e}")
    assert worst < 1e-10
