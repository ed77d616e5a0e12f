"""K-FAC solves of δ·I + several Kronecker terms (gradmerge/solvers/kfac_cg.py) against dense
solves: answers, the reported (certified) residual against one recomputed from the dense matrix,
exactness when the tasks share eigenvectors, and the float64 fallback of float32 solves that the
working precision cannot resolve."""

import numpy as np
import pytest
import torch

import gradmerge as gm
from gradmerge import params as P
from gradmerge.solvers import kfac_cg
from proofs_tests.reference import spd_tensor

DT = torch.float64


def _decaying_spd(gen, n, orders=6.0, basis=None, dtype=DT):
    """SPD with eigenvalues 10^(−orders·t), t ∈ [0, 1]: the decaying spectra of K-FAC factors."""
    q = (
        basis
        if basis is not None
        else torch.linalg.qr(torch.randn(n, n, dtype=DT, generator=gen))[0]
    )
    lam = 10.0 ** (-orders * torch.linspace(0, 1, n, dtype=DT))
    return ((q * lam) @ q.T).to(dtype)


def _dense(terms, bias_cols, n_out, n_in, delta=0.0):
    """δI + Σ_k A_k ⊗ G_k in gradmerge's flattening (weight row-major, then the bias)."""
    cols = n_in + bias_cols
    mat = sum(torch.kron(g.to(DT), a.to(DT)) for a, g in terms)
    idx = [o * cols + i for o in range(n_out) for i in range(n_in)]
    idx += [o * cols + n_in for o in range(n_out)] if bias_cols else []
    return mat[idx][:, idx] + delta * torch.eye(len(idx), dtype=DT)


def _flat(p, transposed=False):
    w = p["m.weight"].T if transposed else p["m.weight"]
    return torch.cat([w.reshape(-1), p["m.bias"]]).to(DT)


CASES = [  # (tasks, transposed, dtype, δ relative to the largest term)
    (1, False, torch.float64, 1e-4),
    (2, False, torch.float64, 1e-4),
    (3, True, torch.float64, 1e-6),
    (4, False, torch.float64, 1e-2),
    (2, True, torch.float32, 1e-3),
    (3, False, torch.float32, 1e-5),
]


@pytest.mark.parametrize(("tasks", "transposed", "dtype", "rel"), CASES)
def test_delta_plus_tasks_matches_dense_solve_with_a_true_reported_residual(
    tasks, transposed, dtype, rel
):
    """δ·I + 1–4 task terms with a bias column, Linear (out, in) or Conv1D (in, out) layout: the
    solution equals the dense solve to κ·tol, and the reported residual is the true one."""
    gen = torch.Generator().manual_seed(10 * tasks + transposed)
    n_out, n_in = 6, 5
    terms = [
        (_decaying_spd(gen, n_in + 1, dtype=dtype), _decaying_spd(gen, n_out, dtype=dtype))
        for _ in range(tasks)
    ]
    k = gm.KFAC({"m": terms}, bias=["m"], transposed=["m"] if transposed else [])
    op = k + rel
    v = {n: torch.randn(s, dtype=DT, generator=gen).to(dtype) for n, s in k.layout}
    info = op.solve_info(v)
    dense = _dense(terms, 1, n_out, n_in, rel)
    b = _flat(v, transposed)
    x = _flat(info.value, transposed)
    true_residual = float(torch.linalg.norm(b - dense @ x) / torch.linalg.norm(b))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    part = info.parts["m"]
    assert info.success and part.residual <= tol
    if "in float64" not in part.method:  # the reported residual is that of the returned x
        assert true_residual <= tol
        # (two float64 evaluations of one residual agree to round-off, far below tol)
        assert part.residual == pytest.approx(true_residual, rel=1e-3, abs=1e-12)
    # else: a float64 solution certified to tol, rounded to float32 (see the fallback test)
    expected = torch.linalg.solve(dense, b)
    cond = float(torch.linalg.cond(dense))
    rounding = 0.0 if dtype == torch.float64 else 1e-6
    error = float(torch.linalg.norm(x - expected))
    assert error <= (cond * tol + rounding) * float(torch.linalg.norm(expected))
    assert (part.iterations == 0) == (tasks == 1)


