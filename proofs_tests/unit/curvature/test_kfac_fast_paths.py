"""The faster K-FAC solve paths (gradmerge/solvers/kfac_cg.py) against dense solves: bfloat16
Kronecker products under a working-precision refinement, warm starts, and the low-rank
reduction of factors estimated from few rows. Each path must reach the same certified residual
as the plain solve, report the true residual (recomputed here from the dense matrix), and keep
the NotConvergedError contract. Also the explicit solver settings (gm.KroneckerCG) from the
in-memory rules' ``solver=`` and ``gm.with_solution``."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge.errors import ArgumentError, NotConvergedError
from gradmerge.solvers import kfac_cg

DT = torch.float64


def _spd(gen, n, orders, dtype):
    q = torch.linalg.qr(torch.randn(n, n, dtype=DT, generator=gen))[0]
    lam = 10.0 ** (-orders * torch.linspace(0, 1, n, dtype=DT))
    return ((q * lam) @ q.T).to(dtype)


def _low_rank(gen, n, rank, dtype):
    """U Uᵀ/rank with U n × rank: a factor estimated from ``rank`` rows (mean of a aᵀ)."""
    u = torch.randn(n, rank, dtype=DT, generator=gen)
    return (u @ u.T / rank).to(dtype)


def _dense(delta, terms):
    """δI + Σ_k A_k ⊗ G_k acting on X (out × in) flattened row-major: vec(G X A)."""
    n = terms[0][1].shape[0] * terms[0][0].shape[0]
    return delta * torch.eye(n, dtype=DT) + sum(torch.kron(g.to(DT), a.to(DT)) for a, g in terms)


def _check(delta, terms, b, solved, tol):
    """The solution solves the dense system to ``tol`` and the reported residual is the true one
    (cases the working dtype resolves: no float64 fallback)."""
    assert "in float64" not in solved.method
    k = _dense(delta, terms)
    x = solved.x.to(DT).reshape(-1)
    bb = b.to(DT).reshape(-1)
    true = float(torch.linalg.norm(bb - k @ x) / torch.linalg.norm(bb))
    assert solved.residual <= tol and true <= tol
    # both are float64 residuals of the same x: they differ by the round-off of forming K x
    rounding = (
        64 * torch.finfo(DT).eps * float(torch.linalg.matrix_norm(k, 2) * x.norm() / bb.norm())
    )
    assert solved.residual == pytest.approx(true, rel=1e-6, abs=rounding)
    exact = torch.linalg.solve(k, bb)
    kappa = float(torch.linalg.cond(k))
    assert float(torch.linalg.norm(x - exact) / torch.linalg.norm(exact)) <= 2 * kappa * tol


BF16_CASES = [  # (tasks, n_out, n_in, dtype, δ, tol, spectrum orders)
    (2, 12, 9, torch.float32, 1e-2, 1e-5, 3.0),
    (3, 10, 7, torch.float32, 1e-3, 1e-5, 4.0),
    (2, 8, 11, torch.float64, 1e-4, 1e-10, 5.0),
    (4, 9, 6, torch.float64, 1e-2, 1e-8, 2.0),
]


@pytest.mark.parametrize(("tasks", "n_out", "n_in", "dtype", "delta", "tol", "orders"), BF16_CASES)
def test_bfloat16_products_under_refinement_reach_the_certified_tolerance(
    tasks, n_out, n_in, dtype, delta, tol, orders
):
    gen = torch.Generator().manual_seed(tasks * 100 + n_out)
    terms = [
        (_spd(gen, n_in, orders, dtype), _spd(gen, n_out, orders, dtype)) for _ in range(tasks)
    ]
    b = torch.randn(n_out, n_in, dtype=DT, generator=gen).to(dtype)
    spec = gm.KroneckerCG(tol=tol, arithmetic="bfloat16")
    solved = kfac_cg.solve("m", delta, terms, b, spec)
    assert "bfloat16 products" in solved.method
    _check(delta, terms, b, solved, tol)
    plain = kfac_cg.solve("m", delta, terms, b, gm.KroneckerCG(tol=tol))
    assert "bfloat16" not in plain.method


def _decaying_psd(seed: int, n: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rank, n, generator=gen) * torch.logspace(0, -3, n)
    return x.T @ x


@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_rounding_that_meets_negative_curvature_hands_over_to_working_precision(seed):
    """δ = 1e-4 of the terms' scale, rank-deficient factors over three decades: bfloat16's
    rounding of K̃p meets pᵀK̃p ≤ 0 although K is positive definite (this refused MiniLM's K-FAC
    merge by default); the solve must then finish in working precision, certified like it."""
    n = 300
    terms = [
        (_decaying_psd(seed + 10 * k, n, 40), _decaying_psd(seed + 10 * k + 5, n, 40))
        for k in range(2)
    ]
    scale = max(
        float(torch.linalg.matrix_norm(a, 2) * torch.linalg.matrix_norm(g, 2)) for a, g in terms
    )
    b = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    basis = kfac_cg.Basis("m", 1e-4 * scale, terms, "bfloat16")
    bt = basis.qg.T @ b @ basis.qa
    with pytest.raises(gm.NotPositiveDefiniteError) as refused:  # the bfloat16 CG alone
        kfac_cg._pcg(
            basis._apply_low, bt, basis.diagonal, 1e-6 * float(bt.norm()), 500, basis.refusal
        )
    assert refused.value.suggested_delta > 1e-4 * scale  # a larger δ, never the one refused
    solved = kfac_cg.solve(
        "m", 1e-4 * scale, terms, b, gm.KroneckerCG(arithmetic="bfloat16"), reduce=False
    )
    plain = kfac_cg.solve(
        "m", 1e-4 * scale, terms, b, gm.KroneckerCG(arithmetic="working"), reduce=False
    )
    assert solved.residual <= 1e-5 and "bfloat16 products" in solved.method
    wide = [(a.double(), g.double()) for a, g in terms]
    x = solved.x.double()
    true = b.double() - 1e-4 * scale * x - sum(g @ x @ a for a, g in wide)
    assert float(true.norm() / b.double().norm()) <= 1e-5  # the certificate is the true residual
    assert torch.allclose(solved.x, plain.x, rtol=1e-3, atol=1e-3 * float(plain.x.abs().max()))


@pytest.mark.parametrize("delta", [0.0, 1e-4, 9.9e-4])
def test_an_indefinite_system_names_a_delta_past_its_rayleigh_quotient(delta):
    """Factors rounded from PSD can be indefinite: A = diag(1, −1e-3), G = I gives K's
    eigenvalue δ − 1e-3, so K needs δ > 1e-3. The refusal names a δ past that bound (and past
    the terms' round-off), and the solve at the named δ succeeds, equal to the dense solve."""
    a, g = torch.diag(torch.tensor([1.0, -1e-3], dtype=DT)), torch.eye(3, dtype=DT)
    b = torch.ones(3, 2, dtype=DT)
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"has an entry -?\d") as refused:
        kfac_cg.solve("m", delta, [(a, g)], b)
    named = refused.value.suggested_delta
    assert named > 1e-3 and f"δ ≥ {named:.1e}" in str(refused.value)
    x = kfac_cg.solve("m", named, [(a, g)], b).x
    dense = named * torch.eye(6, dtype=DT) + torch.kron(g, a)
    torch.testing.assert_close(x.reshape(-1), torch.linalg.solve(dense, b.reshape(-1)))


