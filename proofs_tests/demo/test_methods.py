"""The demo's gradmerge calls against closed forms written with dense matrices."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import jacrev

import gradmerge as gm
from gradmerge.demo import methods
from gradmerge.demo.data import Split, make_splits
from gradmerge.demo.mlp import MLP
from gradmerge.demo.training import fit_map, gradient_fn
from gradmerge.estimate.kfac import estimate_kfac_factors

DELTA = 3.0


@pytest.fixture(scope="module")
def setting():
    """θ_LLM and three fine-tunes of a 64-3-10 MLP, with each task's curvatures and Grams."""
    splits = make_splits(("rotated", "mirrored", "shifted"), n_base=60, n_train=25, n_test=10)
    mlp = MLP(hidden=3)
    theta_llm = fit_map(mlp, [(splits.base.train, 1.0)], init=mlp.init(seed=0), delta=1.0).theta
    fits = [
        fit_map(mlp, [(t.train, 1.0)], init=theta_llm, prior_mean=theta_llm, delta=DELTA).theta
        for t in splits.tasks
    ]
    base, fts = mlp.params(theta_llm), [mlp.params(f) for f in fits]
    curv = {
        s: [methods.estimate(mlp, ft, t.train, s) for ft, t in zip(fts, splits.tasks, strict=True)]
        for s in methods.STRUCTURES
    }
    grams = [methods.gram_matrices(ft, t.train) for ft, t in zip(fts, splits.tasks, strict=True)]
    return splits, mlp, base, fts, curv, grams