def test_tasks_sharing_eigenvectors_are_solved_at_the_start():
    """When every task's factors are diagonal in one basis, the diagonal preconditioner is the
    system itself: CG stops at x₀ = D⁻¹b̃ and the answer is exact."""
    gen = torch.Generator().manual_seed(3)
    qa = torch.linalg.qr(torch.randn(8, 8, dtype=DT, generator=gen))[0]
    qg = torch.linalg.qr(torch.randn(5, 5, dtype=DT, generator=gen))[0]
    terms = []
    for t in range(3):
        la, lg = torch.rand(8, dtype=DT, generator=gen) + t, torch.rand(5, dtype=DT, generator=gen)
        terms.append(((qa * la) @ qa.T, (qg * lg) @ qg.T))
    op = gm.KFAC({"m": terms}) + 1e-3
    v = {"m.weight": torch.randn(5, 8, dtype=DT, generator=gen)}
    info = op.solve_info(v)
    dense = _dense(terms, 0, 5, 8, 1e-3)
    expected = torch.linalg.solve(dense, v["m.weight"].reshape(-1))
    torch.testing.assert_close(info.value["m.weight"].reshape(-1), expected, rtol=1e-9, atol=0)
    assert info.parts["m"].iterations == 0


def test_float32_beyond_its_precision_falls_back_to_float64():
    """δ = 1e-7 of the scale with factor spectra over 6 decades: κ·ε₃₂ ≫ 1e-5, so no float32 CG
    reaches the tolerance. The solve goes to float64, certifies that solution's residual, says
    so, and returns it rounded to float32 — close to the dense float64 solution."""
    gen = torch.Generator().manual_seed(7)
    terms = [
        (_decaying_spd(gen, 12, dtype=torch.float32), _decaying_spd(gen, 9, dtype=torch.float32))
        for _ in range(3)
    ]
    op = gm.KFAC({"m": terms}) + 1e-7
    v = {"m.weight": torch.randn(9, 12, generator=gen)}
    info = op.solve_info(v)
    part = info.parts["m"]
    assert "in float64" in part.method and part.residual <= 1e-5
    dense = _dense(terms, 0, 9, 12, 1e-7)
    expected = torch.linalg.solve(dense, v["m.weight"].reshape(-1).to(DT))
    got = info.value["m.weight"].reshape(-1).to(DT)
    # the float64 solution to 1e-5 (forward error ≤ κ·1e-5), then rounded to float32
    bound = float(torch.linalg.cond(dense)) * 1e-5 + 1e-6
    assert float(torch.linalg.norm(got - expected)) <= bound * float(torch.linalg.norm(expected))


def test_unconvergeable_budget_raises_with_the_fix():
    gen = torch.Generator().manual_seed(1)
    terms = [(_decaying_spd(gen, 10), _decaying_spd(gen, 7)) for _ in range(3)]
    op = gm.KFAC({"m": terms}) + 1e-8
    with pytest.raises(gm.NotConvergedError, match=r"prior: \{delta"):
        op.solve_info(
            {"m.weight": torch.randn(7, 10, dtype=DT, generator=gen)}, gm.KroneckerCG(maxiter=1)
        )


def test_singular_system_without_prior_is_refused():
    """Three rank-one terms with no δ: singular; refused (not a silent wrong answer)."""
    gen = torch.Generator().manual_seed(2)
    terms = []
    for _ in range(3):
        a, g = (
            torch.randn(6, 1, dtype=DT, generator=gen),
            torch.randn(4, 1, dtype=DT, generator=gen),
        )
        terms.append((a @ a.T, g @ g.T))
    with pytest.raises(gm.NotPositiveDefiniteError):
        gm.KFAC({"m": terms}).solve({"m.weight": torch.randn(4, 6, dtype=DT, generator=gen)})


def test_split_identity_folds_every_identity_term():
    eye3, eye2 = torch.eye(3, dtype=DT), torch.eye(2, dtype=DT)
    a = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=DT))
    delta, rest = kfac_cg.split_identity([(eye3, 0.5 * eye2), (a, eye2), (2 * eye3, 0.25 * eye2)])
    assert delta == pytest.approx(1.0) and len(rest) == 1 and rest[0][0] is a


def test_merge_of_three_tasks_equals_dense_eq6():
    """gm.gradient_matching with three K-FAC curvatures and δ·I equals Eq. 6 written densely."""
    gen = torch.Generator().manual_seed(11)
    n_out, n_in = 4, 3
    base = {
        "m.weight": torch.randn(n_out, n_in, dtype=DT, generator=gen),
        "m.bias": torch.randn(n_out, dtype=DT, generator=gen),
    }
    fts = [
        P.axpy(
            0.1, {k: torch.randn(v.shape, dtype=DT, generator=gen) for k, v in base.items()}, base
        )
        for _ in range(3)
    ]
    hs = [
        gm.KFAC({"m": (_decaying_spd(gen, n_in + 1, 3), _decaying_spd(gen, n_out, 3))}, bias=["m"])
        for _ in range(3)
    ]
    alphas, delta = [1.0, 0.5, 2.0], 1e-3
    merged = gm.gradient_matching(base, fts, hs, prior=delta, alphas=alphas)
    dense = [_dense(h.terms["m"], 1, n_out, n_in) for h in hs]
    hbar = delta * torch.eye(n_out * (n_in + 1), dtype=DT) + sum(
        a * d for a, d in zip(alphas, dense, strict=True)
    )
    rhs = sum(
        a * (d + delta * torch.eye(len(d), dtype=DT)) @ (_flat(ft) - _flat(base))
        for a, d, ft in zip(alphas, dense, fts, strict=True)
    )
    expected = _flat(base) + torch.linalg.solve(hbar, rhs)
    torch.testing.assert_close(_flat(merged), expected, rtol=1e-8, atol=1e-10)


