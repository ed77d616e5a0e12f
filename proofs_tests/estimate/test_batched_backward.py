"""Several output vectors per backward pass (``_batched``) and the summed squares of separable
layers (``Rule.sq_sum_of_squares``), against one-vector-at-a-time autograd and brute force.

- ``Backward.grads`` with R vectors equals R separate ``torch.autograd.grad`` calls; a graph whose
  backward cannot be vmapped (data-dependent control flow) falls back to them, exactly;
- the diagonal and K-FAC estimators give the same result batched, one vector per pass, and in
  groups cut small by the memory budget (masks and weight sharing included);
- ``Σ_r`` of squared per-example gradients through ``Σ_r g_r²`` (Linear and LayerNorm without
  positions) equals the per-example loop of ``test_diagonal``;
- the estimators do not import transformers for models that do not use it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from gradmerge.estimate import _batched
from gradmerge.estimate._batched import Backward
from gradmerge.estimate.diagonal import estimate_diagonal
from gradmerge.estimate.kfac import estimate_kfac_factors
from proofs_tests.estimate.test_diagonal import (
    CNN,
    F64,
    assert_close,
    brute_force,
    class_data,
    cnn_data,
    dense_ggn_diagonal,
    mlp,
    rows,
    seq_data,
    seq_model,
)
from proofs_tests.estimate.test_kfac_factors import _TokenNet
from proofs_tests.limits import HANG_S


class _SignGate(torch.autograd.Function):
    """Identity whose backward branches on the data: vmap (hence ``is_grads_batched``) refuses."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g if bool(g.abs().sum() >= 0) else -g


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net[4](_SignGate.apply(self.net[3](self.net[2](self.net[1](self.net[0](x))))))


def _one_at_a_time(outputs, inputs, vectors):
    return [
        torch.stack(gs)
        for gs in zip(
            *(torch.autograd.grad(outputs, inputs, v, retain_graph=True) for v in vectors),
            strict=True,
        )
    ]


@pytest.mark.parametrize("model_cls", [mlp, Gated])
def test_backward_grads_equal_one_pass_per_vector(model_cls):
    model = model_cls()
    x = torch.randn(6, 5, dtype=F64)
    hidden = []
    handle = model.get_submodule("net.2" if model_cls is Gated else "2").register_forward_hook(
        lambda m, a, out: hidden.append(out)
    )
    f = model(x)
    handle.remove()
    vectors = [torch.randn_like(f) for _ in range(3)]
    backward = Backward()
    got = backward.grads(f, [hidden[0], f], vectors)
    want = _one_at_a_time(f, [hidden[0], f], vectors)
    assert backward.batched is (model_cls is mlp)  # the gate's backward cannot be batched
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-15)


def test_unbatchable_backward_still_gives_the_exact_ggn():
    model, data = Gated(), class_data()
    got = estimate_diagonal(model, data, fisher="ggn")
    # the gate is the identity: the GGN is that of the plain MLP (whose jacrev reference runs)
    want = dense_ggn_diagonal(model.net, data)
    assert_close(got, {f"net.{n}": v for n, v in want.items()})


def _sequential(monkeypatch):
    monkeypatch.setattr(Backward, "__init__", lambda self: setattr(self, "batched", False))


CASES = {
    "mlp ggn": (lambda: (mlp(), class_data()), {"fisher": "ggn"}),
    "mlp mc": (lambda: (mlp(), class_data()), {"fisher": "mc", "mc_samples": 4}),
    "sequence ggn": (lambda: (seq_model(tie=True), seq_data()), {"fisher": "ggn"}),
    "cnn ggn": (lambda: (CNN().to(F64), cnn_data()), {"fisher": "ggn"}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["sequential", "small groups"])
def test_diagonal_is_the_same_batched_sequential_and_in_small_groups(case, path, monkeypatch):
    make, kw = CASES[case]
    model, data = make()
    batched = estimate_diagonal(model, data, **kw)
    if path == "sequential":
        _sequential(monkeypatch)
    else:
        monkeypatch.setattr(_batched, "BUDGET_ELEMENTS", 2 * 7 * 40)  # ~2 vectors per group
    assert_close(estimate_diagonal(model, data, **kw), batched.values, rtol=1e-12)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("fisher", ["ggn", "mc"])
@pytest.mark.parametrize("path", ["sequential", "small groups"])
def test_kfac_is_the_same_batched_sequential_and_in_small_groups(approx, fisher, path, monkeypatch):
    torch.manual_seed(0)
    model = _TokenNet().to(F64)
    ids, labels = torch.randint(0, 7, (3, 6)), torch.randint(0, 7, (3, 6))
    attention = torch.ones(3, 6, dtype=torch.long)
    attention[0, 4:] = 0
    labels[0, 4:] = labels[1, 2] = -100  # padding and an ignored target: masks per vector
    data = [{"input_ids": ids, "attention_mask": attention, "labels": labels}]
    kw = {"fisher": fisher, "kfac_approx": approx, "mc_samples": 3 if fisher == "mc" else 1}
    batched = estimate_kfac_factors(model, data, **kw)
    if path == "sequential":
        _sequential(monkeypatch)
    else:
        monkeypatch.setattr(
            _batched, "BUDGET_ELEMENTS", 1000
        )  # 2 vectors (of 414 elements) a group
    other = estimate_kfac_factors(model, data, **kw)
    assert batched.counts == other.counts
    for name, (a, g) in batched.factors.items():
        torch.testing.assert_close(other.factors[name][0], a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(other.factors[name][1], g, rtol=1e-12, atol=1e-14)


class NormMLP(nn.Module):
    """LayerNorm without positions (separable), with affine parameters away from 1 and 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 4)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


@pytest.mark.parametrize("fisher", ["empirical", "ggn"])
def test_separable_layernorm_and_linear_match_the_references(fisher):
    model, data = NormMLP().to(F64), class_data()
    got = estimate_diagonal(model, data, fisher=fisher)
    want = (
        brute_force(model, rows(data)) if fisher == "empirical" else dense_ggn_diagonal(model, data)
    )
    assert_close(got, want)


def test_estimators_do_not_import_transformers_for_plain_models():
    code = (
        "import sys, torch\n"
        "from gradmerge.estimate import estimate_diagonal, estimate_kfac_factors\n"
        "m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
        "d = [(torch.randn(5, 3), torch.randint(0, 2, (5,)))]\n"
        "estimate_diagonal(m, d); estimate_kfac_factors(m, d)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=HANG_S)
