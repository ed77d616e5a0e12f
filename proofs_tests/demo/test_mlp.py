"""The demo's MLP: its closed-form Hessian against brute-force autograd, its nn.Module twin."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, hessian

from gradmerge.demo.mlp import MLP


def _problem(hidden: int, inputs: int, classes: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mlp = MLP(hidden=hidden, inputs=inputs, classes=classes)
    theta = 2.0 * mlp.init(seed=seed)  # larger than the init: saturating tanh units too
    x = torch.randn(n, inputs, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    w = torch.rand(n, generator=g, dtype=torch.float64)
    w[0] = 0.0  # a zero weight (the target's α = 0 case)
    return mlp, theta, x, y, w


@pytest.mark.parametrize(
    ("hidden", "inputs", "classes", "n", "seed"),
    [(1, 2, 2, 3, 0), (3, 5, 4, 9, 1), (6, 7, 10, 20, 2)],
)
def test_hessian_equals_torch_func_hessian(hidden, inputs, classes, n, seed):
    mlp, theta, x, y, w = _problem(hidden, inputs, classes, n, seed)
    ours = mlp.hessian(theta, x, y, w)
    reference = hessian(lambda t: (w * mlp.losses(t, x, y)).sum())(theta)
    assert ours.shape == (mlp.num_params, mlp.num_params)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, ours.T, rtol=0, atol=0)


def test_hessian_is_not_the_ggn():
    """The closed form keeps the second-order terms of the network (it is not a GGN)."""
    mlp, theta, x, y, w = _problem(3, 4, 3, 8, 5)
    full = mlp.hessian(theta, x, y, w)
    jac = torch.func.jacrev(lambda t: mlp.logits(t, x))(theta)  # (n, C, P)
    p = torch.softmax(mlp.logits(theta, x), dim=1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    ggn = torch.einsum("i,icp,icd,idq->pq", w, jac, lam, jac)
    assert float((full - ggn).abs().max()) > 1e-3


def test_module_and_flat_parameters_agree():
    mlp = MLP(hidden=5)
    theta = mlp.init(seed=3)
    module = mlp.module()
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in mlp.layout]
    x = torch.rand(7, 64, dtype=torch.float64)
    torch.testing.assert_close(
        functional_call(module, mlp.params(theta), (x,)), mlp.logits(theta, x), rtol=0, atol=0
    )
    torch.testing.assert_close(mlp.flat(mlp.params(theta)), theta, rtol=0, atol=0)
    assert mlp.num_params == theta.numel() == 5 * 65 + 10 * 6


def test_init_follows_nn_linear_bounds_and_seed():
    mlp = MLP(hidden=8)
    a, b = mlp.init(seed=0), mlp.init(seed=1)
    assert torch.equal(a, mlp.init(seed=0)) and not torch.equal(a, b)
    params = mlp.params(a)
    assert float(params["0.weight"].abs().max()) <= 1 / 64**0.5
    assert float(params["2.weight"].abs().max()) <= 1 / 8**0.5
