"""Symbolic proofs of the appendix: every check decides its statement as expected."""

from __future__ import annotations

import pytest
import sympy as sp

from gradmerge.theory.symbolic import ALL_CHECKS, run_all
from gradmerge.theory.symbolic._check import SymbolicCheck
from gradmerge.theory.symbolic._util import (
    counterexample,
    decide,
    decide_equal,
    inv,
    is_identically_zero,
    sym,
    vec,
)


@pytest.mark.parametrize("check", ALL_CHECKS, ids=[c.id for c in ALL_CHECKS])
def test_check(check: SymbolicCheck) -> None:
    assert check.run() is check.expect, f"{check.where}: {check.statement}"


def test_ids_unique_and_stable_format() -> None:
    ids = [c.id for c in ALL_CHECKS]
    assert len(ids) == len(set(ids))
    assert all(i == i.lower() and " " not in i for i in ids)


def test_both_kinds_present() -> None:
    assert any(c.expect for c in ALL_CHECKS)
    assert any(not c.expect for c in ALL_CHECKS)


def test_run_all_shape() -> None:
    assert callable(run_all)
    assert len(ALL_CHECKS) > 40


# ---- the machinery can fail -------------------------------------------------------------------


def test_wrong_scalar_identity_is_rejected() -> None:
    a, b = sp.symbols("a b")
    assert decide((a + b) ** 2 - (a**2 + b**2)) is False
    assert decide((a + b) ** 2 - (a**2 + 2 * a * b + b**2)) is True


def test_wrong_matrix_identities_are_rejected() -> None:
    h, g = sym("H"), sym("G")
    v = vec("v")
    # (HG)⁻¹ = G⁻¹H⁻¹ holds, (HG)⁻¹ = H⁻¹G⁻¹ does not (non-commutative)
    assert decide(inv(h * g) - inv(g) * inv(h)) is True
    assert decide(inv(h * g) - inv(h) * inv(g)) is False
    # H H⁻¹ v = v holds, H⁻¹ v = v does not
    assert decide(h * inv(h) * v - v) is True
    assert decide(inv(h) * v - v) is False


def test_shape_mismatch_is_not_an_identity() -> None:
    assert decide_equal(sp.zeros(1, 1), sp.zeros(2, 2)) is False


def test_counterexample_is_exact_and_certified() -> None:
    x, y = sp.symbols("x y")
    point = counterexample(x * y - y * x + x)
    assert point is not None and (x * y - y * x + x).subs(point) != 0
    assert counterexample(x - x) is None
    assert is_identically_zero(sp.Matrix([x / y - x * y / y**2]))


def test_a_perturbed_premise_breaks_a_true_check() -> None:
    """Eq. 2 with the wrong sign in the fine-tune condition must not be reported as holding."""
    from gradmerge.theory.symbolic import mismatch

    s = mismatch._setup()
    h0, thl, th, al, g_m, thm = (s[k] for k in ("h0", "thL", "th", "al", "g_m", "thm"))
    wrong_g_ft = [h0 * (th[t] - thl) for t in range(mismatch.T)]  # sign flipped
    th_ta = thl + sum((al[t] * (th[t] - thl) for t in range(mismatch.T)), sp.zeros(2, 1))
    mism = sum(
        (al[t] * inv(h0) * (g_m[t] - wrong_g_ft[t]) for t in range(mismatch.T)), sp.zeros(2, 1)
    )
    assert decide(thm - (th_ta - mism)) is False
