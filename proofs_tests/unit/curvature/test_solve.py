"""Conjugate gradients over parameter dicts against numpy's dense solve."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge import params as P
from gradmerge.solvers.cg import conjugate_gradient
from proofs_tests.reference import like_params, random_layout, random_spd


@given(st.integers(0, 2**31 - 1), st.floats(0, 4), st.booleans())
def test_cg_matches_dense_solve(seed, log_cond, precondition):
    rng = np.random.default_rng(seed)
    like = random_layout(rng)
    n = P.numel(like)
    m = random_spd(rng, n, 10**log_cond)
    op = gm.Dense(torch.as_tensor(m), like)
    b = like_params(like, rng.standard_normal(n))
    diag = gm.Diagonal(like_params(like, np.diag(m).copy()))
    result = conjugate_gradient(op.mv, b, precondition=diag.solve if precondition else None)
    assert result.success and result.residual <= 1e-10
    expected = np.linalg.solve(m, P.flatten(b).numpy())
    np.testing.assert_allclose(P.flatten(result.value).numpy(), expected, rtol=1e-6, atol=1e-9)


def test_cg_reports_non_convergence_and_negative_curvature():
    like = {"w": torch.zeros(50, dtype=torch.float64)}
    m = np.diag(np.logspace(0, 8, 50))
    op = gm.Dense(torch.as_tensor(m), like)
    b = {"w": torch.ones(50, dtype=torch.float64)}
    result = conjugate_gradient(op.mv, b, maxiter=3)
    assert not result.success and result.iterations == 3 and result.residual > 1e-10
    neg = gm.Dense(torch.as_tensor(-np.eye(50)), like)
    with pytest.raises(gm.NotPositiveDefiniteError, match="pᵀKp"):
        conjugate_gradient(neg.mv, b)
    zero = conjugate_gradient(op.mv, {"w": torch.zeros(50, dtype=torch.float64)})
    assert zero.success and zero.iterations == 0


def test_non_convergence_is_its_own_error():
    like = {"w": torch.zeros(60, dtype=torch.float64)}
    ill = gm.Dense(torch.diag(torch.logspace(0, 12, 60, dtype=torch.float64)), like)
    s = gm.Sum([ill, gm.Diagonal({"w": torch.full((60,), 1e-12, dtype=torch.float64)})])
    with pytest.raises(gm.NotConvergedError, match="after 5 iterations"):
        s.solve_info({"w": torch.ones(60, dtype=torch.float64)}, gm.CG(maxiter=5))


def test_a_sum_takes_its_solver_at_the_call():
    """``Sum(maxiter=...)`` (an operator default of 0.1.0) is refused naming ``gm.CG`` at the
    call; a ``KroneckerCG`` runs a sum's CG with its tol and maxiter (the YAML ``solver:``
    block reaches sums so); anything but a solver object is an ArgumentError."""
    like = {"w": torch.zeros(3, dtype=torch.float64)}
    terms = [
        gm.Dense(torch.eye(3, dtype=torch.float64), like),
        gm.Diagonal({"w": torch.ones(3, dtype=torch.float64)}),
    ]
    with pytest.raises(gm.RemovedArgumentError, match=r"solve_info\(v, gm\.CG\(maxiter=5\)\)"):
        gm.Sum(terms, maxiter=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rtol'"):
        gm.Sum(terms, rtol=1e-3)
    s, v = gm.Sum(terms), {"w": torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64)}
    got = s.solve_info(v, gm.KroneckerCG(tol=1e-12, maxiter=3))
    assert got.result is gm.Result.successful and got.method == "CG"
    torch.testing.assert_close(got.value["w"], v["w"] / 2)
    with pytest.raises(gm.ArgumentError, match="a Sum takes a solver object"):
        s.solve_info(v, 5)  # type: ignore[arg-type]
