"""Why Eq. 2's gradient mismatch chooses too small an α, on exact quadratic tasks (issue 32).

The tasks are linear regressions of the theory testbed (:class:`gradmerge.theory.linear.
LinearMergeProblem`) built so that every closed form is exact: each task t has X_t = √d·I (N_t =
d examples, mean Hessian I) and a noise-free optimum m_t = θ_LLM + c·e_t (orthogonal task
vectors of equal length); the base's data are k copies of √d·I (N_0 = k·d, mean Hessian I) and
the fine-tunes' prior is the base's own Hessian H_0 = δI + X_ptᵀX_pt (the paper's setting: the
prior stands for the base task). Each fine-tune then stops at τ_t = (m_t − θ_LLM)/(1 + r),
r = (N_0 + δ)/N_t, and the training losses ARE the population losses, so the validation-best α of
a mean over the data sets (base included) is known in closed form. On task arithmetic's line
θ(s) = θ_LLM + s Σ_t τ_t (built by gm.task_arithmetic), with a_0 = 1 + δ/N_0 the base's mean
curvature:

- the ``loss`` criterion with the base, J(s) = Σ_t L̄_t(θ(s)) + L̄_0(θ(s)), is least at
  s* = (1 + r)/(T + a_0), which is the validation-best α;
- the ``mismatch`` criterion, J(s) = Σ_t ‖∇ℓ̄_t(θ(s)) − ∇ℓ̄_t(θ_t)‖/N_t, equals
  T·‖τ‖·((s − 1)² + (T − 1)s²)^½ and is least at s = 1/T, whatever r: the fine-tunes' average;
- Eq. 2's correction Σ_t α_t H_0⁻¹Δ_t (gm.gradient_mismatch with α_t = s), the mismatch weighted
  by α, is s·|Ts − 1|·N_t‖S‖/h_0: the rule's error against its own target θ_{1:T}(s), zero at
  s = 0 and s = 1/T, so weighting by α does not fix the choice either;
- the Eq. 2 residual with the base term, in the norm of the merge's error, is the training loss
  with the base (on random anisotropic tasks).

The criteria's terms and the choice are the functions ``gradmerge tune`` calls
(:func:`gradmerge.jobs.tune.term`, :func:`~gradmerge.jobs.tune.choose`,
:func:`~gradmerge.jobs.tune.grid_edges`).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.jobs.tune import Setting, choose, grid_edges, term
from gradmerge.theory.linear import LinearMergeProblem, loss

F64 = torch.float64
DELTA = 1e-3


def _problem(tasks: int, k: int, c: float = 1.0) -> LinearMergeProblem:
    """T exact isotropic tasks over d = T + 1 parameters, the base's data k copies of √d·I."""
    d = tasks + 1
    eye = math.sqrt(d) * torch.eye(d, dtype=F64)
    base_optimum = torch.linspace(-1.0, 1.0, d, dtype=F64)
    X_pt = eye.repeat(k, 1)
    # the base's fit under δ: θ_LLM = N_0/(N_0 + δ) · base_optimum; tasks move from θ_LLM
    theta_llm = k * d / (k * d + DELTA) * base_optimum
    optima = [theta_llm + c * torch.eye(d, dtype=F64)[t] for t in range(tasks)]
    problem = LinearMergeProblem(
        X_pt=X_pt,
        y_pt=X_pt @ base_optimum,
        delta=DELTA,
        X_tasks=tuple(eye for _ in optima),
        y_tasks=tuple(eye @ m for m in optima),
        prior_precision=(k * d + DELTA) * torch.eye(d, dtype=F64),
    )
    assert torch.allclose(problem.theta_llm, theta_llm, rtol=0, atol=1e-12)
    assert torch.allclose(
        problem.pretraining_hessian(), problem.prior_precision, rtol=1e-15, atol=0
    )
    return problem


def _line(problem: LinearMergeProblem, s: float) -> torch.Tensor:
    """θ(s), task arithmetic at α_t = s (the library's rule)."""
    base = {"w": problem.theta_llm}
    finetuned = [{"w": theta} for theta in problem.finetuned_all]
    return gm.task_arithmetic(base, finetuned, alphas=s)["w"]


