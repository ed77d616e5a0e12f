"""K-FAC systems whose factors are PSD only up to their dtype's round-off (gradmerge/solvers/
kfac_cg.py): a G with an exact null direction (the 1 vector of a layer feeding a LayerNorm),
stored in float32 with that direction's eigenvalue −η, η a few ε·‖G‖, makes the eigenbasis
diagonal δ + Σ_k diag(G̃_k) diag(Ã_k)ᵀ negative once δ is below η·Σ_k‖A_k‖. Such a system is
solved (against the dense solve of the exact, unrounded system), and a genuinely indefinite one
is still refused, the message saying so."""

import pytest
import torch

from gradmerge.errors import NotPositiveDefiniteError
from gradmerge.solvers import kfac_cg

DT = torch.float64
EPS = torch.finfo(torch.float32).eps
N_OUT, N_IN, TERMS = 12, 9, 3


def _system(eta_rel: float, seed: int = 0):
    """float32 terms (A_k, G_k − η_k·11ᵀ/n) whose exact G_k = P M_k P (P = I − 11ᵀ/n) have the
    null vector 1, the exact float64 terms, and the scale Σ‖A_k‖‖G_k‖ (Frobenius)."""
    gen = torch.Generator().manual_seed(seed)
    ones = torch.ones(N_OUT, 1, dtype=DT) / N_OUT**0.5
    proj = torch.eye(N_OUT, dtype=DT) - ones @ ones.T
    stored, exact = [], []
    for _ in range(TERMS):
        xa = torch.randn(N_IN, 3 * N_IN, dtype=DT, generator=gen)
        xg = torch.randn(N_OUT, 3 * N_OUT, dtype=DT, generator=gen)
        a = 1e3 * xa @ xa.T / (3 * N_IN)  # large A: activations of a wide layer
        g = proj @ (xg @ xg.T / (3 * N_OUT)) @ proj
        eta = eta_rel * float(torch.linalg.matrix_norm(g))
        exact.append((a, g))
        stored.append((a.float(), (g - eta * ones @ ones.T).float()))
    scale = sum(
        float(torch.linalg.matrix_norm(a)) * float(torch.linalg.matrix_norm(g)) for a, g in exact
    )
    return stored, exact, scale


def _dense_solve(delta: float, terms, b: torch.Tensor) -> torch.Tensor:
    """(δI + Σ_k G_k ⊗ A_k)⁻¹ vec(B), B row-major (out × in), as (out × in)."""
    k = delta * torch.eye(N_OUT * N_IN, dtype=DT) + sum(torch.kron(g, a) for a, g in terms)
    return torch.linalg.solve(k, b.to(DT).reshape(-1)).reshape(N_OUT, N_IN)


def test_rounded_null_direction_below_delta_is_solved_as_the_exact_system():
    stored, exact, scale = _system(eta_rel=4 * EPS)
    delta = 0.3 * EPS * scale  # above no round-off: the stored diagonal is negative
    # the premise: the stored float32 system has a negative Rayleigh quotient along 1 ⊗ q
    ones = torch.ones(N_OUT, dtype=DT) / N_OUT**0.5
    along = delta + sum(float(ones @ g.to(DT) @ ones) * float(a.to(DT)[0, 0]) for a, g in stored)
    assert along < 0
    b = torch.randn(N_OUT, N_IN, generator=torch.Generator().manual_seed(5))
    s = kfac_cg.solve("layer", delta, stored, b)
    want = _dense_solve(delta, exact, b)
    err = float(torch.linalg.norm(s.x.to(DT) - want) / torch.linalg.norm(want))
    assert err < 1e-4, (err, s.method)
    assert "float64" in s.method


@pytest.mark.parametrize("terms", [1, TERMS])
def test_diagonal_of_psd_rounded_factors_is_at_least_delta(terms):
    stored, _, scale = _system(eta_rel=4 * EPS)
    delta = 0.3 * EPS * scale
    basis = kfac_cg.Basis("layer", delta, stored[:terms], "working")
    assert float(basis.diagonal.min()) >= delta * (1 - 1e-6)


def test_genuinely_indefinite_factor_is_still_refused_and_named():
    stored, _, scale = _system(eta_rel=0.05)  # far beyond round-off: G has λ = −0.05‖G‖
    b = torch.ones(N_OUT, N_IN)
    with pytest.raises(NotPositiveDefiniteError, match="indefinite beyond round-off"):
        kfac_cg.solve("layer", 1e-3 * EPS * scale, stored, b)


def test_semidefinite_threshold_is_relative_to_scale_and_precision():
    big = torch.tensor([-3e-6, 1.0, 1e3])  # −3e-9 of the largest: float32 round-off
    assert float(kfac_cg.semidefinite(big, EPS).min()) == 0.0
    assert float(kfac_cg.semidefinite(big, torch.finfo(DT).eps).min()) < 0  # not in float64
    assert float(kfac_cg.semidefinite(-big, EPS).max()) == 0.0  # NSD likewise
