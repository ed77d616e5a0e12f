"""`gradmerge tune`'s label-free criteria against the validation-best α, where the losses are not
quadratic.

Two model families, each with a base model trained on its own data and T tasks fine-tuned from
it, merged by task arithmetic θ(s) = θ_LLM + s Σ_t τ_t over a grid of s:

- the theory testbed's softmax regression (:mod:`gradmerge.theory.logistic`): a base fitted on
  N_0 = r·N_t examples and T tasks fine-tuned to their exact optimum under the base's Laplace
  precision H_0 = δI + ∇²ℓ̄_0(θ_LLM) (the paper's setting: the prior stands for the base task); r
  sets how far each fine-tune goes towards its task's optimum;
- the demo's MLP on scikit-learn's digits (:mod:`gradmerge.demo`): a base on the original
  images, one task per domain shift, one shared head, fine-tuned under δ = 5.

Every s is scored on the training data by the terms of `gradmerge tune`
(:func:`gradmerge.jobs.tune.term`): ``mismatch``, ``loss`` without the base task and ``loss`` with
it (``--base-data``); the validation-best α minimises the mean held-out loss over the data sets,
base included (each weighted alike). On exact quadratic tasks the mismatch is least at the
fine-tunes' average s = 1/T for every r and the loss with the base at (1 + r)/(T + 1)
(proofs_tests/theory/numeric/test_tune_criteria.py); this measures the same beyond quadratics.

    python -m benchmarks.tune_criteria --out benchmarks/results/tune-criteria-cpu.json
    python -m benchmarks.tune_criteria --quick --out /tmp/q.json   # seconds
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import gradmerge as gm
from benchmarks.record import Run, write_result
from gradmerge.jobs.tune import choose, term
from gradmerge.theory.logistic import make_logistic_merge_problem, newton_fit

CRITERIA = ("mismatch", "loss without the base", "loss with the base")

Data = tuple[Tensor, Tensor]


@dataclass
class Case:
    """A base model, its fine-tunes, and the functions of one model family: ``mean_loss(θ,
    data)``, ``gradient(θ, data)`` (a SUM over the examples) and ``accuracy(θ, data)``. The base
    task's data and held-out data come last in ``train`` and ``held_out``."""

    facts: dict[str, Any]
    theta_llm: Tensor
    finetuned: list[Tensor]
    train: list[Data]
    held_out: list[Data]
    mean_loss: Callable[[Tensor, Data], float]
    gradient: Callable[[Tensor, Data], Tensor]
    accuracy: Callable[[Tensor, Data], float] | None = None


def score(case: Case, grid: list[float]) -> dict[str, Any]:
    """Every criterion's curve over the task-arithmetic scales ``grid`` (the terms of
    ``gradmerge tune``), its choice, the validation-best α (least mean held-out loss over the
    data sets, base included) and each choice's held-out loss (and accuracy) against the best's."""
    *tasks, base = case.train
    curves: dict[str, list[float]] = {n: [] for n in (*CRITERIA, "validation", "accuracy")}
    for s in grid:
        finetuned = [{"w": f} for f in case.finetuned]
        theta = gm.task_arithmetic({"w": case.theta_llm}, finetuned, alphas=s)["w"]
        mismatch = loss = 0.0
        for data, own in zip(tasks, case.finetuned, strict=True):
            n = len(data[1])
            mean = case.mean_loss(theta, data)
            gradient, reference = case.gradient(theta, data), case.gradient(own, data)
            mismatch += term(
                "mismatch",
                mean_loss=mean,
                examples=n,
                gradient={"w": gradient},
                reference={"w": reference},
            )
            loss += term("loss", mean_loss=mean, examples=n)
        base_term = term("loss", mean_loss=case.mean_loss(theta, base), examples=len(base[1]))
        curves["mismatch"].append(mismatch)
        curves["loss without the base"].append(loss)
        curves["loss with the base"].append(loss + base_term)
        held_out = case.held_out
        curves["validation"].append(sum(case.mean_loss(theta, d) for d in held_out) / len(held_out))
        if case.accuracy is not None:
            curves["accuracy"].append(
                sum(case.accuracy(theta, d) for d in held_out) / len(held_out)
            )
    best = choose(curves["validation"])
    assert best is not None
    chosen = {name: choose(curves[name]) for name in CRITERIA}
    out: dict[str, Any] = {
        **case.facts,
        "validation-best alpha": grid[best],
        "chosen alpha": {name: grid[i] for name, i in chosen.items() if i is not None},
        "held-out loss above the best": {
            name: curves["validation"][i] - curves["validation"][best]
            for name, i in chosen.items()
            if i is not None
        },
    }
    if case.accuracy is not None:
        top = max(curves["accuracy"])
        out["held-out accuracy below the best (points)"] = {
            name: 100 * (top - curves["accuracy"][i]) for name, i in chosen.items() if i is not None
        }
    else:
        del curves["accuracy"]
    return {**out, "curves": curves}