def _terms(problem: LinearMergeProblem, s: float, criterion: str, base: bool) -> list[float]:
    """Each task's term of ``gradmerge tune``'s criterion at θ(s) (the base task's last)."""
    theta = _line(problem, s)
    d = problem.num_params
    out = []
    for t in range(problem.num_tasks):
        X, y = problem.X_tasks[t], problem.y_tasks[t]
        out.append(
            term(
                criterion,
                mean_loss=float(loss(theta, X, y)) / d,
                examples=d,
                gradient={"w": problem.gradient(t, theta)},
                reference={"w": problem.gradient(t, problem.finetuned(t))},
            )
        )
    if base:  # ℓ̄_0 = the base's summed loss + its prior's δ/2‖θ‖² (exactly what θ_LLM minimises)
        N0 = problem.X_pt.shape[0]

        def base_gradient(w: torch.Tensor) -> torch.Tensor:
            return problem.X_pt.T @ (problem.X_pt @ w - problem.y_pt) + DELTA * w

        base_loss = float(loss(theta, problem.X_pt, problem.y_pt)) + DELTA / 2 * float(
            theta @ theta
        )
        out.append(
            term(
                criterion,
                mean_loss=base_loss / N0,
                examples=N0,
                gradient={"w": base_gradient(theta)},
                reference={"w": base_gradient(problem.theta_llm)},
            )
        )
    return out


def _criterion(problem: LinearMergeProblem, s: float, criterion: str, base: bool) -> float:
    return sum(_terms(problem, s, criterion, base))


def _population_loss(problem: LinearMergeProblem, s: float) -> float:
    """The mean over the data sets, base included, of the expected loss on new examples: the
    data are noise-free with mean Hessian I, so data set t's is ½‖θ(s) − m_t‖², m_t its optimum
    (read from the generating optima, not through the criteria's code)."""
    d = problem.num_params
    theta = _line(problem, s)
    optima = [
        torch.linalg.solve(X, y) for X, y in zip(problem.X_tasks, problem.y_tasks, strict=True)
    ]
    optima.append(problem.y_pt[:d] / math.sqrt(d))  # the base's: X_pt's first block is √d·I
    return sum(0.5 * float((theta - m).square().sum()) for m in optima) / len(optima)


def _quadratic_minimiser(f) -> float:
    """The minimiser of a quadratic f(s), from f at 0, 1, 2."""
    f0, f1, f2 = f(0.0), f(1.0), f(2.0)
    curvature = (f2 - 2 * f1 + f0) / 2
    return -(f1 - f0 - curvature) / (2 * curvature)


@given(tasks=st.integers(2, 5), k=st.integers(1, 30))
def test_the_closed_forms_of_both_criteria(tasks, k):
    problem = _problem(tasks, k)
    r = (k * problem.num_params + DELTA) / problem.num_params
    a0 = 1 + DELTA / (k * problem.num_params)
    tau = [theta - problem.theta_llm for theta in problem.finetuned_all]
    for t in range(tasks):  # each fine-tune stops at 1/(1 + r) of the way to its optimum
        assert torch.allclose(tau[t], torch.eye(tasks + 1, dtype=F64)[t] / (1 + r), atol=1e-12)
    # the training loss with the base is quadratic in s, least at s* = (1 + r)/(T + a_0)
    best = _quadratic_minimiser(lambda s: _criterion(problem, s, "loss", base=True))
    assert math.isclose(best, (1 + r) / (tasks + a0), rel_tol=1e-9)
    # without the base it is least at (1 + r)/T: the base is needed for a mean over all data sets
    alone = _quadratic_minimiser(lambda s: _criterion(problem, s, "loss", base=False))
    assert math.isclose(alone, (1 + r) / tasks, rel_tol=1e-9)
    # the mismatch is T·‖τ‖·((s − 1)² + (T − 1)s²)^½ at every s: least at 1/T, for every r
    length = float(tau[0].norm())
    for s in (0.0, 0.1, 1 / tasks, 0.7, 1.0, 2.5):
        expected = tasks * length * math.sqrt((s - 1) ** 2 + (tasks - 1) * s**2)
        assert math.isclose(_criterion(problem, s, "mismatch", False), expected, rel_tol=1e-9)
    # so its least value is at 1/T (the fine-tunes' average), however large r is
    grid = [1 / tasks - 0.01, 1 / tasks, 1 / tasks + 0.01]
    assert choose([_criterion(problem, s, "mismatch", False) for s in grid]) == 1


def test_the_mismatch_picks_the_grids_lowest_point_where_the_loss_finds_the_best_alpha():
    # T = 4 tasks, the base trained on 3x a task's data: s* = 4/5, the mismatch's 1/T = 1/4
    problem = _problem(tasks=4, k=3)
    grid = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0]
    points = [Setting(s) for s in grid]
    validation = [_population_loss(problem, s) for s in grid]
    best = validation.index(min(validation))
    assert grid[best] == 0.8

    by_loss = [_criterion(problem, s, "loss", base=True) for s in grid]
    assert choose(by_loss) == best and grid_edges(points, by_loss, best) == []

    by_mismatch = [_criterion(problem, s, "mismatch", base=False) for s in grid]
    chosen = choose(by_mismatch)
    assert chosen == 0
    assert grid_edges(points, by_mismatch, chosen) == [
        {"axis": "scale", "side": "lowest", "value": 0.3, "flag": "--scales"}
    ]
    # the base task's mismatch grows with s: adding it cannot lift the choice off the edge
    with_base = [_criterion(problem, s, "mismatch", base=True) for s in grid]
    assert choose(with_base) == 0
    # the training loss without the base task overshoots: (1 + r)/T = 1 on this grid
    assert grid[choose([_criterion(problem, s, "loss", base=False) for s in grid])] == 1.0


