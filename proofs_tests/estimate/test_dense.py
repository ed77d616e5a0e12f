"""Dense curvature estimates against closed forms and brute-force per-example autograd."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.estimate._data import Loss, sample_targets
from gradmerge.estimate.dense import estimate_dense
from gradmerge.theory.logistic import LogisticModel

DT = torch.float64


def _mlp_fn(theta, x, sizes):
    """A hand-written tanh MLP of a flat θ (weight then bias per layer, nn.Linear layout)."""
    h, offset = x, 0
    for i, (n_in, n_out) in enumerate(sizes):
        w = theta[offset : offset + n_in * n_out].reshape(n_out, n_in)
        offset += n_in * n_out
        b = theta[offset : offset + n_out]
        offset += n_out
        h = h @ w.T + b
        if i < len(sizes) - 1:
            h = torch.tanh(h)
    return h


def _setup(seed, sizes=((3, 4), (4, 3)), n=6):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(sizes):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 1:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers).double()
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    X = torch.randn(n, sizes[0][0], dtype=DT)
    return model, theta, X


def _ce(logits, y):
    return torch.nn.functional.cross_entropy(logits, y, reduction="sum")


@given(st.integers(0, 10_000))
def test_hessian_and_empirical_match_brute_force(seed):
    model, theta, X = _setup(seed)
    y = torch.randint(0, 3, (6,))
    sizes = ((3, 4), (4, 3))
    ref_h = sum(
        torch.autograd.functional.hessian(
            lambda th, i=i: _ce(_mlp_fn(th, X[i : i + 1], sizes), y[i : i + 1]), theta
        )
        for i in range(6)
    )
    grads = [
        torch.autograd.functional.jacobian(
            lambda th, i=i: _ce(_mlp_fn(th, X[i : i + 1], sizes), y[i : i + 1]), theta
        )
        for i in range(6)
    ]
    ref_f = sum(torch.outer(g, g) for g in grads)
    data = [(X[:4], y[:4]), (X[4:], y[4:])]  # two batches: sums over batches too
    torch.testing.assert_close(estimate_dense(model, data, fisher="hessian").matrix, ref_h)
    torch.testing.assert_close(estimate_dense(model, data, fisher="empirical").matrix, ref_f)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_ggn_matches_jacobian_formula(loss):
    model, theta, X = _setup(1)
    sizes = ((3, 4), (4, 3))
    y = torch.randint(0, 3, (6,)) if loss == "cross_entropy" else torch.randn(6, 3, dtype=DT)
    ref = torch.zeros(len(theta), len(theta), dtype=DT)
    for i in range(6):
        jac = torch.autograd.functional.jacobian(lambda th, i=i: _mlp_fn(th, X[i], sizes), theta)
        if loss == "mse":
            lam = torch.eye(3, dtype=DT)
        else:
            p = torch.softmax(_mlp_fn(theta, X[i], sizes), dim=-1)
            lam = torch.diag(p) - torch.outer(p, p)
        ref += jac.T @ lam @ jac
    got = estimate_dense(model, [(X, y)], fisher="ggn", loss=loss).matrix
    torch.testing.assert_close(got, ref)


def test_mc_uses_targets_sampled_from_the_model():
    model, _theta, X = _setup(2)
    y = torch.randint(0, 3, (6,))
    got = estimate_dense(model, [(X, y)], fisher="mc", seed=5)
    generator = torch.Generator().manual_seed(5)
    y_hat = sample_targets(model(X), y, Loss(), generator)
    expected = estimate_dense(model, [(X, y_hat)], fisher="empirical")
    torch.testing.assert_close(got.matrix, expected.matrix)


def test_softmax_regression_matches_the_exact_logistic_model():
    """nn.Linear + cross-entropy is softmax regression: Hessian = GGN = Fisher, closed form."""
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3).double()
    X, y = torch.randn(20, 4, dtype=DT), torch.randint(0, 3, (20,))
    theta = torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])
    exact = LogisticModel(4, 3).hessian(theta, X)
    for kind in ("hessian", "ggn"):
        torch.testing.assert_close(estimate_dense(model, [(X, y)], fisher=kind).matrix, exact)


def test_linear_regression_curvature_is_xtx():
    model = torch.nn.Linear(3, 1, bias=False).double()
    X = torch.randn(10, 3, dtype=DT)
    y = torch.randn(10, 1, dtype=DT)
    for kind in ("hessian", "ggn"):
        H = estimate_dense(model, [(X, y)], fisher=kind, loss="mse")
        torch.testing.assert_close(H.matrix, X.T @ X)


def test_ignored_positions_contribute_nothing():
    """Sequence outputs: positions with target ignore_index drop out of every estimate."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 5)
    ).double()
    X = torch.randn(2, 6, 3, dtype=DT)
    y = torch.randint(0, 5, (2, 6))
    y_masked = y.clone()
    y_masked[:, 4:] = -100
    for kind in ("hessian", "ggn", "empirical"):
        full = estimate_dense(model, [(X[:, :4], y[:, :4])], fisher=kind).matrix
        masked = estimate_dense(model, [(X, y_masked)], fisher=kind).matrix
        torch.testing.assert_close(masked, full)


def test_bad_input():
    model, _, X = _setup(0)
    y = torch.randint(0, 3, (6,))
    with pytest.raises(gm.ArgumentError, match="fisher must be"):
        estimate_dense(model, [(X, y)], fisher="kfac")
    with pytest.raises(gm.ArgumentError, match="limit is 10"):
        estimate_dense(model, [(X, y)], max_params=10)
    with pytest.raises(gm.ArgumentError, match="data is empty"):
        estimate_dense(model, [])
    with pytest.raises(gm.StructureError, match="integer class targets"):
        estimate_dense(model, [(X, torch.randn(6, dtype=DT))])
    with pytest.raises(gm.StructureError, match="do not fit targets"):
        estimate_dense(model, [(X, torch.zeros(5, dtype=torch.long))])
    for kind in ("empirical", "ggn", "hessian"):
        with pytest.raises(gm.NonFiniteError, match="batch 1"):
            estimate_dense(model, [(X, y), (X * float("nan"), y)], fisher=kind)
    with pytest.raises(gm.StructureError, match="does not have"):
        estimate_dense(model, [(X, y)], params=["nope"])
    frozen = torch.nn.Linear(2, 2)
    frozen.requires_grad_(False)
    with pytest.raises(gm.StructureError, match="no trainable"):
        estimate_dense(frozen, [(torch.randn(1, 2), torch.zeros(1, dtype=torch.long))])
