"""The K-FAC operator against dense Kronecker products built independently with torch.kron: 1–4
terms with δ (solve methods and reported residuals), singular factors, Eq. 6, bad factors,
Blocks and lazy sums with K-FAC. The per-structure algebra is in test_conformance.py."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge import params as P
from gradmerge.solvers.kfac_cg import split_identity
from proofs_tests.reference import spd_tensor

DT = torch.float64


def _layers(rng):
    """1–2 layers with random (out, in) and bias flags."""
    layers = {}
    for i in range(int(rng.integers(1, 3))):
        layers[f"l{i}"] = (
            int(rng.integers(1, 4)),
            int(rng.integers(1, 4)),
            bool(rng.integers(0, 2)),
        )
    return layers


def _kron_dense(layers, terms_per_layer):
    """The dense matrix of Σ_k A_k ⊗ G_k in gradmerge's flattening order (weight, then bias)."""
    blocks = []
    for name, (out, n_in, bias) in layers.items():
        cols = n_in + bias
        mat = sum(torch.kron(g, a) for a, g in terms_per_layer[name])  # row-major vec of [V | b]
        # permutation from row-major [V | b] to (V row-major, then b)
        idx = [o * cols + i for o in range(out) for i in range(n_in)]
        idx += [o * cols + n_in for o in range(out)] if bias else []
        blocks.append(mat[idx][:, idx])
    return torch.block_diag(*blocks)


def _kfac(rng, layers, terms, singular=False):
    factors, biases = {}, []
    for name, (out, n_in, bias) in layers.items():
        k = n_in + bias
        factors[name] = [
            (spd_tensor(rng, k, rank=max(1, k - 1) if singular else None), spd_tensor(rng, out))
            for _ in range(terms)
        ]
        if bias:
            biases.append(name)
    return gm.KFAC(factors, bias=biases), factors


@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.floats(0.0, 2.0))
def test_mv_and_solve_match_dense_kronecker(seed, terms, delta):
    rng = np.random.default_rng(seed)
    layers = _layers(rng)
    k, factors = _kfac(rng, layers, terms)
    op = k + delta if delta > 0 else k
    ref = _kron_dense(layers, factors) + delta * torch.eye(P.numel(k._like()), dtype=DT)
    v = {n: torch.as_tensor(rng.standard_normal(s), dtype=DT) for n, s in k.layout}
    flat = P.flatten(v, k.layout)
    np.testing.assert_allclose(P.flatten(op.mv(v), k.layout), ref @ flat, rtol=1e-12, atol=1e-12)
    info = op.solve_info(v)
    expected = torch.linalg.solve(ref, flat)
    assert float(torch.linalg.norm(P.flatten(info.value, k.layout) - expected)) <= 1e-8 * float(
        torch.linalg.norm(expected)
    )
    assert info.success and info.max_residual <= 1e-9
    # each layer's reported residual is its true one (recomputed here from the dense matrix), up
    # to the round-off of two float64 evaluations (~1e-11 here, below the 1e-10 tolerance); the
    # total reported is the largest layer's, which bounds the whole vector's relative residual
    r = ref @ P.flatten(info.value, k.layout) - flat
    true = float(torch.linalg.norm(r)) / float(torch.linalg.norm(flat))
    assert true <= 1e-9 and true <= info.residual + 1e-11 + 1e-3 * true
    if len(info.parts) <= 1:
        assert abs(true - info.residual) <= 1e-11 + 1e-3 * true
    offsets = np.cumsum([0] + [s.numel() for _, s in k.layout])
    for name, part in info.parts.items():
        idx = torch.cat(
            [
                torch.arange(int(offsets[i]), int(offsets[i + 1]))
                for i, (key, _) in enumerate(k.layout)
                if key.rsplit(".", 1)[0] == name
            ]
        )
        layer = float(torch.linalg.norm(r[idx])) / float(torch.linalg.norm(flat[idx]))
        if part.residual == part.residual:  # measured (not a direct solve's nan)
            assert abs(layer - part.residual) <= 1e-11 + 1e-3 * layer
    # one term per added curvature, except that terms with G = c·I merge exactly (out = 1 layers)
    for name, part in info.parts.items():
        assert len(op.terms[name]) <= terms + (delta > 0)
        identity, rest = split_identity(op.terms[name])
        if identity == 0 and len(rest) <= 2:  # exact: eigendecompositions
            assert part.method == f"{len(rest)}-term eigendecomposition"
        if len(rest) <= 1 or (identity == 0 and len(rest) <= 2):  # direct, no CG
            assert part.iterations == 0


def test_singular_factor_with_damping_is_solved_exactly():
    """A rank-deficient A (e.g. fewer examples than inputs) plus δ·I: the two-term path."""
    rng = np.random.default_rng(0)
    layers = {"fc": (3, 4, True)}
    k, factors = _kfac(rng, layers, 1, singular=True)
    with pytest.raises(gm.NotPositiveDefiniteError, match="δ"):
        k.solve({n: torch.ones(s, dtype=DT) for n, s in k.layout})
    op = k + 1e-3
    v = {n: torch.ones(s, dtype=DT) for n, s in k.layout}
    ref = _kron_dense(layers, factors) + 1e-3 * torch.eye(15, dtype=DT)
    got = P.flatten(op.solve(v), k.layout)
    np.testing.assert_allclose(got, torch.linalg.solve(ref, P.flatten(v, k.layout)), rtol=1e-8)


