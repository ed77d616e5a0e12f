"""K-FAC with bfloat16 Gram products (``kfac_precision="bfloat16"``): its accuracy, bounded a priori.

The bound (stated in ``EstimateOptions.kfac_precision``). The estimator rounds each row entry x
of a layer's inputs and output gradients to bfloat16, x̂ = x(1 + δ) with |δ| ≤ u = 2⁻⁸ (8
significant bits, round to nearest); the products x̂_ri x̂_rj of two bfloat16 numbers are exact
in float32, summed in float32 inside the GEMM, the GEMM's result rounded to bfloat16 once more
(|ε| ≤ u) and added to the float32 running sum. Every leaf of that summation tree passes through
two operand roundings, one output rounding and at most N float32 roundings (N rows, a division
by the count M for A), so for every entry

    |Â_ij − A_ij| ≤ ((1 + u)³ (1 + γ) − 1) · (|X|ᵀ|X|)_ij / M,     γ = (N + 2)·2⁻²⁴ / (1 − (N + 2)·2⁻²⁴),

where A is the exact (float64) Gram of the very rows the estimator multiplied (recorded here) and
|X| their absolute values (likewise G, with no division). The working-precision path is within
γ · (|X|ᵀ|X|)/M of the same A, so the two paths differ by at most the sum of the two bounds.

For a merge, each layer's K-FAC block changes by E_t = Â⊗Ĝ − A⊗G, ‖E_t‖₂ ≤ ‖ΔA‖_F‖G‖₂ + ‖Â‖₂‖ΔG‖_F;
Eq. 6's layer solution x = H̄⁻¹ b (H̄ = δI + Σ_t H_t, b = Σ_t (δI + H_t) Δ_t) then moves by at most
(Σ_t ‖E_t‖ ‖Δ_t‖ + Σ_t ‖E_t‖ ‖x‖) / (λ_min(H̄) − Σ_t ‖E_t‖), plus each solve's certified residual
(tol ‖b‖ / λ_min(H̄) apiece).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import Tensor, nn

import gradmerge as gm
from gradmerge.errors import ArgumentError
from gradmerge.estimate import kfac as K
from gradmerge.estimate.kfac import estimate_kfac_factors

U_BF16 = 2.0**-8
U_F32 = 2.0**-24


def _gamma(n: int) -> float:
    return n * U_F32 / (1 - n * U_F32)


def _bf16_bound(rows: int) -> float:
    """The bfloat16 path's relative bound, per entry of the Gram of the absolute values."""
    return (1 + U_BF16) ** 3 * (1 + _gamma(rows + 2)) - 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))


def _data() -> list[tuple[Tensor, Tensor]]:
    """Sequences of 4 positions, some targets ignored (masked rows); one batch of 1200 rows
    takes the direct product path, the small ones the gathered one."""
    g = torch.Generator().manual_seed(1)
    out = []
    for batch in (8, 300, 5):
        x = torch.randn(batch, 4, 6, generator=g) * 3
        y = torch.randint(0, 5, (batch, 4), generator=g)
        y[::3, -1] = -100
        out.append((x, y))
    return out


def _recorded(
    monkeypatch: pytest.MonkeyPatch, **kw
) -> tuple[K.KFACFactors, dict[int, tuple[Tensor, Tensor, int]]]:
    """The estimate and, by ``id`` of each factor, the exact float64 Gram of the rows its
    products were given, the Gram of their absolute values, and the number of rows."""
    rows: dict[int, list[tuple[Tensor, float]]] = defaultdict(list)
    add = K._GramSum.add

    def recording(self: K._GramSum, r: Tensor, alpha: float = 1.0) -> None:
        rows[id(self.acc)].append((r.detach().to(torch.float64).clone(), alpha))
        add(self, r, alpha)

    monkeypatch.setattr(K._GramSum, "add", recording)
    kf = estimate_kfac_factors(_model(), _data(), **kw)
    monkeypatch.undo()
    grams: dict[int, tuple[Tensor, Tensor, int]] = {}
    for name, (a, g) in kf.factors.items():
        for factor, bias, count in ((a, kf.has_bias[name], kf.counts[name]), (g, False, 1)):
            x = torch.cat([r for r, _ in rows[id(factor)]])
            alphas = torch.cat([torch.full((len(r),), w) for r, w in rows[id(factor)]])
            if bias:
                x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
            exact = (x.T * alphas) @ x / count
            grams[id(factor)] = (exact, (x.abs().T * alphas) @ x.abs() / count, len(x))
    return kf, grams