def test_bfloat16_solve_that_cannot_converge_still_raises():
    gen = torch.Generator().manual_seed(3)
    terms = [(_spd(gen, 7, 6.0, DT), _spd(gen, 6, 6.0, DT)) for _ in range(3)]
    b = torch.randn(6, 7, dtype=DT, generator=gen)
    with pytest.raises(NotConvergedError, match="solved only to relative residual"):
        kfac_cg.solve(
            "m", 1e-9, terms, b, gm.KroneckerCG(tol=1e-12, maxiter=2, arithmetic="bfloat16")
        )


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    tasks=st.integers(2, 3),
    blend=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_warm_start_from_any_guess_gives_the_certified_solution(seed, tasks, blend, dtype):
    """x0 = blend·x* + (1 − blend)·noise: whatever the guess, the certified solution; the exact
    guess (blend = 1) needs no CG iteration."""
    gen = torch.Generator().manual_seed(seed)
    terms = [(_spd(gen, 6, 3.0, dtype), _spd(gen, 5, 3.0, dtype)) for _ in range(tasks)]
    b = torch.randn(5, 6, dtype=DT, generator=gen).to(dtype)
    delta, tol = 1e-2, (1e-5 if dtype == torch.float32 else 1e-10)
    exact = torch.linalg.solve(_dense(delta, terms), b.to(DT).reshape(-1)).reshape(5, 6)
    noise = torch.randn(5, 6, dtype=DT, generator=gen) * float(exact.norm())
    x0 = (blend * exact + (1 - blend) * noise).to(dtype)
    solved = kfac_cg.solve("m", delta, terms, b, gm.KroneckerCG(tol=tol, warm_start=True), x0=x0)
    _check(delta, terms, b, solved, tol)
    if dtype == torch.float64:
        warm = gm.KroneckerCG(tol=1e-8, warm_start=True)
        at_solution = kfac_cg.solve("m", delta, terms, b, warm, x0=exact)
        assert at_solution.iterations == 0


