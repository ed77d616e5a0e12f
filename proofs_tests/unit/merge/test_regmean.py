"""RegMean against Jin et al.'s closed form, computed directly with numpy."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm


@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.booleans())
def test_regmean_equals_the_closed_form(seed, tasks, with_bias):
    rng = np.random.default_rng(seed)
    n_in, n_out = 3, 2
    alphas = list(rng.uniform(0.2, 2.0, tasks))
    fts, grams, mats = [], [], []
    for _ in range(tasks):
        w, b = rng.standard_normal((n_out, n_in)), rng.standard_normal(n_out)
        x = rng.standard_normal((int(rng.integers(4, 10)), n_in))
        xa = np.hstack([x, np.ones((len(x), 1))]) if with_bias else x
        ft = {
            "fc.weight": torch.as_tensor(w),
            "norm.weight": torch.as_tensor(rng.standard_normal(4)),
        }
        if with_bias:
            ft["fc.bias"] = torch.as_tensor(b)
        fts.append(ft)
        grams.append({"fc": torch.as_tensor(xa.T @ xa)})
        mats.append((np.hstack([w, b[:, None]]) if with_bias else w, xa.T @ xa))
    got = gm.regmean(  # r = 1: the plain closed form (the default r is Jin et al.'s 0.1)
        fts, grams, alphas=alphas, bias=["fc"] if with_bias else [], off_diagonal=1.0
    )
    num = sum(a * m @ g for a, (m, g) in zip(alphas, mats, strict=True))
    expected = num @ np.linalg.inv(sum(a * g for a, (_, g) in zip(alphas, mats, strict=True)))
    np.testing.assert_allclose(got["fc.weight"].numpy(), expected[:, :n_in], rtol=1e-9)
    if with_bias:
        np.testing.assert_allclose(got["fc.bias"].numpy(), expected[:, n_in], rtol=1e-9)
    average = sum(a * f["norm.weight"].numpy() for a, f in zip(alphas, fts, strict=True)) / sum(
        alphas
    )
    np.testing.assert_allclose(got["norm.weight"].numpy(), average, rtol=1e-12)


def test_regmean_transposed_weights_and_errors():
    rng = np.random.default_rng(0)
    g = [torch.as_tensor(np.cov(rng.standard_normal((3, 8))) + np.eye(3)) for _ in range(2)]
    w = [torch.as_tensor(rng.standard_normal((2, 3))) for _ in range(2)]
    plain = gm.regmean([{"c.weight": x} for x in w], [{"c": gi} for gi in g])
    conv1d = gm.regmean([{"c.weight": x.T} for x in w], [{"c": gi} for gi in g], transposed=["c"])
    torch.testing.assert_close(conv1d["c.weight"], plain["c.weight"].T)
    with pytest.raises(gm.ArgumentError, match="Gram sets"):
        gm.regmean([{"c.weight": w[0]}], [])
    with pytest.raises(gm.StructureError, match=r"no other\.weight"):
        gm.regmean([{"c.weight": w[0]}], [{"other": g[0]}])