@pytest.mark.parametrize("fisher", ["empirical", "mc", "ggn"])
def test_factors_are_within_the_a_priori_bound_of_the_exact_gram(monkeypatch, fisher):
    working, exact_w = _recorded(monkeypatch, fisher=fisher)
    low, exact_b = _recorded(monkeypatch, fisher=fisher, kfac_precision="bfloat16")
    assert low.kfac_precision == "bfloat16" and working.kfac_precision == "working"
    for name in working.factors:
        for w, b in zip(working.factors[name], low.factors[name], strict=True):
            (ref_w, abs_w, rows), (ref_b, abs_b, _) = exact_w[id(w)], exact_b[id(b)]
            torch.testing.assert_close(ref_w, ref_b, rtol=0, atol=0)  # the same rows either way
            err_b = (b.double() - ref_b).abs()
            err_w = (w.double() - ref_w).abs()
            assert (err_b <= _bf16_bound(rows) * abs_b).all(), (name, (err_b / abs_b).max())
            assert (err_w <= _gamma(rows + 2) * abs_w).all(), (name, (err_w / abs_w).max())
            between = (b - w).double().abs()
            assert (between <= (_bf16_bound(rows) + _gamma(rows + 2)) * abs_w).all()
            assert not torch.equal(b, w)  # bfloat16 did change the products
            # not PSD by construction (the products' bfloat16 rounding is per entry): the least
            # eigenvalue is only bounded, λ_min(Â) ≥ λ_min(A) − ‖Â − A‖₂ ≥ −bound · ‖|X|ᵀ|X|‖_F
            lowest = float(torch.linalg.eigvalsh(b.double()).min())
            assert lowest >= -_bf16_bound(rows) * float(abs_b.norm())
            assert torch.equal(b, b.T) and torch.equal(w, w.T)  # symmetric, bit for bit


def _merge_inputs() -> tuple[dict[str, Tensor], list[dict[str, Tensor]], list]:
    torch.manual_seed(2)
    base = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    theta0 = {k: v.detach().clone() for k, v in base.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    tasks = []
    for t in range(2):
        ft = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        ft.load_state_dict({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype)
                            for k, v in theta0.items()})  # fmt: skip
        data = [(torch.randn(400, 6, generator=g, dtype=torch.float64) + t,
                 torch.randint(0, 3, (400,), generator=g))]  # fmt: skip
        tasks.append((ft, data))
    return theta0, [{k: v.detach() for k, v in ft.state_dict().items()} for ft, _ in tasks], tasks