def test_warm_start_off_ignores_the_guess():
    gen = torch.Generator().manual_seed(5)
    terms = [(_spd(gen, 6, 3.0, DT), _spd(gen, 5, 3.0, DT)) for _ in range(2)]
    b = torch.randn(5, 6, dtype=DT, generator=gen)
    exact = torch.linalg.solve(_dense(1e-2, terms), b.reshape(-1)).reshape(5, 6)
    off = gm.KroneckerCG(tol=1e-8, warm_start=False)
    cold = kfac_cg.solve("m", 1e-2, terms, b, off, x0=exact)
    assert cold.iterations == kfac_cg.solve("m", 1e-2, terms, b, off).iterations > 0


LOW_RANK_CASES = [  # (tasks, n_out, n_in, rows per task, dtype, δ, tol)
    (2, 24, 20, 3, torch.float64, 1e-2, 1e-10),
    (2, 24, 20, 3, torch.float32, 1e-1, 1e-5),
    (3, 18, 26, 2, torch.float32, 1e-1, 1e-5),
    (1, 22, 22, 4, torch.float64, 1e-4, 1e-10),
]


@pytest.mark.parametrize(
    ("tasks", "n_out", "n_in", "rows", "dtype", "delta", "tol"), LOW_RANK_CASES
)
def test_low_rank_factors_are_solved_on_their_joint_range(
    monkeypatch, tasks, n_out, n_in, rows, dtype, delta, tol
):
    """Factors of rank ``rows`` (few tokens): the reduction to the joint range is taken and the
    result is the dense solve's, certified against the full operator."""
    monkeypatch.setattr(kfac_cg, "MIN_SIDE", 8)
    gen = torch.Generator().manual_seed(tasks * 7 + n_in)
    terms = [
        (_low_rank(gen, n_in, rows, dtype), _low_rank(gen, n_out, rows, dtype))
        for _ in range(tasks)
    ]
    b = torch.randn(n_out, n_in, dtype=DT, generator=gen).to(dtype)
    solved = kfac_cg.solve("m", delta, terms, b, gm.KroneckerCG(tol=tol))
    assert solved.method.startswith("low-rank reduction to "), solved.method
    shape = solved.method.removeprefix("low-rank reduction to ").split(" ")[0]
    r_out, r_in = (int(n) for n in shape.split("×"))
    assert tasks * rows <= r_out <= n_out // 2 and tasks * rows <= r_in <= n_in // 2
    _check(delta, terms, b, solved, tol)