@pytest.mark.parametrize("k", [1, 3, 30])
def test_eq_2s_correction_weighted_by_alpha_measures_the_rule_not_the_target(k):
    """‖Σ_t α_t H_0⁻¹Δ_t(θ(s))‖ with α_t = s, the error of task arithmetic against ITS OWN target
    θ_{1:T}(s), is s·|Ts − 1|·N_t‖S‖/h_0 (H_t = N_t·I, H_0 = h_0·I, S = Σ_t τ_t): zero at s = 0,
    where every merge is exact, and at s = 1/T, where Eq. 6 with equal curvatures is task
    arithmetic; it says how exact the rule is for the target at s, not which s is good."""
    tasks = 3
    problem = _problem(tasks=tasks, k=k)
    d = problem.num_params
    prior = float(problem.prior_precision[0, 0])  # H_0 = h_0·I
    finetuned = [{"w": theta} for theta in problem.finetuned_all]
    gradients = [lambda p, t=t: {"w": problem.gradient(t, p["w"])} for t in range(tasks)]
    length = float(sum(theta - problem.theta_llm for theta in problem.finetuned_all).norm())
    for s in (0.0, 0.05, 0.2, 1 / tasks, 0.5, 1.0):
        mismatch = gm.gradient_mismatch(
            {"w": _line(problem, s)}, finetuned, gradients, alphas=s, prior=prior
        )
        expected = s * abs(tasks * s - 1) * d * length / prior
        assert math.isclose(
            float(mismatch.correction["w"].norm()), expected, rel_tol=1e-9, abs_tol=1e-14
        )
        # Eq. 2 itself: θ_{1:T}(s) = θ_TA(s) − the correction at the exact target
        exact = gm.gradient_mismatch(
            {"w": problem.target(s)}, finetuned, gradients, alphas=s, prior=prior
        )
        assert torch.allclose(
            problem.target(s), _line(problem, s) - exact.correction["w"], atol=1e-12
        )


@given(seed=st.integers(0, 2**31 - 1), tasks=st.integers(1, 4))
def test_eq_2s_residual_in_the_error_norm_is_the_training_loss(seed, tasks):
    """‖R(θ)‖²_{H̄⁻¹} = 2(F(θ) − F(θ*)) for F = Σ_t ℓ̄_t/N_t + ℓ̄_0/N_0 (R = ∇F, H̄ = ∇²F) on
    random anisotropic linear tasks: the curvature-weighted Eq. 2 residual, base included, ranks
    merges exactly as the ``loss`` criterion with the base's data does."""
    from gradmerge.theory.linear import make_linear_merge_problem

    problem = make_linear_merge_problem(seed, d=5, tasks=tasks, n_per_task=7)
    n = [X.shape[0] for X in problem.X_tasks]
    N0 = problem.X_pt.shape[0]
    prior = problem.pretraining_hessian()

    def objective(theta):
        value = sum(float(problem.loss(t, theta)) / n[t] for t in range(tasks))
        base = float(loss(theta, problem.X_pt, problem.y_pt)) + problem.delta / 2 * float(
            theta @ theta
        )
        return value + base / N0

    def residual(theta):
        grad = sum(problem.gradient(t, theta) / n[t] for t in range(tasks))
        return (
            grad
            + (problem.X_pt.T @ (problem.X_pt @ theta - problem.y_pt) + problem.delta * theta) / N0
        )

    H = sum(problem.hessian(t) / n[t] for t in range(tasks)) + prior / N0
    optimum = torch.linalg.solve(H, H @ problem.theta_llm - residual(problem.theta_llm))
    for s in (0.0, 0.5, 1.0, 1.7):
        theta = problem.theta_llm + s * sum(
            problem.finetuned(t) - problem.theta_llm for t in range(tasks)
        )
        R = residual(theta)
        lhs = float(R @ torch.linalg.solve(H, R))
        rhs = 2 * (objective(theta) - objective(optimum))
        assert math.isclose(lhs, rhs, rel_tol=1e-7, abs_tol=1e-12)