def test_merge_with_kfac_equals_dense_solve_of_eq6():
    """gradient_matching with K-FAC curvatures equals Eq. 6 solved with the dense matrices."""
    rng = np.random.default_rng(2)
    layers = {"fc": (3, 2, True), "out": (2, 3, False)}
    ks, dense = [], []
    for _ in range(3):
        k, f = _kfac(rng, layers, 1)
        ks.append(k)
        dense.append(_kron_dense(layers, f))
    lay = ks[0].layout
    n = sum(s.numel() for _, s in lay)
    base = torch.as_tensor(rng.standard_normal(n), dtype=DT)
    fts = [base + torch.as_tensor(rng.standard_normal(n), dtype=DT) for _ in ks]
    alphas, delta = [0.5, 1.0, 1.5], 0.1
    got = gm.gradient_matching(
        P.unflatten(base, lay), [P.unflatten(f, lay) for f in fts], ks, prior=delta, alphas=alphas
    )
    hbar = delta * torch.eye(n, dtype=DT) + sum(a * h for a, h in zip(alphas, dense, strict=True))
    rhs = sum(
        a * (delta * torch.eye(n, dtype=DT) + h) @ (f - base)
        for a, h, f in zip(alphas, dense, fts, strict=True)
    )
    expected = base + torch.linalg.solve(hbar, rhs)
    assert float(torch.linalg.norm(P.flatten(got, lay) - expected)) <= 1e-8 * float(
        torch.linalg.norm(expected)
    )


def test_bad_factors():
    with pytest.raises(gm.StructureError, match="square"):
        gm.KFAC({"fc": (torch.ones(2, 3), torch.eye(2))})
    with pytest.raises(gm.StructureError, match="bias names modules without factors"):
        gm.KFAC({"fc": (torch.eye(2), torch.eye(2))}, bias=["other"])
    with pytest.raises(gm.NonFiniteError):
        gm.KFAC({"fc": (torch.full((2, 2), float("nan")), torch.eye(2))})
    k = gm.KFAC({"fc": (torch.eye(2), torch.eye(2))})
    with pytest.raises(gm.StructureError):
        k.mv({"fc.weight": torch.ones(3, 2)})


def test_blocks_reject_overlap_and_mismatched_partitions():
    d = gm.Diagonal({"a": torch.ones(2)})
    with pytest.raises(gm.StructureError, match="in blocks 0 and 1"):
        gm.Blocks([d, d])
    with pytest.raises(gm.StructureError, match="covers no particular parameters"):
        gm.Blocks([gm.ScaledIdentity(1.0)])
    b1 = gm.Blocks([gm.Diagonal({"a": torch.ones(2)}), gm.Diagonal({"b": torch.ones(2)})])
    b2 = gm.Blocks([gm.Diagonal({"a": torch.ones(2), "b": torch.ones(2)})])
    with pytest.raises(gm.StructureError, match="different parameter sets"):
        _ = b1 + b2


def test_sum_of_kfac_and_diagonal_is_lazy_and_solved_by_cg():
    """No structure holds K-FAC + diagonal exactly: the sum stays lazy and CG solves it."""
    rng = np.random.default_rng(4)
    layers = {"fc": (3, 2, True)}
    k, f = _kfac(rng, layers, 2)
    d = {n: torch.as_tensor(rng.uniform(0.1, 1.0, s), dtype=DT) for n, s in k.layout}
    s = k + gm.Diagonal(d) + 0.01
    assert isinstance(s, gm.Sum)
    lay = k.layout
    ref = _kron_dense(layers, f) + torch.diag(P.flatten(d, lay)) + 0.01 * torch.eye(9, dtype=DT)
    np.testing.assert_allclose(s.dense(), ref, atol=1e-12)
    v = {n: torch.as_tensor(rng.standard_normal(sh), dtype=DT) for n, sh in lay}
    np.testing.assert_allclose(
        P.flatten(s.solve(v), lay), torch.linalg.solve(ref, P.flatten(v, lay)), rtol=1e-8
    )
    report = s.solve_info(v)
    assert report.success and report.residual <= 1e-10 and report.method == "CG"
    bad = gm.Sum([k, gm.Diagonal({n: -10 * torch.ones(sh, dtype=DT) for n, sh in lay})])
    with pytest.raises(gm.NotPositiveDefiniteError, match="pᵀKp"):
        bad.solve(v)


def test_kfac_min_eigenvalue_is_exact_for_two_terms():
    rng = np.random.default_rng(3)
    k1 = gm.KFAC(
        {"fc": (spd_tensor(rng, 3, dtype=torch.float64), spd_tensor(rng, 2, dtype=torch.float64))}
    )
    k2 = gm.KFAC(
        {"fc": (spd_tensor(rng, 3, dtype=torch.float64), spd_tensor(rng, 2, dtype=torch.float64))}
    )
    for c in (k1, k1 + 0.5, k1 + k2, k1 + k2 + 0.1):
        assert c.min_eigenvalue() == pytest.approx(float(torch.linalg.eigvalsh(c.dense())[0]))
