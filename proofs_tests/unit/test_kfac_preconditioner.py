"""Multi-term K-FAC solves (δ·I + several Kronecker terms): answers against dense solves, the
preconditioner's spectral bounds (gradmerge/curvature/kfac.py, _preconditioner_terms) checked with
dense eigenvalues, and CG iteration counts against the bounds that theory gives."""

import math

import numpy as np
import pytest
import torch

import gradmerge as gm
from gradmerge import params as P
from gradmerge.curvature.kfac import _preconditioner, _preconditioner_terms

DT = torch.float64


def _decaying_spd(gen, n, orders=6.0, basis=None):
    """SPD with eigenvalues 10^(−orders·t), t ∈ [0, 1]: the decaying spectra of K-FAC factors."""
    q = (
        basis
        if basis is not None
        else torch.linalg.qr(torch.randn(n, n, dtype=DT, generator=gen))[0]
    )
    lam = 10.0 ** (-orders * torch.linspace(0, 1, n, dtype=DT))
    return (q * lam) @ q.T


def _rotate(gen, n, angle):
    s = torch.randn(n, n, dtype=DT, generator=gen)
    return torch.linalg.matrix_exp(angle * (s - s.T) / math.sqrt(2 * n))


def _dense(terms, bias_cols, n_out, n_in):
    """The dense Σ_k A_k ⊗ G_k in gradmerge's flattening (weight row-major, then the bias)."""
    cols = n_in + bias_cols
    mat = sum(torch.kron(g, a) for a, g in terms)
    idx = [o * cols + i for o in range(n_out) for i in range(n_in)]
    idx += [o * cols + n_in for o in range(n_out)] if bias_cols else []
    return mat[idx][:, idx]


@pytest.mark.parametrize("tasks", [2, 3, 4])
@pytest.mark.parametrize("transposed", [False, True])
def test_delta_plus_tasks_matches_dense_solve(tasks, transposed):
    """δ·I + 2, 3 or 4 task terms (3–5 Kronecker terms), with a bias column, as Linear weights
    (out, in) and as GPT-2 Conv1D weights (in, out): the solve equals the dense solve."""
    gen = torch.Generator().manual_seed(10 * tasks + transposed)
    n_out, n_in = 5, 4
    terms = [(_decaying_spd(gen, n_in + 1), _decaying_spd(gen, n_out)) for _ in range(tasks)]
    k = gm.KFAC({"m": terms}, bias=["m"], transposed=["m"] if transposed else [])
    delta = 1e-4
    op = k + delta
    assert len(op.terms["m"]) == tasks + 1
    dense = _dense(terms, 1, n_out, n_in) + delta * torch.eye(n_out * (n_in + 1), dtype=DT)
    v = {n: torch.randn(s, dtype=DT, generator=gen) for n, s in k.layout}
    x, info = op.solve_info(v)
    expected = torch.linalg.solve(dense, _flat_linear(v, transposed))
    got = _flat_linear(x, transposed)
    # forward error ≤ κ · residual: κ(dense) ≤ (1 + δ)/δ here, residual ≤ 1e-10 (CG's tolerance)
    kappa = float(torch.linalg.cond(dense))
    assert float(torch.linalg.norm(got - expected)) <= 2 * kappa * 1e-10 * float(
        torch.linalg.norm(expected)
    )
    assert info.method["m"] == f"{tasks + 1}-term preconditioned CG"
    assert info.residual["m"] <= 1e-10


def _flat_linear(v, transposed):
    w = v["m.weight"].T if transposed else v["m.weight"]
    return torch.cat([w.reshape(-1), v["m.bias"]])


def test_tasks_sharing_input_statistics_make_the_preconditioner_exact():
    """A_k = c_k A (the same layer inputs, up to scale): Ā ⊗ Ḡ = Σ_k A_k ⊗ G_k exactly, so P = K
    and CG stops at its start P⁻¹b: 0 iterations in exact arithmetic; the residual of that start is
    ~κ(K)·ε ≈ 1e-13 here, below the tolerance. Same with the G side shared."""
    gen = torch.Generator().manual_seed(1)
    a, g = _decaying_spd(gen, 16), _decaying_spd(gen, 24)
    for shared_a in (True, False):
        if shared_a:
            terms = [(c * a, _decaying_spd(gen, 24)) for c in (1.0, 3.0, 0.5)]
        else:
            terms = [(_decaying_spd(gen, 16), c * g) for c in (1.0, 3.0, 0.5)]
        op = gm.KFAC({"m": terms}) + 1e-3
        _, info = op.solve_info({"m.weight": torch.randn(24, 16, dtype=DT, generator=gen)})
        assert info.iterations["m"] == 0 and info.residual["m"] <= 1e-10
        (_, _), (pa, pg) = _preconditioner_terms(op.terms["m"])
        s = sum(torch.kron(t_a, t_g) for t_a, t_g in terms)
        torch.testing.assert_close(torch.kron(pa, pg), s, rtol=1e-12, atol=1e-14)


