"""`gradmerge tune`'s label-free criteria against the validation-best α, on logistic regression.

The theory testbed's softmax regression (:mod:`gradmerge.theory.logistic`, a loss that is not
quadratic): a base model fitted on its own data (N_0 examples), T tasks (N_t each) fine-tuned
from it to their exact optimum under the base's Laplace precision H_0 = δI + ∇²ℓ̄_0(θ_LLM) (the
paper's setting: the prior stands for the base task), merged by task arithmetic θ(s) = θ_LLM +
s Σ_t τ_t. Every α is scored on the tasks' training halves by the criteria of `gradmerge tune`
(:func:`gradmerge.jobs.tune.term`): ``mismatch``, ``loss`` without the base task and ``loss``
with it (``--base-data``); the validation-best α minimises the mean held-out loss over the data
sets, base included (each weighted alike). r = N_0/N_t sets how far each fine-tune goes towards
its task's optimum. On exact quadratic tasks the mismatch is least at the fine-tunes' average
s = 1/T for every r and the loss with the base at (1 + r)/(T + 1)
(proofs_tests/numeric/test_tune_criteria.py); this measures the same on a non-quadratic loss.

    python benchmarks/tune_criteria.py --out benchmarks/results/tune-criteria-cpu.json
    python benchmarks/tune_criteria.py --quick --out /tmp/q.json   # seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import gradmerge as gm
from gradmerge.jobs.tune import choose, term
from gradmerge.theory.logistic import make_logistic_merge_problem, newton_fit

CRITERIA = ("mismatch", "loss without the base", "loss with the base")


def study(seed: int, tasks: int, n: int, ratio: int, grid: list[float]) -> dict:
    """One (seed, T, r) case: every criterion's curve over ``grid``, its choice, the
    validation-best α and each choice's held-out loss above the best's."""
    n0 = ratio * n
    problem = make_logistic_merge_problem(
        seed, d=8, tasks=tasks, n_per_task=2 * n, classes=3, n_pretrain=2 * n0, shift=1.0
    )
    model = problem.model
    train = [(X[:n], y[:n]) for X, y in zip(problem.X_tasks, problem.y_tasks, strict=True)]
    held_out = [(X[n:], y[n:]) for X, y in zip(problem.X_tasks, problem.y_tasks, strict=True)]
    base_train, base_held_out = (
        (problem.X_pt[:n0], problem.y_pt[:n0]),
        (problem.X_pt[n0:], problem.y_pt[n0:]),
    )
    theta_llm, _ = newton_fit(model, *base_train, prior_precision=problem.delta)
    prior = problem.delta * torch.eye(model.num_params, dtype=torch.float64)
    prior = prior + model.hessian(theta_llm, base_train[0])
    finetuned = [
        newton_fit(model, X, y, prior_precision=prior, prior_mean=theta_llm, init=theta_llm)[0]
        for X, y in train
    ]

    def base_loss(theta, X, y):  # the base task: its data and the δ prior θ_LLM was fitted under
        return float(model.loss(theta, X, y)) + problem.delta / 2 * float(theta @ theta)

    def base_gradient(theta):
        return model.gradient(theta, *base_train) + problem.delta * theta

    curves: dict[str, list[float]] = {name: [] for name in (*CRITERIA, "validation")}
    for s in grid:
        theta = gm.task_arithmetic({"w": theta_llm}, [{"w": f} for f in finetuned], alphas=s)["w"]
        mismatch = loss = 0.0
        for (X, y), own in zip(train, finetuned, strict=True):
            mismatch += term(
                "mismatch",
                mean_loss=float("nan"),
                examples=n,
                gradient={"w": model.gradient(theta, X, y)},
                reference={"w": model.gradient(own, X, y)},
            )
            loss += term("loss", mean_loss=float(model.loss(theta, X, y)) / n, examples=n)
        base = term("loss", mean_loss=base_loss(theta, *base_train) / n0, examples=n0)
        curves["mismatch"].append(mismatch)
        curves["loss without the base"].append(loss)
        curves["loss with the base"].append(loss + base)
        data = [*held_out, base_held_out]
        curves["validation"].append(
            sum(float(model.loss(theta, X, y)) / len(y) for X, y in data) / len(data)
        )
    best = choose(curves["validation"])
    assert best is not None
    chosen = {name: choose(curves[name]) for name in CRITERIA}
    return {
        "seed": seed,
        "T": tasks,
        "r": ratio,
        "N_t": n,
        "validation-best alpha": grid[best],
        "chosen alpha": {name: grid[i] for name, i in chosen.items() if i is not None},
        "held-out loss above the best": {
            name: curves["validation"][i] - curves["validation"][best]
            for name, i in chosen.items()
            if i is not None
        },
        "closed forms on quadratic tasks": {
            "mismatch": 1 / tasks,
            "loss with the base": (1 + ratio) / (tasks + 1),
        },
        "curves": curves,
    }


def main(argv: list[str] | None = None) -> int:
    """Run every case, print a table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="one seed, T = 2, r = 1, 4")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    grid = [round(0.05 * i, 2) for i in range(1, 81)]  # 0.05 … 4.0
    seeds = range(1 if args.quick else args.seeds)
    cases = [
        (t, r)
        for t in ((2,) if args.quick else (2, 4))
        for r in ((1, 4) if args.quick else (1, 4, 16))
    ]
    start = time.perf_counter()
    rows = [study(seed, t, 100, r, grid) for t, r in cases for seed in seeds]
    header = f"{'T':>2} {'r':>3} {'seed':>4} {'val-best':>8} " + " ".join(
        f"{c:>22}" for c in CRITERIA
    )
    print(header)
    for row in rows:
        chosen = " ".join(f"{row['chosen alpha'][c]:>22g}" for c in CRITERIA)
        print(
            f"{row['T']:>2} {row['r']:>3} {row['seed']:>4} {row['validation-best alpha']:>8g} {chosen}"
        )
    regrets = {c: [row["held-out loss above the best"][c] for row in rows] for c in CRITERIA}
    summary = {
        c: {"mean": sum(v) / len(v), "max": max(v), "cases": len(v)} for c, v in regrets.items()
    }
    for c, figures in summary.items():
        print(f"{c}: held-out loss above the validation-best α, mean {figures['mean']:.4f}, "
              f"max {figures['max']:.4f} over {figures['cases']} cases")  # fmt: skip
    body = {
        "benchmark": "tune_criteria",
        "held-out loss above the best (nats)": summary,
        "command": "python benchmarks/tune_criteria.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "grid": grid,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    args.out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
