"""Iterative refinement (Sec. 1.5's future work) against the exact multi-task target."""

import itertools

import pytest
import torch
from hypothesis import given

import gradmerge as gm
from gradmerge.theory.numeric._common import Layout, rel, vector_layout
from proofs_tests.strategies import linear_merge_specs, logistic_merge_specs


def _inputs(problem, lay, alphas):
    base = lay.params(problem.theta_llm)
    fts = [lay.params(problem.finetuned(t)) for t in range(problem.num_tasks)]
    prior = lay.dense(problem.prior_precision)
    start = gm.gradient_matching(
        base,
        fts,
        [lay.dense(problem.hessian(t)) for t in range(problem.num_tasks)],
        prior=prior,
        alphas=alphas,
    )
    return base, prior, start


@given(spec=logistic_merge_specs())
def test_newton_refinement_converges_to_the_exact_target(spec):
    """With H_t recomputed at the iterate, refinement is damped Newton: from the Eq. 6 merge it
    reaches θ_1:T to the accuracy of the reference target itself (1e-10 relative), and the
    stationarity residual R(θ) = H_0(θ − θ_LLM) + Σ α_t ∇ℓ̄_t(θ) never grows until it reaches
    rounding level (1e-12 of the size of its terms; recomputed here independently of gm.refine)."""
    problem, alphas = spec.build(), list(spec.alphas)
    lay = Layout(problem.model.layout)
    base, prior, start = _inputs(problem, lay, alphas)
    grads = lay.grad_fns(problem.gradient, problem.num_tasks)
    hessians = [
        (lambda p, t=t: lay.dense(problem.hessian(t, lay.flat(p))))
        for t in range(problem.num_tasks)
    ]
    iterates = gm.refine(start, base, grads, hessians, prior=prior, alphas=alphas, steps=30)
    assert rel(lay.flat(iterates[-1]), problem.target(alphas)) <= 1e-10

    def residual(x):
        """‖R(θ)‖ and the size of its terms, ‖H_0(θ − θ_LLM)‖ + Σ α_t ‖∇ℓ̄_t(θ)‖."""
        th = lay.flat(x)
        terms = [problem.prior_precision @ (th - problem.theta_llm)]
        terms += [a * problem.gradient(t, th) for t, a in enumerate(alphas)]
        return float(torch.linalg.norm(sum(terms))), sum(float(torch.linalg.norm(v)) for v in terms)

    norms = [residual(x) for x in [start, *iterates]]
    floor = 1e-12 * max(scale for _, scale in norms)  # rounding level of R
    assert all(b <= a or b <= floor for (a, _), (b, _) in itertools.pairwise(norms))


@given(spec=linear_merge_specs())
def test_one_step_from_anywhere_is_exact_for_quadratic_losses(spec):
    problem, alphas = spec.build(), list(spec.alphas)
    lay = vector_layout(problem.num_params)
    base = lay.params(problem.theta_llm)
    grads = lay.grad_fns(problem.gradient, problem.num_tasks)
    hs = [lay.dense(problem.hessian(t)) for t in range(problem.num_tasks)]
    start = lay.params(torch.randn(problem.num_params, dtype=torch.float64))
    (step,) = gm.refine(
        start, base, grads, hs, prior=lay.dense(problem.prior_precision), alphas=alphas
    )
    assert rel(step["theta"], problem.target(alphas)) <= 1e-9


def test_refine_rejects_bad_arguments():
    base = {"w": torch.zeros(2)}
    grad = [lambda p: {"w": p["w"]}]
    with pytest.raises(gm.ArgumentError, match="steps"):
        gm.refine(base, base, grad, [1.0], prior=1.0, steps=0)
    with pytest.raises(gm.ArgumentError, match="gradient functions"):
        gm.refine(base, base, grad, [1.0, 1.0], prior=1.0)
    with pytest.raises(gm.StructureError, match=r"gradients\[0\]"):
        gm.refine(base, base, [lambda p: {"v": p["w"]}], [1.0], prior=1.0)


def test_a_trial_step_into_a_non_finite_gradient_is_halved_not_an_error():
    """ℓ(θ) = ½(θ − 1)², its gradient NaN beyond |θ| > 1.5 (as a network's loss overflows far
    from its weights); H passed as 1/8 so that the full, half and quarter Newton steps land at
    8, 4 and 2: each trial is refused as no decrease and the eighth, 1/(1 + 8δ), is taken."""
    delta = 1e-3

    def grad(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        g = p["w"] - 1.0
        return {"w": torch.where(p["w"].abs() > 1.5, torch.nan, g)}

    zero = {"w": torch.zeros(1, dtype=torch.float64)}
    (step,) = gm.refine(zero, zero, [grad], [1.0 / 8], prior=delta)
    assert step["w"].item() == pytest.approx(1 / (1 + 8 * delta), rel=1e-12)
    with pytest.raises(gm.NonFiniteError, match=r"gradients\[0\]"):  # at θ^0: an error
        gm.refine({"w": torch.full((1,), 2.0, dtype=torch.float64)}, zero, [grad], [1.0],
                  prior=delta)  # fmt: skip