def _spectral_setup(seed, tasks, angle, delta):
    gen = torch.Generator().manual_seed(seed)
    n_a, n_g = 6, 7
    qa = torch.linalg.qr(torch.randn(n_a, n_a, dtype=DT, generator=gen))[0]
    qg = torch.linalg.qr(torch.randn(n_g, n_g, dtype=DT, generator=gen))[0]
    terms = [
        (
            _decaying_spd(gen, n_a, basis=_rotate(gen, n_a, angle) @ qa),
            (k + 1) * _decaying_spd(gen, n_g, basis=_rotate(gen, n_g, angle) @ qg),
        )
        for k in range(tasks)
    ]
    op = gm.KFAC({"m": terms}) + delta
    eye = torch.eye(n_a * n_g, dtype=DT)
    s = sum(torch.kron(g, a) for a, g in terms)
    k_mat = s + delta * eye
    (a0, g0), (pa, pg) = _preconditioner_terms(op.terms["m"])
    p_mat = torch.kron(g0, a0) + torch.kron(pg, pa)
    return op, k_mat, p_mat, s, tasks, (a0, g0)


@pytest.mark.parametrize("tasks,angle", [(2, 0.2), (2, 3.0), (3, 0.5), (4, 3.0)])
def test_preconditioned_spectrum_lies_in_the_proven_interval(tasks, angle):
    """λ(P⁻¹K) ∈ [1/(1 + ρ), m] with ρ = λ_max(K^{-1/2} C K^{-1/2}), C = Ā ⊗ Ḡ − S/m ⪰ 0."""
    _, k_mat, p_mat, s, m, (a0, g0) = _spectral_setup(tasks + int(10 * angle), tasks, angle, 1e-4)
    # the δ·I term is the anchor
    assert torch.equal(a0, torch.eye(6, dtype=DT)) and torch.equal(
        g0, 1e-4 * torch.eye(7, dtype=DT)
    )
    c = (p_mat - 1e-4 * torch.eye(len(k_mat), dtype=DT)) - s / m
    assert float(torch.linalg.eigvalsh(c)[0]) >= -1e-12 * float(torch.linalg.matrix_norm(c, 2))
    lk, vk = torch.linalg.eigh(k_mat)
    k_isqrt = (vk / lk.sqrt()) @ vk.T
    rho = float(torch.linalg.eigvalsh(k_isqrt @ c @ k_isqrt)[-1])
    lam = torch.linalg.eigvals(torch.linalg.solve(p_mat, k_mat)).real
    assert float(lam.min()) >= (1 - 1e-9) / (1 + rho)
    assert float(lam.max()) <= m * (1 + 1e-9)


def _dense_m_inverse(terms):
    """M⁻¹ = Σ_j P_j⁻¹ of gradmerge's preconditioner, as a dense matrix (applied to a basis)."""
    parts = _preconditioner("m", terms)
    n_g, n_a = terms[0][1].shape[0], terms[0][0].shape[0]
    cols = []
    for e in torch.eye(n_g * n_a, dtype=DT):
        x = e.reshape(n_g, n_a)
        y = sum(
            tg @ qg @ ((qg.T @ tg.T @ x @ ta @ qa) / d) @ qa.T @ ta.T
            for qa, qg, d, (ta, tg) in parts
        )
        cols.append(y.reshape(-1))
    return torch.stack(cols, dim=1), len(parts)


