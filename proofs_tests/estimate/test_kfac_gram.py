"""K-FAC's Gram products for wide layers (the blocked upper triangle of ``_add_gram``).

The other K-FAC tests use layers narrower than ``_GRAM_BLOCKS_FROM``, whose Gram matrices are one
product; here the sides are wide enough for the blocked path. References: ``rowsᵀ rows`` in
float64, and the factors written out from hooked inputs and autograd output gradients.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from gradmerge.estimate import kfac as K
from gradmerge.estimate.kfac import estimate_kfac_factors

F64 = torch.float64


@pytest.mark.parametrize("n", [5, 511, 512, 784, 1000, 3073])
def test_blocked_upper_gram_then_mirror_is_the_full_gram(n):
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(9, n, generator=g, dtype=F64)
    start = torch.randn(n + 1, n + 1, generator=g, dtype=F64)
    start = start + start.T  # a symmetric running sum, with one extra (bias) column
    acc = start.clone()
    K._add_gram(acc, rows, alpha=0.5)
    want = start.clone()
    want[:n, :n] += 0.5 * rows.T @ rows
    torch.testing.assert_close(K._symmetrize_(acc), want, rtol=1e-13, atol=1e-12)
    blocks = K._gram_blocks(n)
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(hi == lo for (_, hi), (lo, _) in itertools.pairwise(blocks))
    if n < K._GRAM_BLOCKS_FROM:
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
