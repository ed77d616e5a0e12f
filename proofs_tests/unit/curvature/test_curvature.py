"""Curvature operators: typed errors (singular and indefinite systems, bad constructors, layouts
and vectors that do not fit), PSD messages, adding zero, key order of dense sums. Every
structure's algebra against its dense matrix is in test_conformance.py."""

import numpy as np
import pytest
import torch

import gradmerge as gm
from proofs_tests.reference import flat, random_spd, spd_tensor


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


def test_adding_zero_adds_no_term():
    rng = np.random.default_rng(1)
    k = gm.KFAC(
        {"fc": (spd_tensor(rng, 3, dtype=torch.float64), spd_tensor(rng, 2, dtype=torch.float64))}
    )
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("delta", [1e-9, 1e-3, 0.37, 3.0])
def test_diagonal_plus_delta_equals_the_promoted_sum_bit_for_bit(dtype, delta):
    """D + δ·I (one pass for float32/float64) against the generic promotion to a full diagonal
    of δ; and 1·D, which copies nothing, equals D."""
    gen = torch.Generator().manual_seed(0)
    values = {"a": torch.rand(1000, generator=gen) * 1e-3, "b": torch.rand(3, 4, generator=gen)}
    d = gm.Diagonal({k: v.to(dtype) for k, v in values.items()})
    promoted = gm.Diagonal({k: torch.full_like(v, delta) for k, v in d.values.items()})
    reference = {k: v + promoted.values[k] for k, v in d.values.items()}
    for total in (d + delta, delta + d, d + gm.ScaledIdentity(delta)):
        assert isinstance(total, gm.Diagonal) and total.coarsest_dtype == dtype
        assert all(torch.equal(total.values[k], reference[k]) for k in reference)
    assert all(torch.equal((1.0 * d).values[k], d.values[k]) for k in d.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("scale", "delta"), [(1.0, 1e-3), (0.37, 0.25), (3.0, 0.0)])
def test_shifted_diagonal_is_the_eager_sum_in_every_operation(dtype, scale, delta, tmp_path):
    """``D.shifted(s, δ)`` (formed lazily, a prior δ·I + s·C) against ``D.scaled(s) + δ``: the
    same values bit for bit once formed, and the same mv, solve, sums, dtype moves, PSD check,
    coarsest dtype and file; δ = 0 and dtypes other than float32/float64 are formed at once."""
    gen = torch.Generator().manual_seed(1)
    values = {"a": torch.rand(1000, generator=gen), "b": torch.rand(3, 4, generator=gen) * 1e3}
    d = gm.Diagonal({k: v.to(dtype) for k, v in values.items()})
    eager = d.scaled(scale) + delta
    lazy = d.shifted(scale, delta)
    assert isinstance(lazy, gm.Diagonal)
    lazy_kept = delta != 0.0 and dtype != torch.bfloat16
    assert getattr(lazy, "formed", True) is not lazy_kept
    assert lazy.layout == eager.layout and lazy.coarsest_dtype == eager.coarsest_dtype == dtype
    v = {k: torch.randn(x.shape, generator=gen).to(dtype) for k, x in d.values.items()}
    for got, want in [
        (lazy.values, eager.values),
        (lazy.mv(v), eager.mv(v)),
        (lazy.solve(v), eager.solve(v)),
        ((lazy + d).values, (eager + d).values),
        ((lazy + 0.5).values, (eager + 0.5).values),
        (lazy.scaled(2.0).values, eager.scaled(2.0).values),
        (lazy.to(dtype=torch.float64).values, eager.to(dtype=torch.float64).values),
    ]:
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert lazy.to(dtype=torch.float64).coarsest_dtype == dtype
    if dtype != torch.bfloat16:  # safetensors round trip of the formed values
        loaded = gm.load_curvature(lazy.save(tmp_path / "h0.curvature.safetensors"))
        assert type(loaded) is gm.Diagonal
        assert all(torch.equal(loaded.values[k], eager.values[k]) for k in eager.values)


def test_shifted_diagonal_keeps_its_checks():
    """A negative value, NaN/Inf left unchecked by a lazily read file (``unchecked``), and the
    PSD check of the formed values, exactly as the eager sum reports them."""
    from gradmerge.curvature.diagonal import unchecked

    lazy = unchecked({"w": torch.tensor([1.0, float("nan")])}).shifted(2.0, 0.5)
    base, ft = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    with pytest.raises(gm.NonFiniteError, match=r"prior\['w'\]"):
        gm.gradient_matching(base, [ft], [gm.Diagonal({"w": torch.ones(2)})], prior=lazy)
    negative = gm.Diagonal({"w": torch.tensor([1.0, -3.0])}).shifted(1.0, 0.5)
    with pytest.raises(gm.NotPositiveDefiniteError, match="prior is not positive semi-definite"):
        negative.check_psd(name="prior")
    assert "0.5·I" in repr(negative)