def _ggn(mlp: MLP, theta: torch.Tensor, data: Split) -> torch.Tensor:
    """Σ_i J_iᵀ (diag(p_i) − p_i p_iᵀ) J_i by brute force (jacrev)."""
    jac = jacrev(lambda t: mlp.logits(t, data.x))(theta)
    p = torch.softmax(mlp.logits(theta, data.x), dim=1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("icp,icd,idq->pq", jac, lam, jac)


def test_curvatures_are_the_ggn_at_the_finetuned_parameters(setting):
    splits, mlp, _, fts, curv, _ = setting
    for t, task in enumerate(splits.tasks):
        reference = _ggn(mlp, mlp.flat(fts[t]), task.train)
        full = curv["full"][t].dense(mlp.layout)
        torch.testing.assert_close(full, reference, rtol=1e-10, atol=1e-10)
        diag = curv["diag"][t].dense(mlp.layout)
        torch.testing.assert_close(
            diag, torch.diag(torch.diagonal(reference)), rtol=1e-10, atol=1e-10
        )
        assert curv["kfac"][t].meta["structure"] == "kfac"


def test_regmean_grams_are_the_kfac_input_factors_times_n(setting):
    """X̃ᵀX̃ of each layer's inputs = N · A of gradmerge's K-FAC estimator (its A is a mean)."""
    splits, mlp, _, fts, _, grams = setting
    module = mlp.module()
    with torch.no_grad():
        for name, value in module.named_parameters():
            value.copy_(fts[0][name])
    data = splits.tasks[0].train
    factors = estimate_kfac_factors(module, data.batches(7), fisher="empirical")
    for name in ("0", "2"):
        torch.testing.assert_close(
            grams[0][name], len(data) * factors.factors[name][0], rtol=1e-12, atol=1e-10
        )


def test_merges_match_their_closed_forms(setting):
    _, mlp, base, fts, curv, grams = setting
    alphas = [0.2, 0.5, 0.9]
    merged = methods.merge(base, fts, curv, grams, delta=DELTA, alphas=alphas)
    assert list(merged) == list(methods.MERGE_METHODS)
    flat = {k: mlp.flat(v) for k, v in merged.items()}
    b = mlp.flat(base)
    thetas = [mlp.flat(ft) for ft in fts]
    eye = torch.eye(mlp.num_params, dtype=torch.float64)

    ta = b + sum(a * (t - b) for a, t in zip(alphas, thetas, strict=True))
    torch.testing.assert_close(flat["task_arithmetic"], ta, rtol=1e-12, atol=1e-12)
    zero = gm.gradient_matching(base, fts, [0.0] * 3, prior=DELTA, alphas=alphas)
    torch.testing.assert_close(mlp.flat(zero), ta, rtol=1e-12, atol=1e-12)

    for structure in methods.STRUCTURES:  # Eq. 6 with dense matrices
        hs = [c.dense(mlp.layout) for c in curv[structure]]
        precision = DELTA * eye + sum(a * h for a, h in zip(alphas, hs, strict=True))
        rhs = sum(
            a * (DELTA * eye + h) @ (t - b) for a, h, t in zip(alphas, hs, thetas, strict=True)
        )
        expected = b + torch.linalg.solve(precision, rhs)
        torch.testing.assert_close(flat[f"gm_{structure}"], expected, rtol=1e-8, atol=1e-8)

    fishers = [torch.diagonal(c.dense(mlp.layout)) + methods.EPS for c in curv["diag"]]
    numerator = sum(a * f * t for a, f, t in zip(alphas, fishers, thetas, strict=True))
    denominator = sum(a * f for a, f in zip(alphas, fishers, strict=True))
    torch.testing.assert_close(
        flat["fisher_average"], numerator / denominator, rtol=1e-8, atol=1e-10
    )

    for layer in ("0", "2"):  # RegMean: [W | b] = (Σ α V_t G_t)(Σ α G_t)⁻¹
        vs = [torch.cat([ft[f"{layer}.weight"], ft[f"{layer}.bias"][:, None]], 1) for ft in fts]
        gs = [
            g[layer] + methods.EPS * torch.eye(g[layer].shape[0], dtype=torch.float64)
            for g in grams
        ]
        left = sum(a * v @ g for a, v, g in zip(alphas, vs, gs, strict=True))
        right = sum(a * g for a, g in zip(alphas, gs, strict=True))
        expected = torch.linalg.solve(right, left.T).T
        # the ridge εI makes Σ α G_t invertible but ill-conditioned where pixels are always 0:
        # two correct solvers agree to about cond · machine-ε · ‖[W | b]‖
        eig = torch.linalg.eigvalsh(right)
        bound = 10 * float(eig[-1] / eig[0]) * 2.2e-16 * float(left.abs().max() / eig[-1])
        got = merged["regmean"]
        torch.testing.assert_close(got[f"{layer}.weight"], expected[:, :-1], rtol=0, atol=bound)
        torch.testing.assert_close(got[f"{layer}.bias"], expected[:, -1], rtol=0, atol=bound)


def test_removal_matches_closed_forms_and_alpha_zero_is_the_identity(setting):
    splits, mlp, _, fts, _, _ = setting
    everything, refinetuned = fts[0], fts[1]  # any parameters: the rules are algebra
    task = splits.tasks[2].train
    remaining = Split.concat([t.train for t in splits.tasks[:2]])
    h_r = methods.estimate(mlp, refinetuned, task, "full")
    rest = methods.estimate(mlp, everything, remaining, "full")
    g = gradient_fn(mlp, task)(everything)
    out = methods.remove(everything, refinetuned, h_r, rest, g, delta=DELTA)
    eye = torch.eye(mlp.num_params, dtype=torch.float64)
    precision = DELTA * eye + rest.dense(mlp.layout)
    e, r = mlp.flat(everything), mlp.flat(refinetuned)
    eq13 = e - torch.linalg.solve(precision, (DELTA * eye + h_r.dense(mlp.layout)) @ (r - e))
    kl = e + torch.linalg.solve(precision, mlp.flat(g))
    torch.testing.assert_close(mlp.flat(out["eq13"]), eq13, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(mlp.flat(out["koh_liang"]), kl, rtol=1e-9, atol=1e-9)

    same = gm.remove(everything, refinetuned, h_r, remaining=rest + DELTA, prior=DELTA, alpha=0.0)
    none = gm.influence_remove(everything, g, remaining=rest + DELTA, alpha=0.0)
    for params in (same, none):
        torch.testing.assert_close(mlp.flat(params), e, rtol=0, atol=0)


def test_refine_steps_are_gauss_newton_steps_on_the_multitask_objective(setting):
    """θ^{k+1} = θ^k − s·(δI + Σ α G_t(θ^k))⁻¹ R(θ^k), s a power of ½, G_t brute-force GGNs."""
    splits, mlp, base, fts, curv, grams = setting
    alphas = [0.5, 1.0, 0.8]
    start = methods.merge(base, fts, curv, grams, delta=DELTA, alphas=alphas)["gm_full"]
    data = [t.train for t in splits.tasks]
    gradients = [gradient_fn(mlp, d) for d in data]
    iterates = methods.refine(
        mlp, start, base, data, gradients, delta=DELTA, alphas=alphas, steps=2
    )
    assert len(iterates) == 2
    b = mlp.flat(base)
    eye = torch.eye(mlp.num_params, dtype=torch.float64)

    def residual(theta: torch.Tensor) -> torch.Tensor:
        out = DELTA * (theta - b)
        for a, d in zip(alphas, data, strict=True):
            grad = torch.func.grad(lambda t, d=d: mlp.losses(t, d.x, d.y).sum())(theta)
            out = out + a * grad
        return out

    previous = mlp.flat(start)
    for theta in map(mlp.flat, iterates):
        ggn = sum(a * _ggn(mlp, previous, d) for a, d in zip(alphas, data, strict=True))
        newton = -torch.linalg.solve(DELTA * eye + ggn, residual(previous))
        step = theta - previous
        size = 0.5 ** round(-math.log2(float(step @ newton / (newton @ newton))))
        torch.testing.assert_close(step, size * newton, rtol=1e-8, atol=1e-10)
        assert residual(theta).norm() < residual(previous).norm()
        previous = theta
