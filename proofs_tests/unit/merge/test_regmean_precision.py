"""RegMean with float32 inputs: solved in float64, judged at the precision the Grams came in.

Reference: Jin et al.'s closed form W* = (Σ_t α_t W_t G_t)(Σ_t α_t G_t)⁻¹ in float64 (numpy).

Error bound used below. The float32 inputs are the exact data rounded: S = Σ α_t G_t and
R = Σ α_t W_t G_t move by δS, δR (measured, and checked to be ≤ ε₃₂ relative). To first order
W = R S⁻¹ moves by ‖δW‖/‖W‖ ≤ κ(S)(‖δS‖/‖S‖ + ‖δR‖/‖R‖) ≤ 2κ(S)ε₃₂ (using ‖R‖ ≤ ‖W‖‖S‖),
and rounding the result to float32 adds ε₃₂/2; so 4κ(S)ε₃₂ bounds it with room for the
second-order terms ((κ δ)² ≤ 0.25 κε₃₂ at κ ≤ 4e6). Against the closed form on the float32
VALUES (cast to float64), a float64 solve is off by the output rounding ε₃₂/2 plus the solves'
own ≈ κ(S)·n·ε₆₄ — far below the ≈ κ(S)ε₃₂ of a float32 solve, which this tells apart.
"""

import numpy as np
import pytest
import torch

import gradmerge as gm

EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)
N_IN, N_OUT = 64, 3  # the former float32 floor, max(n, 10)·ε₃₂ relative, refused κ ≳ 1.3e5
ALPHAS = [0.7, 1.3]


