"""``gm.refine(solver=)``: the solver object goes to each Newton step's solve of H̄, as for the
other rules that solve (no operator carries settings)."""

import pytest
import torch

import gradmerge as gm
from gradmerge import params as P

DT = torch.float64


def _problem():
    """Quadratic tasks ℓ_t(θ) = ½(θ − θ_t)ᵀ H_t (θ − θ_t), H_t = A_t ⊗ G_t on one layer: with
    δ·I, H̄ has three Kronecker terms (solved by eigenbasis-preconditioned CG)."""
    gen = torch.Generator().manual_seed(4)

    def spd(n):
        m = torch.randn(n, n, dtype=DT, generator=gen)
        return m @ m.T / n + 0.5 * torch.eye(n, dtype=DT)

    ks = [gm.KFAC({"m": (spd(5), spd(4))}) for _ in range(2)]
    base = {"m.weight": torch.zeros(4, 5, dtype=DT)}
    fts = [{"m.weight": torch.randn(4, 5, dtype=DT, generator=gen)} for _ in range(2)]
    grads = [(lambda th, k=k, ft=ft: k.mv(P.sub(th, ft))) for k, ft in zip(ks, fts, strict=True)]
    return base, fts, ks, grads


def test_refine_passes_its_solver_to_each_step():
    base, fts, ks, grads = _problem()
    # quadratic losses: one Newton step from θ_LLM = 0 lands on the stationary point of
    # δ/2‖θ‖² + Σ_t ℓ_t(θ): (δI + Σ_t G_t ⊗ A_t) vec θ = Σ_t (G_t ⊗ A_t) vec θ_t (row-major vec)
    (step,) = gm.refine(base, base, grads, ks, prior=0.1, solver=gm.KroneckerCG(tol=1e-12))
    dense = [torch.kron(k.terms["m"][0][1], k.terms["m"][0][0]) for k in ks]
    lhs = 0.1 * torch.eye(20, dtype=DT) + sum(dense)
    rhs = sum(d @ ft["m.weight"].reshape(-1) for d, ft in zip(dense, fts, strict=True))
    expected = torch.linalg.solve(lhs, rhs).reshape(4, 5)
    torch.testing.assert_close(step["m.weight"], expected, rtol=1e-9, atol=1e-11)
    with pytest.raises(gm.NotConvergedError):
        gm.refine(base, base, grads, ks, prior=0.1, solver=gm.KroneckerCG(tol=1e-12, maxiter=1))
    with pytest.raises(gm.ArgumentError, match=r"KFAC solves with a gm\.KroneckerCG"):
        gm.refine(base, base, grads, ks, prior=0.1, solver=gm.CG())
