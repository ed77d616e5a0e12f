"""Matrix-free Hessian/GGN products against the dense matrices of the same model and data."""

import pytest
import torch

import gradmerge as gm
from gradmerge import params as P
from gradmerge.estimate.dense import estimate_dense

DT = torch.float64


def _model_and_data(seed=0, seq=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)
    ).double()
    if seq:
        X = torch.randn(2, 5, 3, dtype=DT)
        y = torch.randint(0, 3, (2, 5))
        y[1, 3:] = -100
    else:
        X, y = torch.randn(7, 3, dtype=DT), torch.randint(0, 3, (7,))
    return model, [(X[:1], y[:1]), (X[1:], y[1:])]


@pytest.mark.parametrize("kind", ["ggn", "hessian"])
@pytest.mark.parametrize("seq", [False, True])
def test_mv_equals_dense_matrix(kind, seq):
    model, data = _model_and_data(seq=seq)
    op = gm.MatrixFree(model, data, kind=kind)
    dense = estimate_dense(model, data, fisher=kind)
    torch.testing.assert_close(op.dense(), dense.matrix)
    torch.testing.assert_close((2.0 * op).dense(), 2.0 * dense.matrix)


def test_damped_solve_and_merge_equal_dense():
    model, data = _model_and_data(1)
    op = gm.MatrixFree(model, data, kind="ggn")
    solver = gm.CG(tol=1e-12, maxiter=2000)  # to the calls that solve, not onto the operator
    dense = estimate_dense(model, data, fisher="ggn")
    lay = dense.layout
    torch.manual_seed(2)
    v = {k: torch.randn(s, dtype=DT) for k, s in lay}
    got = (op + 0.1).solve_info(v, solver).value
    expected = (dense + 0.1).solve(v)
    torch.testing.assert_close(P.flatten(got), P.flatten(expected), rtol=1e-8, atol=1e-10)
    base = {k: p.detach() for k, p in model.named_parameters()}
    fts = [{k: b + 0.1 * torch.randn_like(b) for k, b in base.items()} for _ in range(2)]
    merged_free = gm.gradient_matching(base, fts, [op, op], prior=0.1, solver=solver)
    merged_dense = gm.gradient_matching(base, fts, [dense, dense], prior=0.1)
    torch.testing.assert_close(
        P.flatten(merged_free), P.flatten(merged_dense), rtol=1e-7, atol=1e-9
    )


def test_solver_settings_go_to_the_call_not_the_operator():
    """``MatrixFree(tol=, maxiter=)`` (gradmerge 0.1.0) is refused naming ``gm.CG`` at the
    call; ``solve_info(v, gm.CG(maxiter=1))`` obeys its budget (NotConvergedError where the
    default converges) and a K-FAC-only solver runs as the CG it is (tol, maxiter)."""
    model, data = _model_and_data(1)
    with pytest.raises(gm.RemovedArgumentError, match=r"solve_info\(v, gm\.CG\(tol=1e-12\)\)"):
        gm.MatrixFree(model, data, kind="ggn", tol=1e-12)
    op = gm.MatrixFree(model, data, kind="ggn") + 0.1
    v = {k: torch.ones_like(p) for k, p in model.named_parameters()}
    with pytest.raises(gm.NotConvergedError, match="after 1 iterations"):
        op.solve_info(v, gm.CG(tol=1e-12, maxiter=1))
    loose, kron = op.solve_info(v, gm.CG(tol=1e-3)), op.solve_info(v, gm.KroneckerCG(tol=1e-3))
    assert loose.result is kron.result is gm.Result.successful and loose.residual <= 1e-3
    assert kron.iterations == loose.iterations and kron.residual == loose.residual


def test_indefinite_hessian_is_reported():
    model, data = _model_and_data(3)
    eig = torch.linalg.eigvalsh(estimate_dense(model, data, fisher="hessian").matrix)
    assert float(eig[0]) < 0  # this random model's Hessian is indefinite
    op = gm.MatrixFree(model, data, kind="hessian")
    lay = op.layout
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"not positive definite|residual"):
        op.solve({k: torch.ones(s, dtype=DT) for k, s in lay})


def test_bad_arguments():
    model, data = _model_and_data()
    with pytest.raises(gm.ArgumentError, match="kind must be"):
        gm.MatrixFree(model, data, kind="fisher")
    with pytest.raises(gm.ArgumentError, match="data is empty"):
        gm.MatrixFree(model, [])
    with pytest.raises(gm.StructureError):
        gm.MatrixFree(model, data).mv({"0.weight": torch.ones(4, 3, dtype=DT)})


def test_ggn_products_match_hand_written_jacobians():
    """An independent reference: Σ_i J_iᵀ Λ_i J_i v from a hand-written tanh MLP of flat θ."""
    from proofs_tests.estimate.test_dense import _mlp_fn

    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)
    ).double()
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    X, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 3, (5,))
    sizes = ((3, 4), (4, 3))
    ggn = torch.zeros(len(theta), len(theta), dtype=DT)
    for i in range(5):
        jac = torch.autograd.functional.jacobian(lambda th, i=i: _mlp_fn(th, X[i], sizes), theta)
        p = torch.softmax(_mlp_fn(theta, X[i], sizes), dim=-1)
        ggn += jac.T @ (torch.diag(p) - torch.outer(p, p)) @ jac
    op = gm.MatrixFree(model, [(X, y)], kind="ggn")
    v = torch.randn(len(theta), dtype=DT)
    got = P.flatten(op.mv(P.unflatten(v, op.layout)), op.layout)
    torch.testing.assert_close(got, ggn @ v)
