"""K-FAC's Gram products for wide layers (the blocked upper triangle of ``_gram.add_gram``).

The other K-FAC tests use layers narrower than ``GRAM_BLOCKS_FROM``, whose Gram matrices are one
product; here the sides are wide enough for the blocked path. References: ``rowsᵀ rows`` in
float64, and the factors written out from hooked inputs and autograd output gradients.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from gradmerge.estimate import _gram as K
from gradmerge.estimate.kfac import estimate_kfac_factors

F64 = torch.float64


@pytest.mark.parametrize("n", [5, 511, 512, 784, 1000, 3073])
def test_blocked_upper_gram_then_mirror_is_the_full_gram(n):
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(9, n, generator=g, dtype=F64)
    start = torch.randn(n + 1, n + 1, generator=g, dtype=F64)
    start = start + start.T  # a symmetric running sum, with one extra (bias) column
    acc = start.clone()
    K.add_gram(acc, rows, alpha=0.5)
    want = start.clone()
    want[:n, :n] += 0.5 * rows.T @ rows
    torch.testing.assert_close(K.symmetrize_(acc), want, rtol=1e-13, atol=1e-12)
    blocks = K.gram_blocks(n)
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(hi == lo for (_, hi), (lo, _) in itertools.pairwise(blocks))
    if n < K.GRAM_BLOCKS_FROM:
        assert blocks == ((0, n),)
    else:  # equal 64-aligned widths of 128 or more, at most 8 blocks, the last one ± half a block
        width = blocks[0][1]
        assert width % 64 == 0 and width >= 128 and len(blocks) <= 8
        assert all(hi - lo == width for lo, hi in blocks[:-1])
        assert width / 2 <= blocks[-1][1] - blocks[-1][0] < 1.5 * width


@pytest.mark.parametrize("fisher", ["empirical", "ggn"])
def test_wide_mlp_factors_equal_their_definition(fisher):
    """A = (1/N) Σ_i ã_i ã_iᵀ (ã = [a, 1]) and G = Σ_i Σ_r g_ir g_irᵀ, with sides 600 and 520."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 520), nn.Tanh(), nn.Linear(520, 3)).to(F64)
    data = [(torch.randn(n, 600, dtype=F64), torch.randint(0, 3, (n,))) for n in (6, 4)]
    kf = estimate_kfac_factors(model, data, fisher=fisher)
    a_sum = {name: 0.0 for name in ("0", "2")}
    g_sum = dict(a_sum)
    for x, y in data:
        z0 = model[0](x)
        hidden = torch.tanh(z0)
        z1 = model[2](hidden)
        inputs = {"0": x, "2": hidden}
        for name, a in inputs.items():
            ones = torch.ones(a.shape[0], 1, dtype=F64)
            a = torch.cat([a.detach(), ones], dim=1)
            a_sum[name] = a_sum[name] + a.T @ a
        if fisher == "empirical":
            vectors = [
                torch.autograd.grad(nn.functional.cross_entropy(z1, y, reduction="sum"), z1)[0]
            ]
        else:  # columns of S, S Sᵀ = diag(p) − ppᵀ: √p_c (e_c − p)
            p = torch.softmax(z1.detach(), -1)
            vectors = [
                p[:, c : c + 1].sqrt() * (nn.functional.one_hot(torch.tensor(c), 3) - p)
                for c in range(3)
            ]
        for v in vectors:
            g0, g1 = torch.autograd.grad(z1, [z0, z1], v, retain_graph=True)
            g_sum["0"] = g_sum["0"] + g0.T @ g0
            g_sum["2"] = g_sum["2"] + g1.T @ g1
    for name in ("0", "2"):
        a, g = kf.factors[name]
        torch.testing.assert_close(a, a_sum[name] / 10, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, g_sum[name], rtol=1e-12, atol=1e-14)


def _gram_sum(n: int, budget: int) -> K.GramSum:
    return K.GramSum(torch.zeros(n + 1, n + 1, dtype=F64), K.Budget(budget))


@pytest.mark.parametrize("budget", [0, 10**9])  # no room for a buffer: every call its own product
def test_gathered_rows_give_the_sum_of_the_calls_products(monkeypatch, budget):
    """Calls of 1..11 rows, with a change of alpha and a call above the buffer size in between:
    after ``flush`` the sum is Σ alpha · rowsᵀ rows, however the rows were grouped."""
    monkeypatch.setattr(K, "GRAM_ROWS", 8)
    n, g = 6, torch.Generator().manual_seed(1)
    gram, want = _gram_sum(n, budget), torch.zeros(n + 1, n + 1, dtype=F64)
    products = 0
    real_add_gram = K.add_gram

    def counting(acc, rows, alpha=1.0):
        nonlocal products
        products += 1
        real_add_gram(acc, rows, alpha)

    monkeypatch.setattr(K, "add_gram", counting)
    calls = [(k, 1.0) for k in (3, 2, 5, 1, 11, 4)] + [(k, 0.25) for k in (2, 2, 7)] + [(3, 1.0)]
    for k, alpha in calls:
        rows = torch.randn(k, n, generator=g, dtype=F64)
        want[:n, :n] += alpha * rows.T @ rows
        gram.add(rows, alpha)
        rows.fill_(float("nan"))  # the caller's tensors may change afterwards
    gram.flush()
    gram.flush()  # nothing left: a no-op
    torch.testing.assert_close(K.symmetrize_(gram.acc), want, rtol=1e-13, atol=1e-13)
    if budget:  # products: 3+2 | 5+1 | 11 | 4 | (alpha) 2+2 | 7 | (alpha) 3, at the flush
        assert products == 7 and gram.buffer is not None and gram.buffer.shape == (8, n)
    else:
        assert products == len(calls) and gram.buffer is None


def test_buffers_are_allocated_while_the_budget_allows(monkeypatch):
    monkeypatch.setattr(K, "GRAM_ROWS", 4)
    budget = K.Budget(4 * 5 * 8 + 4 * 3 * 8)  # room for a 5- and a 3-column float64 buffer
    grams = [K.GramSum(torch.zeros(n, n, dtype=F64), budget) for n in (5, 6, 3)]
    for gram in grams:
        gram.add(torch.ones(2, gram.acc.shape[0], dtype=F64))
    assert [gram.buffer is not None for gram in grams] == [True, False, True]
    assert budget.left == 0
    assert grams[1].acc[0, 0] == 2  # no buffer: its product was taken at once


def test_many_small_batches_match_the_definition(monkeypatch):
    """Batches of 3 examples (their rows gathered across batches, buffers filled and flushed
    mid-way and at the end) and one batch larger than the buffer: K-FAC's definition in float64."""
    monkeypatch.setattr(K, "GRAM_ROWS", 16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 4)).to(F64)
    data = [(torch.randn(n, 7, dtype=F64), torch.randint(0, 4, (n,))) for n in [3] * 13 + [20, 3]]
    kf = estimate_kfac_factors(model, data, fisher="empirical")
    x = torch.cat([x for x, _ in data])
    y = torch.cat([y for _, y in data])
    z0 = model[0](x)
    hidden = torch.relu(z0)
    z1 = model[2](hidden)
    g0, g1 = torch.autograd.grad(nn.functional.cross_entropy(z1, y, reduction="sum"), [z0, z1])
    for name, a, g in (("0", x, g0), ("2", hidden.detach(), g1)):
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=F64)], dim=1)
        want_a, want_g = kf.factors[name]
        torch.testing.assert_close(want_a, a.T @ a / x.shape[0], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(want_g, g.T @ g, rtol=1e-12, atol=1e-13)