def test_full_rank_factors_are_not_reduced(monkeypatch):
    monkeypatch.setattr(kfac_cg, "MIN_SIDE", 8)
    gen = torch.Generator().manual_seed(1)
    terms = [(_spd(gen, 16, 2.0, DT), _spd(gen, 18, 2.0, DT)) for _ in range(2)]
    assert kfac_cg.LowRank.build("m", 1e-2, terms) is None
    b = torch.randn(18, 16, dtype=DT, generator=gen)
    solved = kfac_cg.solve("m", 1e-2, terms, b)
    assert solved.method.startswith("eigenbasis-preconditioned CG")


SPEC_ERRORS = [  # each message names the field, what it must be and what came
    ({"tol": 0.0}, r"`KroneckerCG.tol` \(a relative residual\) must be > 0 and < 1, got 0.0"),
    ({"tol": 1.5}, r"`KroneckerCG.tol` \(a relative residual\) must be > 0 and < 1, got 1.5"),
    ({"tol": float("nan")}, r"`KroneckerCG.tol` must be a finite number, got nan"),
    ({"maxiter": 0}, r"`KroneckerCG.maxiter` must be a whole number ≥ 1 \(≥ 0 with approximate"),
    ({"maxiter": -1, "approximate": True}, r"`KroneckerCG.maxiter` must be ≥ 0, got -1"),
    ({"maxiter": 2.5}, "whole number"),
    ({"approximate": "yes"}, "true or false"),
    ({"arithmetic": "float16"}, "`KroneckerCG.arithmetic` must be one of auto, working, bfloat16"),
]


