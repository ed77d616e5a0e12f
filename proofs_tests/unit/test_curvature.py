"""Curvature operators against dense matrices: mv, solve, exact sums across structures, scaling,
dtype/device moves, PSD checks."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge import params as P
from proofs_tests.reference import flat, like_params, random_layout, random_spd


def _operators(seed):
    """A random layout, and one operator of each structure with its dense reference matrix."""
    rng = np.random.default_rng(seed)
    like = random_layout(rng)
    n = P.numel(like)
    m = random_spd(rng, n, condition=float(10 ** rng.uniform(0, 4)))
    d = rng.uniform(0.1, 10.0, n)
    delta = float(rng.uniform(0.1, 3.0))
    ops = {
        "dense": (gm.Dense(torch.as_tensor(m), like), m),
        "diagonal": (gm.Diagonal(like_params(like, d)), np.diag(d)),
        "identity": (gm.ScaledIdentity(delta), delta * np.eye(n)),
    }
    return rng, like, ops


@given(st.integers(0, 2**32 - 1))
def test_mv_and_solve_match_dense(seed):
    rng, like, ops = _operators(seed)
    v = like_params(like, rng.standard_normal(P.numel(like)))
    for op, ref in ops.values():
        np.testing.assert_allclose(flat(op.mv(v)), ref @ flat(v), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            flat(op.solve(v)), np.linalg.solve(ref, flat(v)), rtol=1e-9, atol=1e-12
        )


@given(st.integers(0, 2**32 - 1), st.floats(-3, 3), st.floats(0.1, 3))
def test_sums_and_scaling_are_exact_across_structures(seed, a, b):
    _rng, like, ops = _operators(seed)
    names = list(ops)
    for i in names:
        for j in names:
            (x, rx), (y, ry) = ops[i], ops[j]
            combo = a * x + y * b + 0.5
            ref = a * rx + b * ry + 0.5 * np.eye(rx.shape[0])
            np.testing.assert_allclose(combo.dense(P.layout_of(like)).numpy(), ref, atol=1e-12)
            assert combo.rank == max(x.rank, y.rank)


def test_dense_method_reconstructs_matrix_and_to_converts():
    _, _like, ops = _operators(1)
    dense, ref = ops["dense"]
    np.testing.assert_allclose(dense.dense().numpy(), ref, rtol=0, atol=1e-14)
    for op, _ in ops.values():
        moved = op.to(dtype=torch.float32)
        if op.layout is not None:
            assert moved.dense().dtype == torch.float32


def test_solve_rejects_singular_and_indefinite_systems():
    like = {"w": torch.zeros(2, dtype=torch.float64)}
    singular = gm.Dense(torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64), like)
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"smallest eigenvalue.*δ"):
        singular.solve({"w": torch.ones(2, dtype=torch.float64)})
    diag = gm.Diagonal({"w": torch.tensor([1.0, 0.0], dtype=torch.float64)})
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"1 of 2 entries of 'w' are ≤ 0"):
        diag.solve({"w": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"δ = 0\.0"):
        gm.ScaledIdentity(0.0).solve(like)
    # the fix the message suggests works
    fixed = (diag + 1e-6).solve({"w": torch.ones(2, dtype=torch.float64)})
    np.testing.assert_allclose(flat(fixed), [1 / (1 + 1e-6), 1e6])


def test_check_psd():
    like = {"w": torch.zeros(2, dtype=torch.float64)}
    indefinite = gm.Dense(torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64), like)
    with pytest.raises(
        gm.NotPositiveDefiniteError, match=r"H is not positive semi-definite.*-1\.000e"
    ):
        indefinite.check_psd(name="H")
    gm.Dense(torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64), like).check_psd(name="H")
    with pytest.raises(gm.NotPositiveDefiniteError):
        gm.Diagonal({"w": torch.tensor([1.0, -1.0])}).check_psd(name="F")


def test_dense_constructor_errors():
    like = {"w": torch.zeros(2)}
    with pytest.raises(gm.StructureError, match=r"expected \(2, 2\)"):
        gm.Dense(torch.eye(3), like)
    with pytest.raises(gm.ArgumentError, match="not symmetric"):
        gm.Dense(torch.tensor([[1.0, 0.5], [0.0, 1.0]]), like)
    with pytest.raises(gm.NonFiniteError):
        gm.Dense(torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]), like)


def test_sum_of_mismatched_layouts_is_refused():
    a = gm.Diagonal({"w": torch.ones(2)})
    b = gm.Diagonal({"v": torch.ones(2)})
    with pytest.raises(gm.StructureError, match="different parameters"):
        _ = a + b
    with pytest.raises(gm.DTypeError):
        _ = a + gm.Diagonal({"w": torch.ones(2, dtype=torch.float64)})


def test_operator_rejects_vector_of_wrong_structure():
    d = gm.Diagonal({"w": torch.ones(2)})
    with pytest.raises(gm.StructureError, match="shape"):
        d.mv({"w": torch.ones(3)})
    with pytest.raises(gm.DTypeError):
        d.mv({"w": torch.ones(2, dtype=torch.float64)})