def logistic_case(seed: int, tasks: int, n: int, ratio: int) -> Case:
    """Softmax regression of the testbed, N_0 = ratio·n, fine-tunes under the base's Laplace
    precision (the base task, with the δ prior θ_LLM was fitted under, is ℓ̄_0)."""
    n0 = ratio * n
    problem = make_logistic_merge_problem(
        seed, d=8, tasks=tasks, n_per_task=2 * n, classes=3, n_pretrain=2 * n0, shift=1.0
    )
    model, delta = problem.model, problem.delta
    train = [(X[:n], y[:n]) for X, y in zip(problem.X_tasks, problem.y_tasks, strict=True)]
    held_out = [(X[n:], y[n:]) for X, y in zip(problem.X_tasks, problem.y_tasks, strict=True)]
    base_train, base_held_out = (
        (problem.X_pt[:n0], problem.y_pt[:n0]),
        (problem.X_pt[n0:], problem.y_pt[n0:]),
    )
    theta_llm, _ = newton_fit(model, *base_train, prior_precision=delta)
    prior = delta * torch.eye(model.num_params, dtype=torch.float64)
    prior = prior + model.hessian(theta_llm, base_train[0])
    finetuned = [
        newton_fit(model, X, y, prior_precision=prior, prior_mean=theta_llm, init=theta_llm)[0]
        for X, y in train
    ]
    return Case(
        facts={"model": "softmax regression", "seed": seed, "T": tasks, "r": ratio, "N_t": n},
        theta_llm=theta_llm,
        finetuned=finetuned,
        train=[*train, base_train],
        held_out=[*held_out, base_held_out],
        mean_loss=lambda theta, d: float(model.loss(theta, *d)) / len(d[1]),
        gradient=lambda theta, d: model.gradient(theta, *d),
    )


def mlp_case(seed: int, tasks: tuple[str, ...]) -> Case:
    """The demo's MLP (64 → 16 → 10) on scikit-learn's digits: θ_LLM on the original images, one
    task per domain shift, every fine-tune from θ_LLM under δ = 5 (the demo's settings), one
    shared head over the same ten labels."""
    from gradmerge.demo.config import DemoConfig
    from gradmerge.demo.data import Split, make_splits
    from gradmerge.demo.mlp import MLP
    from gradmerge.demo.training import accuracy, fit_map

    config = DemoConfig(seed=seed)
    mlp = MLP(hidden=config.hidden)
    splits = make_splits(
        tasks, n_base=config.n_base, n_base_test=config.n_base_test, n_train=150, n_test=100,
        seed=seed,
    )  # fmt: skip
    init = mlp.init(seed=seed)
    theta_llm = fit_map(mlp, [(splits.base.train, 1.0)], init=init, delta=config.base_delta).theta
    finetuned = [
        fit_map(
            mlp, [(t.train, 1.0)], init=theta_llm, prior_mean=theta_llm, delta=config.delta
        ).theta
        for t in splits.tasks
    ]

    def gradient(theta: Tensor, d: Data) -> Tensor:
        theta = theta.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(mlp.losses(theta, *d).sum(), theta)
        return grad

    as_data = lambda split: (split.x, split.y)  # noqa: E731
    return Case(
        facts={"model": "MLP on digits", "seed": seed, "T": len(tasks), "tasks": list(tasks)},
        theta_llm=theta_llm,
        finetuned=finetuned,
        train=[*(as_data(t.train) for t in splits.tasks), as_data(splits.base.train)],
        held_out=[*(as_data(t.test) for t in splits.tasks), as_data(splits.base.test)],
        mean_loss=lambda theta, d: float(mlp.losses(theta, *d).mean()),
        gradient=gradient,
        accuracy=lambda theta, d: accuracy(mlp, theta, Split(*d)),
    )


MLP_TASKS = (("rotated", "mirrored"), ("rotated", "mirrored", "shifted", "noisy"))


def main(argv: list[str] | None = None) -> int:
    """Run every case, print a table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--quick", action="store_true", help="seed 0: softmax regression T = 2, r = 1, 4; MLP T = 2"
    )
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    grid = [round(0.05 * i, 2) for i in range(1, 81)]  # 0.05 … 4.0
    seeds = range(1 if args.quick else args.seeds)
    logistic = [(t, r) for t in (2, 4) for r in (1, 4, 16)]
    run = Run("tune_criteria", settings=vars(args), argv=argv)
    cases = [
        partial(logistic_case, seed, t, 100, r)
        for t, r in logistic[: 2 if args.quick else None]
        for seed in seeds
    ]
    cases += [
        partial(mlp_case, seed, tasks)
        for tasks in MLP_TASKS[: 1 if args.quick else None]
        for seed in seeds
    ]
    rows = []
    print(
        f"{'model':<20} {'T':>2} {'r':>3} {'seed':>4} {'val-best':>8} "
        + " ".join(f"{c:>22}" for c in CRITERIA)
    )
    for build in cases:
        row = score(build(), grid)
        rows.append(row)
        chosen = " ".join(f"{row['chosen alpha'][c]:>22g}" for c in CRITERIA)
        print(f"{row['model']:<20} {row['T']:>2} {row.get('r', '-'):>3} {row['seed']:>4} "
              f"{row['validation-best alpha']:>8g} {chosen}", flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    for model in sorted({row["model"] for row in rows}):
        mine = [row for row in rows if row["model"] == model]
        summary[model] = {}
        for c in CRITERIA:
            losses = [row["held-out loss above the best"][c] for row in mine]
            figures = {
                "cases": len(mine),
                "held-out loss above the best: mean": sum(losses) / len(losses),
                "max": max(losses),
            }
            if "held-out accuracy below the best (points)" in mine[0]:
                points = [row["held-out accuracy below the best (points)"][c] for row in mine]
                figures["held-out accuracy below the best (points): mean"] = sum(points) / len(
                    points
                )
                figures["accuracy max"] = max(points)
            summary[model][c] = figures
            print(f"{model}, {c}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
    write_result(args.out, run.finish({"grid": grid, "summary": summary, "rows": rows}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