@pytest.mark.parametrize(("kwargs", "message"), SPEC_ERRORS)
def test_solver_spec_refuses_bad_settings(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        gm.KroneckerCG(**kwargs)


CG_ERRORS = [  # CG declares tol and maxiter only: the K-FAC settings are not its keywords
    ({"tol": 0.0}, r"`CG.tol` \(a relative residual\) must be > 0 and < 1, got 0.0"),
    ({"maxiter": 0}, r"`CG.maxiter` must be a whole number ≥ 1, got 0$"),
]


@pytest.mark.parametrize(("kwargs", "message"), CG_ERRORS)
def test_cg_refuses_bad_settings_and_holds_only_its_own(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        gm.CG(**kwargs)
    assert [f.name for f in dataclasses.fields(gm.CG)] == ["tol", "maxiter"]
    for kfac_only in ("approximate", "arithmetic", "warm_start"):
        with pytest.raises(TypeError, match=kfac_only):
            gm.CG(**{kfac_only: True})


def test_solver_spec_is_the_former_name_of_kronecker_cg():
    """``gm.SolverSpec`` is kept as a thin alias: the same class, fields and checks."""
    assert gm.SolverSpec is gm.KroneckerCG
    assert gm.SolverSpec(tol=1e-4, maxiter=200) == gm.KroneckerCG(tol=1e-4, maxiter=200)
    assert isinstance(gm.KroneckerCG(), gm.CG) and isinstance(gm.CG(), gm.Solver)


def test_the_old_name_of_arithmetic_is_refused_naming_the_new_one():
    """``precision=`` of gradmerge 0.1.0 is ``arithmetic=`` ("precision" is the prior's matrix):
    the old keyword raises RemovedArgumentError (a TypeError) with the replacement and its
    value, alone or among other fields; the new one, the positional form, ``replace`` and
    pickling are unaffected."""
    import pickle

    for kwargs in ({"precision": "working"}, {"tol": 1e-6, "precision": "working"}):
        with pytest.raises(gm.RemovedArgumentError, match=r"KroneckerCG\(arithmetic=\.\.\.\)"):
            gm.KroneckerCG(**kwargs)
        with pytest.raises(TypeError, match="arithmetic='working'"):
            gm.KroneckerCG(**kwargs)
    spec = gm.KroneckerCG(1e-6, 5, False, "working")
    assert spec == gm.KroneckerCG(tol=1e-6, maxiter=5, arithmetic="working")
    assert dataclasses.replace(spec, arithmetic="bfloat16").arithmetic == "bfloat16"
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert not hasattr(spec, "precision")


def test_solver_spec_is_frozen():
    spec = gm.KroneckerCG(approximate=True, maxiter=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tol = 1e-3  # type: ignore[misc]


def test_rules_take_the_spec_and_return_the_solution_without_touching_the_operators():
    gen = torch.Generator().manual_seed(2)
    terms = [(_spd(gen, 5, 2.0, DT), _spd(gen, 4, 2.0, DT)) for _ in range(2)]
    ks = [gm.KFAC({"m": t}) for t in terms]
    base = {"m.weight": torch.zeros(4, 5, dtype=DT)}
    fts = [{"m.weight": torch.randn(4, 5, dtype=DT, generator=gen)} for _ in range(2)]
    before = [vars(k).copy() for k in ks]
    loose = gm.KroneckerCG(tol=1e-3, approximate=True, maxiter=1)
    merged = gm.with_solution(gm.gradient_matching, base, fts, ks, prior=1e-2, solver=loose)
    part = merged.solution.parts["m"]
    assert part.iterations <= 1 and part.method.endswith("CG iterations") == (part.residual > 1e-3)
    assert [vars(k) for k in ks] == before  # the spec went to the solve, not onto the operators
    tight = gm.with_solution(
        gm.gradient_matching, base, fts, ks, prior=1e-2, solver=gm.KroneckerCG(tol=1e-12)
    )
    assert tight.solution.parts["m"].residual <= 1e-12
    plain = gm.gradient_matching(base, fts, ks, prior=1e-2)
    assert isinstance(plain, dict) and torch.allclose(plain["m.weight"], tight.params["m.weight"])
    assert set(merged.params) == set(base)
    removed = gm.with_solution(gm.remove, base, fts[0], ks[0], remaining=ks[1] + 1e-2, prior=1e-2)
    assert removed.solution.parts["m"].residual <= 1e-10 and set(removed.params) == set(base)


@pytest.mark.parametrize("fast", [True, False])
def test_auto_arithmetic_takes_bfloat16_products_only_for_large_float32_layers_on_fast_devices(
    monkeypatch, fast
):
    """``arithmetic="auto"`` (the default): bfloat16 products where the device's bfloat16 GEMMs
    are faster and both sides are ≥ LOW_MIN_SIDE, the working dtype elsewhere; either way the
    certified residual meets ``tol``."""
    monkeypatch.setitem(kfac_cg._FAST, "cpu", fast)
    gen = torch.Generator().manual_seed(11)
    side = kfac_cg.LOW_MIN_SIDE
    large = [(_spd(gen, side + 3, 3.0, DT), _spd(gen, side, 3.0, DT)) for _ in range(2)]
    large = [(a.float(), g.float()) for a, g in large]
    b = torch.randn(side, side + 3, generator=gen)
    solved = kfac_cg.solve("big", 1e-2, large, b)
    assert ("bfloat16 products" in solved.method) is fast
    # the operator applied in float64 (too large for _check's dense matrix)
    op = 1e-2 * solved.x.double() + sum(
        g.double() @ solved.x.double() @ a.double() for a, g in large
    )
    true = float(torch.linalg.norm(b.double() - op) / torch.linalg.norm(b.double()))
    assert true <= 1e-5 and solved.residual == pytest.approx(true, rel=1e-6)
    small = [(a[:40, :40].contiguous(), g[:30, :30].contiguous()) for a, g in large]
    wide = [(a.double(), g.double()) for a, g in large]
    assert kfac_cg.auto_arithmetic(small) == "working"
    assert kfac_cg.auto_arithmetic(wide) == "working"
    assert kfac_cg.auto_arithmetic(large) == ("bfloat16" if fast else "working")


def test_fast_bfloat16_is_measured_once_per_device_type():
    first = kfac_cg.fast_bfloat16(torch.device("cpu"))
    assert isinstance(first, bool) and kfac_cg._FAST["cpu"] is first
    assert kfac_cg.fast_bfloat16(torch.device("meta")) is False
