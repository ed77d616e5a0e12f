"""Eq. 13's fused elementwise pass (gradmerge.elementwise.removal) against the operator algebra.

The reference is the generic rule written out with the operator algebra's operations
(h_0.mv(τ) + h_t.mv(τ), remaining.solve, axpy): the fused pass must equal it bit for bit, fall
back to the generic diagnosis on bad values, and measure the step, the task vector and the
rounding bound Σ [r (|θ_t| + |θ_LLM|)]² exactly as defined.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge import params as P
from gradmerge.elementwise import removal


def _generic(base, ft, h0, ht, rest, alpha):
    tau = P.sub(ft, base)
    rhs = P.add(h0.mv(tau), ht.mv(tau))
    return P.axpy(-alpha, rest.solve(rhs), base)


def _as_curvature(c):
    return gm.ScaledIdentity(c) if isinstance(c, float) else c


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(["diag", "delta", "shifted"]),
    st.sampled_from(["diag", "delta"]),
    st.sampled_from(["diag", "shifted", "delta"]),
    st.floats(0.1, 2.0),
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(1, 200_000),
)
def test_fused_removal_equals_the_operator_algebra_bit_for_bit(seed, p0, pt, pr, alpha, dtype, n):
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (n,), "b": (3, 5)}

    def rand(scale=1.0):
        return {
            k: (scale * torch.rand(s, generator=g, dtype=torch.float64)).to(dtype)
            for k, s in shapes.items()
        }

    def make(kind):
        if kind == "delta":
            return 0.3
        d = gm.Diagonal(rand(5.0))
        return d.shifted(0.7, 1e-3) if kind == "shifted" else d

    base, ft = rand(), rand()
    h0, ht, rest = make(p0), make(pt), make(pr)
    if isinstance(rest, gm.Diagonal):
        rest = rest + 1e-2
    removed = gm.with_solution(gm.remove, base, ft, ht, remaining=rest, prior=h0, alpha=alpha)
    got, report = removed.params, removed.solution
    want = _generic(base, ft, _as_curvature(h0), _as_curvature(ht), _as_curvature(rest), alpha)
    for k in shapes:
        assert torch.equal(got[k], want[k]), k
    # what the pass measured, computed directly (float64)
    s = removal.RemovalStats(**report.measured)
    wide = {k: v.double() for k, v in got.items()}
    b64, f64 = ({k: v.double() for k, v in x.items()} for x in (base, ft))
    step = sum(float(((wide[k] - b64[k]) ** 2).sum()) for k in shapes)
    ref = sum(float(((f64[k] - b64[k]) ** 2).sum()) for k in shapes)
    dense = {
        name: (c if isinstance(c, float) else {k: v.double() for k, v in c.values.items()})
        for name, c in (("h0", h0), ("ht", ht), ("rest", rest))
    }

    def at(name, k):
        c = dense[name]
        return c if isinstance(c, float) else c[k]

    r = {k: abs(alpha) * (at("h0", k) + at("ht", k)) / at("rest", k) for k in shapes}
    amp = sum(float(((r[k] * (f64[k].abs() + b64[k].abs())) ** 2).sum()) for k in shapes)
    ratio = max(float(r[k].max()) if isinstance(r[k], torch.Tensor) else r[k] for k in shapes)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert s.step_sq == pytest.approx(step, rel=tol, abs=1e-30)
    assert s.reference_sq == pytest.approx(ref, rel=tol, abs=1e-30)
    assert s.amplified_sq == pytest.approx(amp, rel=tol)
    assert s.max_ratio == pytest.approx(ratio, rel=tol)


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda c: c["ht"]["w"].__setitem__(1, -1.0), gm.NotPositiveDefiniteError),
        (lambda c: c["rest"]["w"].__setitem__(2, 0.0), gm.NotPositiveDefiniteError),
        (lambda c: c["ft"]["w"].__setitem__(0, math.nan), gm.NonFiniteError),
        (lambda c: c["h0"]["w"].__setitem__(0, math.nan), gm.NonFiniteError),
    ],
    ids=["negative-curvature", "zero-remaining", "nan-weights", "nan-prior"],
)
def test_bad_values_get_the_generic_diagnosis(change, error):
    values = {name: {"w": torch.rand(5) + 0.5} for name in ("base", "ft", "h0", "ht", "rest")}
    change(values)
    with pytest.raises(error):
        gm.remove(
            values["base"],
            values["ft"],
            gm.Diagonal._of(values["ht"]),
            remaining=gm.Diagonal._of(values["rest"]),
            prior=gm.Diagonal._of(values["h0"]),
        )
