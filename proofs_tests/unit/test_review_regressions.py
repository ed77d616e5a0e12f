"""Regression tests: float32 iterative solves, adding zero, key order of dense sums, exact K-FAC
eigenvalues, saving tensors that share memory, one-shot data for diagonal estimates."""

import numpy as np
import pytest
import torch

import gradmerge as gm
from gradmerge import params as P
from proofs_tests.reference import random_spd


def _spd(rng, n, dtype):
    return torch.as_tensor(random_spd(rng, n, 10.0), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_three_term_kfac_and_lazy_sums_solve_in_float32_and_float64(dtype):
    rng = np.random.default_rng(0)
    ks = [
        gm.KFAC({"fc": (_spd(rng, 4, dtype), _spd(rng, 3, dtype))}, bias=["fc"]) for _ in range(2)
    ]
    op = ks[0] + ks[1] + 0.1  # three Kronecker terms per layer: preconditioned CG
    diag = gm.Diagonal({k: torch.rand(s, dtype=dtype) + 0.1 for k, s in op.layout})
    v = {k: torch.ones(s, dtype=dtype) for k, s in op.layout}
    tol = {torch.float32: 1e-4, torch.float64: 1e-9}[dtype]
    for c in (op, op + diag):
        x = c.solve(v)
        dense = c.dense().double()
        expected = torch.linalg.solve(dense, P.flatten(v).double())
        err = torch.linalg.norm(P.flatten(x).double() - expected) / torch.linalg.norm(expected)
        assert float(err) <= tol


def test_non_convergence_is_its_own_error():
    like = {"w": torch.zeros(60, dtype=torch.float64)}
    ill = gm.Dense(torch.diag(torch.logspace(0, 12, 60, dtype=torch.float64)), like)
    s = gm.Sum([ill, gm.Diagonal({"w": torch.full((60,), 1e-12, dtype=torch.float64)})], maxiter=5)
    with pytest.raises(gm.NotConvergedError, match="after 5 iterations"):
        s.solve({"w": torch.ones(60, dtype=torch.float64)})


def test_adding_zero_adds_no_term():
    rng = np.random.default_rng(1)
    k = gm.KFAC({"fc": (_spd(rng, 3, torch.float64), _spd(rng, 2, torch.float64))})
    assert (k + 0.0) is k and (0.0 + k) is k and sum([k, k]).terms["fc"].__len__() == 2
    merged = gm.fisher_average(
        [{"fc.weight": torch.ones(2, 3, dtype=torch.float64)}] * 2, [k, 2.0 * k]
    )  # exact two-term solve, no zero prior term
    torch.testing.assert_close(merged["fc.weight"], torch.ones(2, 3, dtype=torch.float64))


def test_dense_sum_respects_key_order():
    rng = np.random.default_rng(2)
    m = torch.as_tensor(random_spd(rng, 3, 10.0))
    a = gm.Dense(m, {"x": torch.zeros(1), "y": torch.zeros(2)})
    perm = [1, 2, 0]  # the same operator with "y" first
    b = gm.Dense(m[perm][:, perm], {"y": torch.zeros(2), "x": torch.zeros(1)})
    torch.testing.assert_close((a + b).dense(), 2 * a.dense())


def test_kfac_min_eigenvalue_is_exact_for_two_terms():
    rng = np.random.default_rng(3)
    k1 = gm.KFAC({"fc": (_spd(rng, 3, torch.float64), _spd(rng, 2, torch.float64))})
    k2 = gm.KFAC({"fc": (_spd(rng, 3, torch.float64), _spd(rng, 2, torch.float64))})
    for c in (k1, k1 + 0.5, k1 + k2, k1 + k2 + 0.1):
        assert c.min_eigenvalue() == pytest.approx(float(torch.linalg.eigvalsh(c.dense())[0]))


def test_saving_curvatures_that_share_tensors(tmp_path):
    rng = np.random.default_rng(4)
    k = gm.KFAC({"fc": (_spd(rng, 3, torch.float64), _spd(rng, 2, torch.float64))})
    for c in (k + k, k + 0.5 * k):
        back = gm.load_curvature(c.save(tmp_path / "c.safetensors"))
        torch.testing.assert_close(back.dense(), c.dense(), rtol=0, atol=0)


def test_diag_estimate_accepts_a_one_shot_iterator():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    c = gm.estimate_curvature(model, iter(batches))
    assert c.meta["num_examples"] == "12"
    ref = gm.estimate_curvature(model, batches)
    for key in ref.values:
        torch.testing.assert_close(c.values[key], ref.values[key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kfac_cg_preconditioner_accepts_ill_conditioned_but_positive_definite_systems(dtype):
    """Two Kronecker terms with a singular G each, damped by 1e-2 (three terms: CG): positive
    definite (smallest eigenvalue 1e-2) with condition ~1e4. The CG preconditioner must not refuse
    it as singular; the answer matches a dense solve to the accuracy the conditioning allows."""
    a = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=dtype))
    g = 9.5 * torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=dtype)
    h = gm.KFAC({"fc": [(a, g), (a, g)]}, bias=["fc"]) + 1e-2
    b = {"fc.weight": torch.ones(2, 2, dtype=dtype), "fc.bias": torch.ones(2, dtype=dtype)}
    info = h.solve_info(b)
    x = info.value
    assert info.parts["fc"].method.startswith("eigenbasis-preconditioned CG")

    def flat(p):
        return torch.cat([p["fc.weight"], p["fc.bias"][:, None]], 1).flatten().double()

    ref = torch.linalg.solve(h.dense().double(), flat(b))
    cond = 4e4  # λ_max/λ_min of the system, bounding the relative error of any solve
    tol = cond * torch.finfo(dtype).eps * 10
    torch.testing.assert_close(flat(x), ref, rtol=tol, atol=0)


def test_finite_check_fast_path_still_names_nan_and_inf_and_accepts_overflowing_sums():
    big = torch.full((4,), torch.finfo(torch.float16).max, dtype=torch.float16)  # sum overflows
    gm.params.check_params({"w": big}, name="x")  # finite values: accepted
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(gm.NonFiniteError, match=r"x\['w'\] holds 1 NaN/Inf"):
            gm.params.check_params({"w": torch.tensor([1.0, bad, 2.0])}, name="x")
