"""How far each merge rule lands from the exact multi-task target on logistic regression.

Not a pass/fail check: a measurement over many random problems (the appendix claims no
inequality between the methods). Methods, all called through gradmerge:

- ``task_arithmetic``: θ_LLM + Σ α_t (θ_t − θ_LLM).
- ``fisher_average``: diagonal Fishers at θ_t (Fisher = Hessian for this model); no prior.
- ``gm_diag``: Eq. 6 with diagonal H_t (the paper's choice) and the exact H_0.
- ``gm_full``: Eq. 6 with the exact Hessians H_t at θ_t.

The error is ‖θ − θ_{1:T}‖ / ‖θ_{1:T} − θ_LLM‖: relative to how far the exact target moved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

import gradmerge as gm
from gradmerge.theory import logistic
from gradmerge.theory.numeric._common import Layout
from gradmerge.theory.numeric.cases import LogisticMergeSpec, LogisticRemovalSpec

METHODS = ("task_arithmetic", "fisher_average", "gm_diag", "gm_full")


def merge_errors(problem: logistic.LogisticMergeProblem, alphas: list[float]) -> dict[str, float]:
    """Relative error of each method, and the gradient mismatch of task arithmetic (Eq. 2)."""
    lay = Layout(problem.model.layout)
    base = lay.params(problem.theta_llm)
    fts = [lay.params(problem.finetuned(t)) for t in range(problem.num_tasks)]
    hessians = [problem.hessian(t) for t in range(problem.num_tasks)]
    diagonals = [gm.Diagonal(lay.params(torch.diagonal(h).clone())) for h in hessians]
    prior = lay.dense(problem.prior_precision)
    merged: dict[str, Callable[[], gm.params.Params]] = {
        "task_arithmetic": lambda: gm.task_arithmetic(base, fts, alphas=alphas),
        "fisher_average": lambda: gm.fisher_average(fts, diagonals, alphas=alphas),
        "gm_diag": lambda: gm.gradient_matching(base, fts, diagonals, prior=prior, alphas=alphas),
        "gm_full": lambda: gm.gradient_matching(
            base, fts, [lay.dense(h) for h in hessians], prior=prior, alphas=alphas
        ),
    }
    target = problem.target(alphas)
    moved = float(torch.linalg.norm(target - problem.theta_llm))
    out = {
        name: float(torch.linalg.norm(lay.flat(fn()) - target)) / moved
        for name, fn in merged.items()
    }
    grads = lay.grad_fns(problem.gradient, problem.num_tasks)
    ta = merged["task_arithmetic"]()
    out["ta_mismatch"] = gm.gradient_mismatch(ta, fts, grads, alphas=alphas).total
    return out


def error_study(seeds: range) -> dict:
    """Error quantiles per method and how often each method is the closest, over ``seeds``."""
    specs = [LogisticMergeSpec.from_seed(s) for s in seeds]
    rows = [merge_errors(spec.build(), list(spec.alphas)) for spec in specs]
    errors = {m: np.array([r[m] for r in rows]) for m in METHODS}
    best = np.argmin(np.stack([errors[m] for m in METHODS]), axis=0)
    return {
        "problems": len(rows),
        "quantiles": {m: _quantiles(e) for m, e in errors.items()},
        "closest": {m: int((best == i).sum()) for i, m in enumerate(METHODS)},
        "gm_full_beats_ta": int((errors["gm_full"] < errors["task_arithmetic"]).sum()),
        "gm_diag_beats_ta": int((errors["gm_diag"] < errors["task_arithmetic"]).sum()),
        "rows": rows,
    }


def prior_scaling_orders(
    seed: int, factors: tuple[float, float] = (30.0, 300.0)
) -> dict[str, float]:
    """Order of each rule's relative error in 1/λ when H_0 → λ·H_0 (fine-tunes move less).

    λ is ``factors`` × c, where c = max_t ‖H_t‖ / λ_min(H_0), so that the prior dominates and the
    expansion is in its asymptotic regime. The task vectors shrink like 1/λ; Eq. 2 makes task
    arithmetic's relative error O(1/λ) and the Taylor remainder makes Eq. 6's O(1/λ²). Returns
    the fitted orders log(e₁/e₂) / log(λ₂/λ₁).
    """
    spec = LogisticMergeSpec.from_seed(seed)
    problem, alphas = spec.build(), list(spec.alphas)
    h0 = problem.prior_precision
    c = max(
        float(torch.linalg.matrix_norm(problem.hessian(t), 2)) for t in range(problem.num_tasks)
    )
    c /= float(torch.linalg.eigvalsh(h0)[0])
    errs = []
    for factor in factors:
        scaled = dataclasses.replace(problem, prior_precision=factor * c * h0)
        errs.append(merge_errors(scaled, alphas))
    span = np.log(factors[1] / factors[0])
    return {
        m: float(np.log(errs[0][m] / errs[1][m]) / span) for m in ("task_arithmetic", "gm_full")
    }


def removal_errors(problem: logistic.LogisticRemovalProblem) -> dict[str, float]:
    """Relative error ‖θ − θ_\\t‖ / ‖θ_\\t − θ_LLM‖ of Eq. 13 and of Koh & Liang (1.0 = no
    removal)."""
    lay = Layout(problem.model.layout)
    base = lay.params(problem.theta_llm)
    remaining = lay.dense(problem.remaining_hessian())
    eq13 = gm.remove(
        base,
        lay.params(problem.finetuned),
        lay.dense(problem.task_hessian()),
        remaining=remaining,
        prior=lay.dense(problem.prior_precision),
        alpha=problem.alpha,
    )
    kl = gm.influence_remove(
        base, lay.params(problem.task_gradient_at_llm()), remaining=remaining, alpha=problem.alpha
    )
    moved = float(torch.linalg.norm(problem.refit - problem.theta_llm))
    return {
        name: float(torch.linalg.norm(lay.flat(result) - problem.refit)) / moved
        for name, result in (("eq13", eq13), ("koh_liang", kl))
    }


def removal_study(seeds: range) -> dict:
    """Error quantiles of both removal rules and how often each is the closer one."""
    rows = [removal_errors(LogisticRemovalSpec.from_seed(s).build()) for s in seeds]
    errors = {m: np.array([r[m] for r in rows]) for m in ("eq13", "koh_liang")}
    return {
        "problems": len(rows),
        "quantiles": {m: _quantiles(e) for m, e in errors.items()},
        "eq13_closer": int((errors["eq13"] < errors["koh_liang"]).sum()),
        "rows": rows,
    }


def _quantiles(errors: np.ndarray) -> dict[str, float]:
    q10, median, q90 = np.quantile(errors, [0.1, 0.5, 0.9]).tolist()
    return {"q10": q10, "median": median, "q90": q90}