def _r_max(terms, delta):
    """max over the task terms and eigenvalues (a, g) of (a + πs)(g + s/π)/(ag + s²), s² = δ/2."""
    s, out = math.sqrt(delta / 2), 0.0
    for a, g in terms:
        pi = math.sqrt((float(a.trace()) / a.shape[0]) / (float(g.trace()) / g.shape[0]))
        ea, eg = torch.linalg.eigvalsh(a), torch.linalg.eigvalsh(g)
        r = torch.outer(ea + pi * s, eg + s / pi) / (torch.outer(ea, eg) + s * s)
        out = max(out, float(r.max()))
    return out


@pytest.mark.parametrize("angle", [0.2, 3.0])
def test_two_task_preconditioner_spectrum_and_cg_iterations_within_the_pcg_bound(angle):
    """δ·I + two tasks with spectra decaying over 6 orders, eigenbases related (rotated by 0.2)
    or unrelated (3.0). M⁻¹ = P_a⁻¹ + P_π⁻¹ (two parts) and λ(M⁻¹K) ∈ [1/(1+ρ) + 1/r_max, 3].

    PCG from x₀ = M⁻¹b: ‖e_k‖_K ≤ 2 q^k ‖e₀‖_K, q = (√κ − 1)/(√κ + 1), κ ≤ 3/(1/(1+ρ) + 1/r_max);
    with ‖r_k‖ ≤ √λ_max(K) ‖e_k‖_K and ‖e₀‖_K ≤ ‖b‖ (λ_min(K)^{-1/2} + λ_max(K)^{1/2} ‖M⁻¹‖),
    the relative residual reaches tol after at most ⌈ln(2c/tol) / ln(1/q)⌉ iterations, c the
    product of those constants. (Exact arithmetic; the bound is loose enough to absorb rounding.)"""
    delta = 1e-3
    op, k_mat, p_mat, s, m, _ = _spectral_setup(7, 2, angle, delta)
    c = (p_mat - delta * torch.eye(len(k_mat), dtype=DT)) - s / m
    lk, vk = torch.linalg.eigh(k_mat)
    k_isqrt = (vk / lk.sqrt()) @ vk.T
    rho = float(torch.linalg.eigvalsh(k_isqrt @ c @ k_isqrt)[-1])
    tasks = [t for t in op.terms["m"] if not torch.equal(t[0], torch.eye(6, dtype=DT))]
    r_max = _r_max(tasks, delta)
    m_inv, parts = _dense_m_inverse(op.terms["m"])
    assert parts == 2
    lam = torch.linalg.eigvals(m_inv @ k_mat).real
    assert float(lam.min()) >= (1 - 1e-9) * (1 / (1 + rho) + 1 / r_max)
    assert float(lam.max()) <= (m + 1) * (1 + 1e-9)
    kappa = (m + 1) / (1 / (1 + rho) + 1 / r_max)
    q = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
    m_norm = float(torch.linalg.matrix_norm(m_inv, 2))
    const = math.sqrt(lk[-1]) * (1 / math.sqrt(lk[0]) + math.sqrt(lk[-1]) * m_norm)
    tol = 1e-10
    bound = math.ceil(math.log(2 * const / tol) / math.log(1 / q))
    gen = torch.Generator().manual_seed(3)
    _, info = op.solve_info({"m.weight": torch.randn(7, 6, dtype=DT, generator=gen)})
    assert info.residual["m"] <= tol
    assert info.iterations["m"] <= bound, (info.iterations["m"], bound, kappa)


def test_no_positive_definite_anchor_falls_back_and_stays_exact():
    """Three rank-one-A terms and no damping: no term is PD (no two-term factorisation), yet the
    sum is; the preconditioner falls back to one Kronecker term and CG still solves exactly."""
    gen = torch.Generator().manual_seed(4)
    vecs = torch.linalg.qr(torch.randn(3, 3, dtype=DT, generator=gen))[0]
    terms = [
        (torch.outer(vecs[:, i], vecs[:, i]), _decaying_spd(gen, 4, orders=1)) for i in range(3)
    ]
    k = gm.KFAC({"m": terms})
    v = {"m.weight": torch.randn(4, 3, dtype=DT, generator=gen)}
    x, info = k.solve_info(v)
    dense = _dense(terms, 0, 4, 3)
    expected = torch.linalg.solve(dense, v["m.weight"].reshape(-1))
    np.testing.assert_allclose(P.flatten(x, k.layout), expected, rtol=1e-8, atol=1e-10)
    assert info.residual["m"] <= 1e-10
