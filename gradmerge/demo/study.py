r"""The demo's computation: train, estimate, merge, remove, measure. Returns :class:`DemoResults`.

Steps (paper notation; H_0 = δI throughout):

1. θ_LLM: the MLP trained on original images (weight decay ``base_delta``).
2. θ_t = argmin ℓ̄_t(θ) + (δ/2)‖θ − θ_LLM‖² on each shifted task (Eq. 15), to convergence.
3. H_t at θ_t: the GGN in three structures (``gm.estimate_curvature``, ``fisher="ggn"``), and
   RegMean's Gram matrices.
4. For each α of the sweep: the target θ_{1:T}(α) = argmin Σ_t α ℓ̄_t(θ) + (δ/2)‖θ − θ_LLM‖²
   (trained from θ_LLM, to convergence), every merge method, and per method: held-out accuracy
   per task and on the original images, ‖θ − θ_{1:T}‖/‖θ_{1:T} − θ_LLM‖, and the gradient
   mismatch Δ_t(θ) = ∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t) of Eq. 2 (``gm.gradient_mismatch``).
5. Refinement (Sec. 1.5, ``gm.refine``): k steps from the full-curvature merge towards θ_{1:T}(α),
   gradients and full GGN re-estimated at each iterate; and, for comparison, the MAP that Newton's
   method reaches on the same objective from that merge (the multi-task objective of an MLP can
   have several minima).
6. Removal of task r from θ_all = θ_{1:T}(α = 1): θ'_r fine-tuned on D_r from θ_all (Eq. 15),
   Eq. 13 and Koh & Liang in the three structures, against the retrained
   θ_\r = argmin Σ_{t≠r} ℓ̄_t(θ) + (δ/2)‖θ − θ_LLM‖² (from θ_LLM).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from scipy.stats import spearmanr
from torch import Tensor

import gradmerge as gm
from gradmerge import params as P
from gradmerge.demo import methods
from gradmerge.demo.config import DemoConfig
from gradmerge.demo.data import Split, Splits, make_splits
from gradmerge.demo.mlp import MLP
from gradmerge.demo.results import DemoResults
from gradmerge.demo.training import Fit, accuracy, fit_map, gradient_fn
from gradmerge.params import Params


def run_study(
    config: DemoConfig, device: torch.device, *, log: Callable[[str], None]
) -> DemoResults:
    """Run every step of the module docstring on ``device``; ``log`` receives progress lines."""
    timings: dict[str, float] = {}

    @contextmanager
    def stage(name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        timings[name] = time.perf_counter() - start
        log(f"  {name:<34s} {timings[name]:6.1f} s")

    total_start = time.perf_counter()
    mlp = MLP(hidden=config.hidden)
    with stage("data (load_digits)"):
        splits = make_splits(
            config.tasks,
            n_base=config.n_base,
            n_base_test=config.n_base_test,
            n_train=config.n_train,
            n_test=config.n_test,
            seed=config.seed,
        ).to(device)
    names = [t.name for t in splits.tasks]
    delta = config.delta
    training: dict[str, dict] = {}

    def evaluate(theta: Tensor) -> dict[str, float]:
        out = {t.name: accuracy(mlp, theta, t.test) for t in splits.tasks}
        out["original"] = accuracy(mlp, theta, splits.base.test)
        return out

    with stage("base model"):
        base_fit = fit_map(
            mlp,
            [(splits.base.train, 1.0)],
            init=mlp.init(seed=config.seed, device=device),
            delta=config.base_delta,
        )
    training["base"] = base_fit.summary()
    theta_llm = base_fit.theta
    base = mlp.params(theta_llm)

    def finetune(data: list[tuple[Split, float]], start: Tensor, anchor: Tensor) -> Fit:
        return fit_map(mlp, data, init=start, prior_mean=anchor, delta=delta)

    with stage("fine-tunes"):
        fits = [finetune([(t.train, 1.0)], theta_llm, theta_llm) for t in splits.tasks]
    for name, fit in zip(names, fits, strict=True):
        training[f"finetuned/{name}"] = fit.summary()
    finetuned = [mlp.params(f.theta) for f in fits]

    with stage("curvatures (diag, K-FAC, full)"):
        pairs = list(zip(finetuned, splits.tasks, strict=True))
        curvatures = {
            s: [methods.estimate(mlp, ft, t.train, s) for ft, t in pairs]
            for s in methods.STRUCTURES
        }
        grams = [methods.gram_matrices(ft, t.train) for ft, t in pairs]
    gradients = [gradient_fn(mlp, t.train) for t in splits.tasks]

    references = {
        "base": evaluate(theta_llm),
        "finetuned": {name: evaluate(f.theta) for name, f in zip(names, fits, strict=True)},
    }
    rows: list[dict] = []
    eq2: list[dict[str, float]] = []
    refinement: list[dict] = []
    targets: dict[float, Tensor] = {}
    for alpha in sorted(config.alphas):
        with stage(f"target and merges, alpha={alpha:g}"):
            target_fit = finetune([(t.train, alpha) for t in splits.tasks], theta_llm, theta_llm)
            training[f"target/alpha={alpha:g}"] = target_fit.summary()
            targets[alpha] = target_fit.theta
            target = mlp.params(target_fit.theta)
            merged = methods.merge(base, finetuned, curvatures, grams, delta=delta, alphas=alpha)
        with stage(f"refinement ({config.refine_steps} steps), alpha={alpha:g}"):
            start = merged["gm_full"]
            iterates = methods.refine(
                mlp,
                start,
                base,
                [t.train for t in splits.tasks],
                gradients,
                delta=delta,
                alphas=alpha,
                steps=config.refine_steps,
            )
            local: tuple[Params, float] | None = None
            if alpha == config.alpha:
                # the MAP of the same objective that Newton's method reaches from the merge
                # (where refinement can go), whichever minimum θ_1:T, trained from θ_LLM, is
                tasks = [(t.train, alpha) for t in splits.tasks]
                local_fit = finetune(tasks, mlp.flat(start), theta_llm)
                training[f"local/alpha={alpha:g}"] = local_fit.summary()
                local = (mlp.params(local_fit.theta), local_fit.objective)
        with stage(f"measures, alpha={alpha:g}"):
            merged[methods.REFINED] = iterates[-1]
            merged["target"] = target
            for method, params in merged.items():
                rows.append(
                    _merge_row(method, alpha, params, base, target, finetuned, gradients)
                    | {"accuracy": evaluate(mlp.flat(params))}
                )
            eq2.append(_eq2_check(alpha, merged, base, finetuned, gradients, delta))
            refinement.append(
                _refinement(
                    alpha,
                    [start, *iterates],
                    base,
                    (target, target_fit.objective),
                    local,
                    finetuned,
                    gradients,
                    delta,
                    lambda params: _mean(evaluate(mlp.flat(params)), names),
                )
            )

    with stage("removal"):
        removal = _removal(config, mlp, splits, base, targets, finetune, evaluate)
    training.update(removal.pop("training"))
    timings["total"] = time.perf_counter() - total_start
    environment = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    return DemoResults(
        config=config.to_dict(),
        device=str(device),
        tasks=names,
        training=training,
        references=references,
        merge=rows,
        eq2=eq2,
        refinement=refinement,
        removal=removal,
        correlations=_correlations(rows, names),
        timings=timings,
        environment=environment,
    )


def _merge_row(
    method: str,
    alpha: float,
    params: Params,
    base: Params,
    target: Params,
    finetuned: Sequence[Params],
    gradients: Sequence[Callable[[Params], dict[str, Tensor]]],
) -> dict:
    """Distance to the target and the gradient mismatch of Eq. 2 for one merged model."""
    mismatch = gm.gradient_mismatch(params, finetuned, gradients, alphas=alpha)
    return {
        "method": method,
        "alpha": alpha,
        "distance_to_target": gm.params.distance(params, target),
        "relative_distance_to_target": methods.relative_distance(params, target, base),
        "mismatch": mismatch.norms,
        "mismatch_total": mismatch.total,
    }


def _refinement(
    alpha: float,
    path: Sequence[Params],
    base: Params,
    reference: tuple[Params, float],
    local: tuple[Params, float] | None,
    finetuned: Sequence[Params],
    gradients: Sequence[Callable[[Params], dict[str, Tensor]]],
    delta: float,
    mean_accuracy: Callable[[Params], float],
) -> dict:
    """The refinement path θ^0 (the full-curvature merge), θ^1, …, θ^k at one α.

    Per iterate: mean held-out accuracy, the share of the accuracy gap to the target closed,
    (acc(θ^k) − acc(θ^0)) / (acc(θ_1:T) − acc(θ^0)) (None when the merge is not below the
    target), ‖θ^k − θ_1:T‖/‖θ_1:T − θ_LLM‖, the mismatch Σ_t ‖Δ_t(θ^k)‖ of Eq. 2 and the
    stationarity residual ‖R(θ^k)‖ = ‖δ(θ^k − θ_LLM) + Σ_t α ∇ℓ̄_t(θ^k)‖ (0 at every MAP of the
    multi-task objective F). ``reference`` is θ_1:T (trained from θ_LLM) and F there; ``local``
    (or None) the MAP that Newton's method reaches on F from θ^0 and F there: F can have
    several minima.
    """
    target, target_objective = reference
    target_accuracy = mean_accuracy(target)
    start_accuracy = mean_accuracy(path[0])
    gap = target_accuracy - start_accuracy

    def closed(accuracy: float) -> float | None:
        return (accuracy - start_accuracy) / gap if gap > 0 else None

    steps = []
    for k, theta in enumerate(path):
        residual = P.scale(delta, P.sub(theta, base))
        for grad in gradients:
            residual = P.axpy(alpha, grad(theta), residual)
        accuracy = mean_accuracy(theta)
        steps.append(
            {
                "step": k,
                "mean_accuracy": accuracy,
                "gap_closed": closed(accuracy),
                "relative_distance_to_target": methods.relative_distance(theta, target, base),
                "mismatch_total": gm.gradient_mismatch(
                    theta, finetuned, gradients, alphas=alpha
                ).total,
                "residual": P.norm(residual),
            }
        )
    local_map = None
    if local is not None:
        local_accuracy = mean_accuracy(local[0])
        local_map = {
            "mean_accuracy": local_accuracy,
            "gap_closed": closed(local_accuracy),
            "relative_distance_to_target": methods.relative_distance(local[0], target, base),
            "objective": local[1],
        }
    return {
        "alpha": alpha,
        "start": "gm_full",
        "target_mean_accuracy": target_accuracy,
        "target_objective": target_objective,
        "steps": steps,
        "local_map": local_map,
    }


def _eq2_check(
    alpha: float,
    merged: dict[str, dict[str, Tensor]],
    base: Params,
    finetuned: Sequence[Params],
    gradients: Sequence[Callable[[Params], dict[str, Tensor]]],
    delta: float,
) -> dict[str, float]:
    """Eq. 2 at the converged target: θ_1:T = θ_TA − Σ_t α_t H_0⁻¹ Δ_t(θ_1:T), for any loss.

    Returns the task-arithmetic error ‖θ_TA − θ_1:T‖, the mismatch term ‖Σ_t α_t H_0⁻¹ Δ_t‖ that
    Eq. 2 says equals it, and the residual ‖θ_TA − Σ_t α_t H_0⁻¹ Δ_t − θ_1:T‖ of the identity
    (absolute, and relative to ‖θ_1:T − θ_LLM‖). With r_t = ∇F_t(θ_t) and r = ∇F(θ_1:T) the
    gradients left by training, the residual is exactly ‖Σ_t α_t r_t − r‖/δ: zero up to the
    convergence of the fits.
    """
    target, ta = merged["target"], merged["task_arithmetic"]
    correction = gm.gradient_mismatch(
        target, finetuned, gradients, alphas=alpha, prior=delta
    ).correction
    if correction is None:  # cannot happen: a prior was given
        raise RuntimeError("gm.gradient_mismatch returned no correction despite a prior")
    residual = gm.params.distance(gm.params.sub(ta, correction), target)
    return {
        "alpha": alpha,
        "task_arithmetic_error": gm.params.distance(ta, target),
        "mismatch_term": gm.params.norm(correction),
        "residual": residual,
        "relative_residual": residual / gm.params.distance(target, base),
    }


def _removal(
    config: DemoConfig,
    mlp: MLP,
    splits: Splits,
    base: Params,
    targets: dict[float, Tensor],
    finetune: Callable[[list[tuple[Split, float]], Tensor, Tensor], Fit],
    evaluate: Callable[[Tensor], dict[str, float]],
) -> dict:
    """Remove task ``config.remove`` from θ_all with Eq. 13 and Koh & Liang; retrain for truth."""
    theta_llm = mlp.flat(base)
    task = next(t for t in splits.tasks if t.name == config.remove)
    rest = [t for t in splits.tasks if t.name != config.remove]
    if 1.0 in targets:
        theta_all = targets[1.0]
    else:
        theta_all = finetune([(t.train, 1.0) for t in splits.tasks], theta_llm, theta_llm).theta
    everything = mlp.params(theta_all)
    refit = finetune([(t.train, 1.0) for t in rest], theta_llm, theta_llm)
    refinetune = finetune([(task.train, 1.0)], theta_all, theta_all)
    retrained = mlp.params(refit.theta)
    refinetuned = mlp.params(refinetune.theta)
    remaining_data = Split.concat([t.train for t in rest])
    task_gradient = gradient_fn(mlp, task.train)(everything)

    rows: list[tuple[str, str | None, Params]] = [
        ("none (θ_all)", None, everything),
        ("retrained", None, retrained),
    ]
    for structure in methods.STRUCTURES:
        results = methods.remove(
            everything,
            refinetuned,
            methods.estimate(mlp, refinetuned, task.train, structure),
            methods.estimate(mlp, everything, remaining_data, structure),
            task_gradient,
            delta=config.delta,
        )
        rows += [(name, structure, params) for name, params in results.items()]
    out_rows = [
        {
            "method": name,
            "structure": structure,
            "accuracy": evaluate(mlp.flat(params)),
            "relative_error": methods.relative_distance(params, retrained, everything),
        }
        for name, structure, params in rows
    ]
    return {
        "removed": config.remove,
        "rows": out_rows,
        "training": {
            "removal/retrained": refit.summary(),
            f"removal/refinetuned/{config.remove}": refinetune.summary(),
        },
    }


def _mean(accuracy: dict[str, float], tasks: Sequence[str]) -> float:
    """Mean held-out accuracy over ``tasks``."""
    return sum(accuracy[t] for t in tasks) / len(tasks)


def _correlations(rows: list[dict], names: list[str]) -> dict[str, dict[str, float | int]]:
    """Spearman's ρ of held-out error against gradient mismatch over the merged models.

    Per task (one point per method, α and task: 1 − accuracy on task t against ‖Δ_t(θ)‖) and
    per model (mean error over the tasks against Σ_t ‖Δ_t(θ)‖). The targets are left out.
    """
    merged = [r for r in rows if r["method"] != "target"]
    per_task_x = [r["mismatch"][i] for r in merged for i in range(len(names))]
    per_task_y = [1.0 - r["accuracy"][name] for r in merged for name in names]
    total_x = [r["mismatch_total"] for r in merged]
    total_y = [1.0 - sum(r["accuracy"][n] for n in names) / len(names) for r in merged]
    out = {}
    for key, x, y in (
        ("task_error_vs_task_mismatch", per_task_x, per_task_y),
        ("mean_error_vs_total_mismatch", total_x, total_y),
    ):
        rho = spearmanr(np.asarray(x), np.asarray(y)).statistic
        out[key] = {"spearman": float(rho), "points": len(x)}
    return out