def task_data(kappa: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two tasks' weights and Grams G_t = X_tᵀX_t of seeded inputs X_t whose squared singular
    values are logspaced over [1/κ, 1] (task 2: times factors in [0.5, 2]), in a shared basis:
    κ(Σ α_t G_t) lies within a factor 4 of κ."""
    rng = np.random.default_rng(seed)
    v, _ = np.linalg.qr(rng.standard_normal((N_IN, N_IN)))
    spectrum = np.logspace(0, -np.log10(kappa), N_IN)
    grams, weights = [], []
    for t in range(2):
        u, _ = np.linalg.qr(rng.standard_normal((2 * N_IN, N_IN)))
        s2 = spectrum * (rng.uniform(0.5, 2.0, N_IN) if t else 1.0)
        x = u @ np.diag(np.sqrt(s2)) @ v.T
        grams.append(x.T @ x)
        weights.append(rng.standard_normal((N_OUT, N_IN)))
    return weights, grams


def closed_form(weights, grams):
    s = sum(a * g for a, g in zip(ALPHAS, grams, strict=True))
    r = sum(a * w @ g for a, w, g in zip(ALPHAS, weights, grams, strict=True))
    return np.linalg.solve(s, r.T).T, s, r  # S symmetric: W* = R S⁻¹


def regmean(weights, grams, dtype, gram_dtype=None):
    fts = [{"fc.weight": torch.as_tensor(w).to(dtype)} for w in weights]
    gs = [{"fc": torch.as_tensor(g).to(gram_dtype or dtype)} for g in grams]
    return gm.regmean(fts, gs, alphas=ALPHAS, off_diagonal=1.0)["fc.weight"]  # the closed form


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kappa", [1e2, 1e4, 1e6])
def test_float32_regmean_against_the_float64_closed_form(kappa):
    weights, grams = task_data(kappa, seed=int(np.log10(kappa)))
    exact, s, r = closed_form(weights, grams)
    cond = float(np.linalg.cond(s))
    assert kappa / 4 <= cond <= 4 * kappa

    got = regmean(weights, grams, torch.float32)
    assert got.dtype == torch.float32

    # the data rounded to float32, and the size of that rounding (the premise of the bound)
    w32 = [w.astype(np.float32).astype(np.float64) for w in weights]
    g32 = [g.astype(np.float32).astype(np.float64) for g in grams]
    given, s32, r32 = closed_form(w32, g32)
    assert np.linalg.norm(s32 - s, 2) <= EPS32 * np.linalg.norm(s, 2)
    assert np.linalg.norm(r32 - r, 2) <= EPS32 * np.linalg.norm(r, 2)

    assert rel(got.double().numpy(), exact) <= 4 * cond * EPS32
    # solved in float64: only the output rounding and float64 round-off remain
    assert rel(got.double().numpy(), given) <= EPS32 / 2 + 2 * cond * N_IN * EPS64


def test_grams_singular_at_float32_precision_are_refused_with_the_damping_hint():
    weights, grams = task_data(1e9, seed=9)
    for weight_dtype in (torch.float32, torch.float64):  # judged by the Grams' dtype
        with pytest.raises(gm.NotPositiveDefiniteError, match=r"(?s)'fc'.*float32.*G_t \+ δ·I"):
            regmean(weights, grams, weight_dtype, gram_dtype=torch.float32)

    # the same Grams given in float64 resolve κ = 1e9: accepted, and right to κ·n·ε₆₄
    exact, s, _ = closed_form(weights, grams)
    got = regmean(weights, grams, torch.float64)
    assert rel(got.numpy(), exact) <= 2 * np.linalg.cond(s) * N_IN * EPS64

    # the fix the message names: damping above the float32 uncertainty of the eigenvalues
    delta = 1e-5 * max(np.linalg.norm(g, 2) for g in grams)
    damped = [g + delta * np.eye(N_IN) for g in grams]
    out = regmean(weights, damped, torch.float32)
    assert rel(out.double().numpy(), closed_form(weights, damped)[0]) <= 4 * 1e5 * EPS32


def test_rank_deficient_float32_task_grams_with_round_off_eigenvalues():
    """Per task fewer examples than inputs: each G_t is PSD with zero eigenvalues, which float32
    rounding turns slightly negative; their sum is well-conditioned and must be solved."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((40, N_IN)) for _ in range(2)]
    grams = [x.T @ x for x in xs]
    weights = [rng.standard_normal((N_OUT, N_IN)) for _ in range(2)]
    for g in grams:  # the premise: a round-off eigenvalue float64's tolerance would refuse
        lam = np.linalg.eigvalsh(g.astype(np.float32).astype(np.float64))[0]
        assert -EPS32 * np.linalg.norm(g) < lam < -100 * EPS64 * np.abs(g).max()
    exact, s, _ = closed_form(weights, grams)
    got = regmean(weights, grams, torch.float32)
    assert rel(got.double().numpy(), exact) <= 4 * np.linalg.cond(s) * EPS32


def test_other_parameters_are_averaged_in_their_dtype_and_errors():
    weights, grams = task_data(1e2, seed=0)
    fts = [
        {"fc.weight": torch.as_tensor(w).float(), "ln.weight": torch.full((4,), float(t))}
        for t, w in enumerate(weights)
    ]
    gs = [{"fc": torch.as_tensor(g).float()} for g in grams]
    out = gm.regmean(fts, gs, alphas=ALPHAS)
    assert list(out) == ["fc.weight", "ln.weight"]
    assert out["ln.weight"].dtype == torch.float32
    torch.testing.assert_close(out["ln.weight"], torch.full((4,), 1.3 / 2.0))
    with pytest.raises(gm.StructureError, match="the same modules for every task"):
        gm.regmean(fts, [gs[0], {}], alphas=ALPHAS)
    with pytest.raises(gm.StructureError, match="square Gram matrix"):
        gm.regmean(fts[:1], [{"fc": torch.ones(N_IN, 2)}])
    with pytest.raises(gm.StructureError, match=r"no 'fc\.bias'"):
        gm.regmean(fts[:1], [{"fc": torch.eye(N_IN + 1)}], bias=["fc"])