def _psd_cases():
    """(A, G) pairs: PSD full rank, PSD rank-deficient (fewer rows than inputs), eigenvalues
    slightly below zero within round-off, clearly negative, and both factors negative definite."""
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, 6, dtype=DT, generator=gen), torch.randn(9, 4, dtype=DT, generator=gen)
    full = (_decaying_spd(gen, 6, 3), _decaying_spd(gen, 4, 3))
    low_rank = (x.T @ x, y.T @ y)
    q = torch.linalg.qr(torch.randn(6, 6, dtype=DT, generator=gen))[0]
    lam = torch.tensor([-1e-15, 1e-3, 0.1, 0.5, 1.0, 2.0], dtype=DT)
    round_off = ((q * lam) @ q.T, _decaying_spd(gen, 4, 2))
    lam_neg = torch.tensor([-1e-3, 1e-3, 0.1, 0.5, 1.0, 2.0], dtype=DT)
    negative = ((q * lam_neg) @ q.T, _decaying_spd(gen, 4, 2))
    both_negative = (-full[0], -full[1])
    return {
        "full": full,
        "low_rank": low_rank,
        "round_off": round_off,
        "negative": negative,
        "both_negative": both_negative,
    }


@pytest.mark.parametrize("case", list(_psd_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_psd_check_agrees_with_the_eigenvalue_test(case, dtype):
    """K-FAC's PSD check (a shifted Cholesky that proves PSD, else the eigenvalue test) gives the
    verdict of the exact eigenvalue test of the base class, on every case."""
    a, g = (m.to(dtype) for m in _psd_cases()[case])
    k = gm.KFAC({"m": (a, g)})
    exact_ok = True
    try:
        gm.Curvature.check_psd(k, name="k")  # the eigenvalue test itself
    except gm.NotPositiveDefiniteError:
        exact_ok = False
    try:
        k.check_psd(name="k")
        fast_ok = True
    except gm.NotPositiveDefiniteError:
        fast_ok = False
    assert fast_ok == exact_ok
    assert exact_ok == (case != "negative")
    if case in ("full", "low_rank"):  # decided by Cholesky alone
        assert k._psd_by_cholesky(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_three_term_kfac_and_lazy_sums_solve_in_float32_and_float64(dtype):
    rng = np.random.default_rng(0)
    ks = [
        gm.KFAC(
            {"fc": (spd_tensor(rng, 4, dtype=dtype), spd_tensor(rng, 3, dtype=dtype))}, bias=["fc"]
        )
        for _ in range(2)
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


@pytest.mark.parametrize("maxiter", [0, 2, 1000])
def test_approximate_solve_returns_its_true_residual_and_never_raises(maxiter):
    """``KroneckerCG(approximate=True)``: at most ``maxiter`` CG iterations (0: the eigenbasis preconditioner
    D⁻¹ alone), no error when the residual stays above tol; the reported residual is the one
    recomputed from the dense matrix, ``success`` says whether tol was met, and with enough
    iterations the answer is the exact solve's."""
    gen = torch.Generator().manual_seed(7)
    n_out, n_in = 6, 5
    terms = [(_decaying_spd(gen, n_in + 1), _decaying_spd(gen, n_out)) for _ in range(3)]
    spec = gm.KroneckerCG(tol=1e-10, maxiter=maxiter, approximate=True)
    k = gm.KFAC({"m": terms}, bias=["m"])
    op = k + 1e-4
    v = {n: torch.randn(s, dtype=DT, generator=gen) for n, s in k.layout}
    info = op.solve_info(v, spec)
    part = info.parts["m"]
    b, x = _flat(v), _flat(info.value)
    dense = _dense(terms, 1, n_out, n_in, 1e-4)
    true_residual = float(torch.linalg.norm(b - dense @ x) / torch.linalg.norm(b))
    assert part.residual == pytest.approx(true_residual, rel=1e-6, abs=1e-13)
    assert part.iterations <= maxiter
    assert info.success == part.success == (true_residual <= 1e-10)
    met = gm.Result.successful if true_residual <= 1e-10 else gm.Result.max_iterations_reached
    assert info.result is part.result is met
    if maxiter < 1000:  # this system needs more than a few iterations
        assert not info.success and "approximate: stopped after" in part.method
        exact = op.solve_info(v, gm.KroneckerCG(tol=1e-10))
        assert part.residual > exact.parts["m"].residual
    else:
        assert info.success and torch.allclose(x, torch.linalg.solve(dense, b), rtol=1e-6)


def _with(m, i, j, value):
    m = m.clone()
    m[i, j] = value
    return m


IDENTITY_CASES = [  # (matrix, c or None)
    (2.5 * torch.eye(4), 2.5),
    (torch.zeros(3, 3), 0.0),
    (-1.0 * torch.eye(3), -1.0),
    (torch.full((1, 1), 3.0), 3.0),
    (_with(2.0 * torch.eye(4), 3, 1, 1e-30), None),  # one far off-diagonal entry
    (_with(2.0 * torch.eye(4), 3, 3, 2.0000002), None),  # the last diagonal entry
    (_with(torch.zeros(3, 3), 2, 0, 1.0), None),
    (_with(torch.eye(3), 0, 0, float("nan")), None),
    (torch.ones(3, 3), None),
]


@pytest.mark.parametrize(("m", "expected"), IDENTITY_CASES)
def test_identity_multiple_is_exact(m, expected):
    from gradmerge.solvers.kronecker import identity_multiple

    assert identity_multiple(m) == expected
    assert identity_multiple(m.double()) == expected


def test_the_solver_goes_to_the_call_and_the_old_keywords_name_it():
    """The solver is passed to the call that solves, not held by the operator: ``K.solve_info(v,
    gm.KroneckerCG(maxiter=1))`` obeys it (a budget of 1 iteration raises where the default
    converges), ``K.solve(v)`` runs ``KroneckerCG()``. ``KFAC(solver=...)`` and ``K.solver``
    (which set an operator default the rules overrode) and the keywords and attributes of 0.1.0
    (``cg_tol``, ``cg_maxiter``, ``cg_approximate``) are refused, naming the KroneckerCG at the
    call that replaces each; a solver of another algorithm (``gm.CG``) or a dict is an
    ArgumentError naming ``gm.KroneckerCG``; nothing is silently ignored."""
    gen = torch.Generator().manual_seed(3)
    terms = [(_decaying_spd(gen, 6), _decaying_spd(gen, 4)) for _ in range(3)]
    k = gm.KFAC({"m": terms})
    v = {"m.weight": torch.randn(4, 6, dtype=DT, generator=gen)}
    starved = gm.KroneckerCG(tol=1e-9, maxiter=1, arithmetic="working", warm_start=True)
    with pytest.raises(gm.NotConvergedError):
        (k + 1e-6).solve_info(v, starved)
    default = (k + 1e-6).solve_info(v)
    assert default.success and default.result is gm.Result.successful
    assert torch.equal((k + 1e-6).solve(v)["m.weight"], default.value["m.weight"])
    assert torch.equal(
        (k + 1e-6).solve_info(v, gm.KroneckerCG()).value["m.weight"], default.value["m.weight"]
    )

    with pytest.raises(gm.RemovedArgumentError, match=r"K\.solve_info\(v, KroneckerCG\(tol=1e-06"):
        gm.KFAC({"m": terms}, solver=gm.KroneckerCG(tol=1e-6))
    with pytest.raises(
        gm.RemovedArgumentError, match=r"pass gm\.KroneckerCG\(tol=1e-06, maxiter=5\) to the call"
    ):
        gm.KFAC({"m": terms}, cg_tol=1e-6, cg_maxiter=5)
    with pytest.raises(TypeError, match="approximate"):  # RemovedArgumentError is a TypeError
        gm.KFAC({"m": terms}, cg_approximate=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tol'"):
        gm.KFAC({"m": terms}, tol=1e-6)
    with pytest.raises(gm.ArgumentError, match=r"KFAC solves with a gm\.KroneckerCG, got CG"):
        k.solve_info(v, gm.CG(tol=1e-6))
    with pytest.raises(gm.ArgumentError, match=r"takes a solver object .* got dict"):
        k.solve_info(v, {"tol": 1e-6})  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match=r"gm\.KroneckerCG\(maxiter=\.\.\.\) to the call"):
        k.cg_maxiter = 5
    with pytest.raises(AttributeError, match=r"gm\.KroneckerCG\(tol=\.\.\.\)"):
        _ = k.cg_tol
    with pytest.raises(AttributeError, match=r"KFAC\.solver was removed.*K\.solve_info\(v, "):
        _ = k.solver
    assert "solver" not in vars(k + 1e-6)