def test_a_kfac_merge_moves_within_the_bound_derived_from_the_factors():
    theta0, thetas, tasks = _merge_inputs()
    curv = {
        precision: [
            gm.estimate_curvature(ft, data, structure="kfac", kfac_precision=precision)
            for ft, data in tasks
        ]
        for precision in ("working", "bfloat16")
    }
    # a prior of a tenth of the largest block's norm: above the a-priori change of the blocks
    # (≈ 4 · 1.2 % of it), so that the bound below is finite
    norm = torch.linalg.matrix_norm
    delta = 0.1 * max(
        float(norm(a, 2) * norm(g, 2)) for c in curv["working"] for ((a, g),) in c.terms.values()
    )
    tol = 1e-10
    merged = {
        precision: gm.gradient_matching(
            theta0, thetas, curv[precision], prior=delta, solver=gm.SolverSpec(tol=tol)
        )
        for precision in curv
    }
    for layer in ("0", "2"):
        keys = [f"{layer}.weight", f"{layer}.bias"]

        def vec(params: dict[str, Tensor], keys: list[str] = keys) -> Tensor:
            return torch.cat([params[k].reshape(-1) for k in keys])

        x = vec(merged["working"]) - vec(theta0)
        moved = (vec(merged["bfloat16"]) - vec(merged["working"])).norm()
        steps = [(vec(t) - vec(theta0)).norm() for t in thetas]
        kron, errors, measured, b_norm = 0, [], [], 0.0
        for t, (ft, data) in enumerate(tasks):
            (a, gg), (a_low, g_low) = (curv[p][t].terms[layer][0] for p in ("working", "bfloat16"))
            kron = kron + torch.kron(gg, a)
            rows = sum(len(x_) for x_, _ in data) + 8
            # the a-priori bounds of both paths around the exact Gram, in norm (module docstring)
            err_a = (_bf16_bound(rows) + _gamma(rows + 2)) * _abs_gram(ft, data, layer, "A").norm()
            err_g = (_bf16_bound(rows) + _gamma(rows + 2)) * _abs_gram(ft, data, layer, "G").norm()
            assert (a_low - a).norm() <= err_a and (g_low - gg).norm() <= err_g
            errors.append(err_a * norm(gg, 2) + norm(a_low, 2) * err_g)
            measured.append((a_low - a).norm() * norm(gg, 2) + norm(a_low, 2) * (g_low - gg).norm())
            b_norm += (delta + norm(a, 2) * norm(gg, 2)) * steps[t]
        lam = float(torch.linalg.eigvalsh(kron).min()) + delta

        # a priori (from the factor bounds alone) and from the factors' measured change
        args = (steps, float(x.norm()), b_norm, lam, tol)
        assert 0 < moved <= _merge_bound(measured, *args) <= _merge_bound(errors, *args)


def _merge_bound(errors: list, steps: list, x: float, b: float, lam: float, tol: float) -> float:
    """‖x̂ − x‖ for blocks changed by ‖E_t‖ ≤ ``errors[t]`` (module docstring): tasks' steps
    ‖Δ_t‖, the solution's ‖x‖, ‖b‖, λ_min(H̄) and each solve's certified relative residual."""
    eta = float(sum(errors))
    assert eta < lam  # a finite bound
    moved = float(sum(e * s for e, s in zip(errors, steps, strict=True))) + eta * x
    return (moved + 2 * tol * (b + eta * float(max(steps)))) / (lam - eta)


def _abs_gram(model: nn.Module, data, layer: str, factor: str) -> Tensor:
    """(|X|ᵀ|X|)/M of layer ``layer``'s inputs (A, with the bias column) or output gradients
    (G, empirical Fisher), from hooks and autograd (the MLP of the merge test: one position)."""
    module = model.get_submodule(layer)
    seen: dict[str, Tensor] = {}

    def keep(_m: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        seen["a"], seen["z"] = args[0].detach(), out
        out.retain_grad()

    handle = module.register_forward_hook(keep)
    try:
        ((x, y),) = data
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    if factor == "A":
        rows = torch.cat([seen["a"], torch.ones(len(seen["a"]), 1, dtype=seen["a"].dtype)], 1)
        return rows.abs().T @ rows.abs() / len(rows)
    g = seen["z"].grad
    assert g is not None
    return g.abs().T @ g.abs()


def test_unknown_precisions_are_refused_naming_the_choices():
    with pytest.raises(
        ArgumentError, match="kfac_precision must be 'working' or 'bfloat16', got 'half'"
    ):
        gm.EstimateOptions(structure="kfac", kfac_precision="half")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="kfac_precision must be"):
        estimate_kfac_factors(_model(), _data(), kfac_precision="float16")  # type: ignore[arg-type]


def test_the_curvature_records_its_precision():
    model, data = _model(), _data()
    low = gm.estimate_curvature(model, data, structure="kfac", kfac_precision="bfloat16")
    assert low.meta["kfac_precision"] == "bfloat16"
    assert "kfac_precision" not in gm.estimate_curvature(model, data, structure="kfac").meta
    assert torch.finfo(torch.bfloat16).eps / 2 == U_BF16  # the unit roundoff the bounds use
