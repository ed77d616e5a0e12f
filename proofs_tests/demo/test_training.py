"""MAP fits of the demo: converged, checked with an independently written objective."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

import gradmerge as gm
from gradmerge.demo.data import make_splits
from gradmerge.demo.mlp import MLP
from gradmerge.demo.training import accuracy, fit_map, gradient_fn, stack


@pytest.fixture(scope="module")
def small():
    splits = make_splits(("rotated", "shifted"), n_base=80, n_train=30, n_test=20, seed=1)
    return splits, MLP(hidden=4)


def _reference_gradient(mlp, theta, data, delta, mean):
    """∇[Σ_j w_j Σ_i CE + (δ/2)‖θ − μ‖²] through the nn.Module and F.cross_entropy."""
    module = mlp.module()

    def objective(params):
        total = sum(
            w * F.cross_entropy(functional_call(module, params, (s.x,)), s.y, reduction="sum")
            for s, w in data
        )
        return total + 0.5 * delta * sum((params[k] - mean[k]).square().sum() for k in params)

    return mlp.flat(grad(objective)(mlp.params(theta)))


def test_base_finetune_and_weighted_target_are_stationary(small):
    splits, mlp = small
    base = fit_map(mlp, [(splits.base.train, 1.0)], init=mlp.init(seed=0), delta=2.0)
    zero = torch.zeros_like(base.theta)
    g = _reference_gradient(mlp, base.theta, [(splits.base.train, 1.0)], 2.0, mlp.params(zero))
    assert base.converged and float(g.abs().max()) <= 1e-9

    task = splits.tasks[0].train
    ft = fit_map(mlp, [(task, 1.0)], init=base.theta, prior_mean=base.theta, delta=5.0)
    # Eq. 10: ∇ℓ̄_t(θ_t) = −δ (θ_t − θ_LLM)
    g_task = mlp.flat(gradient_fn(mlp, task)(mlp.params(ft.theta)))
    torch.testing.assert_close(g_task, -5.0 * (ft.theta - base.theta), rtol=0, atol=1e-9)

    data = [(t.train, a) for t, a in zip(splits.tasks, (0.3, 0.7), strict=True)]
    target = fit_map(mlp, data, init=base.theta, prior_mean=base.theta, delta=5.0)
    g = _reference_gradient(mlp, target.theta, data, 5.0, mlp.params(base.theta))
    assert target.converged and float(g.abs().max()) <= 1e-9
    assert target.grad_norm == pytest.approx(float(g.abs().max()), abs=1e-12)


def test_newton_recovers_from_an_indefinite_start(small):
    """Far from a minimum the Hessian is indefinite: the shifted Newton steps still converge."""
    splits, mlp = small
    start = 6.0 * mlp.init(seed=7)
    x, y, w = stack([(splits.base.train, 1.0)])
    h = mlp.hessian(start, x, y, w) + 0.1 * torch.eye(mlp.num_params, dtype=torch.float64)
    assert float(torch.linalg.eigvalsh(h)[0]) < 0
    fit = fit_map(mlp, [(splits.base.train, 1.0)], init=start, delta=0.1, warm_gtol=float("inf"))
    assert fit.converged and fit.iterations > 3


def test_gradient_fn_and_accuracy(small):
    splits, mlp = small
    theta = mlp.init(seed=2)
    data = splits.tasks[1].train
    ours = gradient_fn(mlp, data)(mlp.params(theta))
    reference = grad(lambda t: mlp.losses(t, data.x, data.y).sum())(theta)
    torch.testing.assert_close(mlp.flat(ours), reference, rtol=1e-13, atol=1e-13)
    predicted = mlp.logits(theta, data.x).argmax(dim=1)
    assert accuracy(mlp, theta, data) == pytest.approx(float((predicted == data.y).double().mean()))


def test_fit_needs_weighted_data(small):
    splits, mlp = small
    with pytest.raises(gm.ArgumentError, match="nonzero weight"):
        fit_map(mlp, [(splits.base.train, 0.0)], init=mlp.init(seed=0), delta=1.0)
