"""RegMean's off-diagonal factor r (Jin et al.'s α) and its failure report.

Reference: the closed form W* = (Σ_t α_t W_t G̃_t)(Σ_t α_t G̃_t)⁻¹ with
G̃_t = r·G_t + (1 − r)·diag(G_t), computed with numpy in float64.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.merge.regression import regmean_systems


def _reduced(g: np.ndarray, r: float) -> np.ndarray:
    return r * g + (1 - r) * np.diag(np.diag(g))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.floats(0.0, 1.0), st.booleans())
def test_off_diagonal_equals_the_closed_form(seed, tasks, r, with_bias):
    rng = np.random.default_rng(seed)
    n_in, n_out = 4, 3
    alphas = list(rng.uniform(0.2, 2.0, tasks))
    fts, grams, mats = [], [], []
    for _ in range(tasks):
        w, b = rng.standard_normal((n_out, n_in)), rng.standard_normal(n_out)
        x = rng.standard_normal((int(rng.integers(6, 12)), n_in))
        xa = np.hstack([x, np.ones((len(x), 1))]) if with_bias else x
        ft = {"fc.weight": torch.as_tensor(w)}
        if with_bias:
            ft["fc.bias"] = torch.as_tensor(b)
        fts.append(ft)
        grams.append({"fc": torch.as_tensor(xa.T @ xa)})
        mats.append((np.hstack([w, b[:, None]]) if with_bias else w, _reduced(xa.T @ xa, r)))
    got = gm.regmean(fts, grams, alphas=alphas, bias=["fc"] if with_bias else [], off_diagonal=r)
    num = sum(a * m @ g for a, (m, g) in zip(alphas, mats, strict=True))
    expected = num @ np.linalg.inv(sum(a * g for a, (_, g) in zip(alphas, mats, strict=True)))
    np.testing.assert_allclose(got["fc.weight"].numpy(), expected[:, :n_in], rtol=1e-8, atol=1e-12)
    if with_bias:
        np.testing.assert_allclose(got["fc.bias"].numpy(), expected[:, n_in], rtol=1e-8, atol=1e-12)


def test_off_diagonal_zero_is_the_per_input_weighted_average():
    rng = np.random.default_rng(1)
    w = [rng.standard_normal((2, 3)) for _ in range(2)]
    g = [np.cov(rng.standard_normal((3, 9))) for _ in range(2)]
    got = gm.regmean(
        [{"c.weight": torch.as_tensor(x)} for x in w],
        [{"c": torch.as_tensor(x)} for x in g],
        off_diagonal=0.0,
    )["c.weight"]
    d = [np.diag(x) for x in g]
    np.testing.assert_allclose(got.numpy(), (w[0] * d[0] + w[1] * d[1]) / (d[0] + d[1]), rtol=1e-12)


def _rank_deficient(seed: int, n: int = 6, rank: int = 2, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(rank, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x.T @ x).to(dtype)  # G = XᵀX of fewer examples than inputs: singular


def test_rank_deficient_grams_need_no_damping_with_r_below_one():
    grams = [{"a": _rank_deficient(0)}, {"a": _rank_deficient(1)}]
    fts = [{"a.weight": torch.randn(2, 6)} for _ in range(2)]
    with pytest.raises(gm.NotPositiveDefiniteError):
        gm.regmean(fts, grams, off_diagonal=1.0)  # rank 4 < 6: singular
    out = gm.regmean(fts, grams, off_diagonal=0.9)
    assert torch.isfinite(out["a.weight"]).all()


def test_every_failing_layer_is_named_and_the_suggested_damping_is_above_every_threshold():
    layers = ["l0", "l1", "l2"]
    grams = [{n: _rank_deficient(10 * t + i) for i, n in enumerate(layers)} for t in range(2)]
    grams[0]["l1"] = grams[0]["l1"] + 50 * torch.eye(6)  # this one is fine
    fts = [{f"{n}.weight": torch.randn(2, 6) for n in layers} for _ in range(2)]
    with pytest.raises(gm.NotPositiveDefiniteError) as info:
        gm.regmean(fts, grams, off_diagonal=1.0)  # the plain closed form
    message, delta = str(info.value), info.value.suggested_delta
    assert "2 of 3 layers" in message and "'l0'" in message and "'l2'" in message
    assert "'l1'" not in message
    thresholds = [float(x) for x in __import__("re").findall(r"threshold ([0-9.e+-]+)", message)]
    assert len(thresholds) == 2 and delta is not None and delta > max(thresholds)
    assert f"{delta:.2e}" in message
    # the suggestion works: damp every Gram by it (as YAML `damping:` does) and it solves
    damped = [{n: g + delta * torch.eye(6) for n, g in t.items()} for t in grams]
    assert all(s.ok for s in regmean_systems(damped, [1.0, 1.0], off_diagonal=1.0))
    gm.regmean(fts, damped, off_diagonal=1.0)


@pytest.mark.parametrize("alphas", [[1.0, 1.0], [0.3, 2.0], [1.0, -0.5]])
def test_regmean_systems_verdict_is_the_solve_verdict(alphas):
    """The check the dry run uses and the merge's own decision agree on passing and failing
    layers (one fine, one singular; r = 1, the plain closed form)."""
    grams = [{"ok": _rank_deficient(t, rank=8), "bad": _rank_deficient(5 + t)} for t in range(2)]
    systems = {s.name: s for s in regmean_systems(grams, alphas, off_diagonal=1.0)}
    for name in ("ok", "bad"):
        fts = [{f"{name}.weight": torch.randn(2, 6)} for _ in range(2)]
        sub = [{name: g[name]} for g in grams]
        if systems[name].ok:
            gm.regmean(fts, sub, alphas=alphas, off_diagonal=1.0)
        else:
            with pytest.raises(gm.NotPositiveDefiniteError):
                gm.regmean(fts, sub, alphas=alphas, off_diagonal=1.0)
    assert not systems["bad"].ok
    assert systems["ok"].ok == (sum(alphas) > 0 and min(alphas) > 0)
    if sum(alphas) <= 0:
        assert math.isinf(systems["bad"].damping)


def test_off_diagonal_outside_zero_one_is_refused():
    with pytest.raises(gm.ArgumentError, match=r"\[0, 1\]"):
        gm.regmean([{"a.weight": torch.ones(1, 2)}], [{"a": torch.eye(2)}], off_diagonal=1.5)
