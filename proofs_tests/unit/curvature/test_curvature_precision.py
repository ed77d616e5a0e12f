"""A curvature is judged PSD at the coarsest precision its values have passed through.

A curvature estimated in float32 is PSD only up to round-off: rounding its entries moves its
eigenvalues by up to ‖E‖₂ ≤ ‖E‖_F ≤ (ε₃₂/2)‖C‖_F (Weyl), so a PSD matrix with zero eigenvalues
comes out with eigenvalues of about −ε₃₂‖C‖. ``check_psd`` accepts eigenvalues down to
−100·ε·‖C‖; casting to float64 must not switch ε to ε₆₄ (which would refuse them), while a
curvature BORN in float64 keeps ε₆₄, and a genuinely indefinite one (−1e-2·‖C‖) is refused at
any precision.
"""

import numpy as np
import pytest
import torch

import gradmerge as gm
from gradmerge.curvature.base import coarsest_dtype
from gradmerge.curvature.io import open_curvature

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
N, RANK = 12, 5  # a Gram of 5 examples in 12 dimensions: 7 exact zero eigenvalues


def rounded_gram(seed: int = 0) -> torch.Tensor:
    """XᵀX of a rank-5 X, formed in float64 (PSD to ε₆₄), then rounded to float32."""
    rng = np.random.default_rng(seed)
    x = torch.as_tensor(rng.standard_normal((RANK, N)))
    return (x.T @ x).to(torch.float32)


def exact_min_eig(m: torch.Tensor) -> float:
    """λ_min of the matrix's values, computed in float64 (exact to ~ε₆₄‖m‖)."""
    return float(torch.linalg.eigvalsh(m.double())[0])


@pytest.fixture(scope="module")
def gram32() -> torch.Tensor:
    g = rounded_gram()
    scale = float(g.abs().max())
    lam = exact_min_eig(g)
    # the premise: a round-off eigenvalue that float32's tolerance accepts and float64's refuses
    # (Weyl: |λ| ≤ (ε₃₂/2)‖G‖_F)
    frobenius = float(torch.linalg.matrix_norm(g.double()))
    assert -EPS32 / 2 * frobenius <= lam < -100 * EPS64 * scale, lam
    assert lam > -100 * EPS32 * scale
    return g


def indefinite(g: torch.Tensor) -> torch.Tensor:
    """``g`` with a clearly negative eigenvalue, −1e-2·‖g‖₂, along a direction of its null space."""
    lam, q = torch.linalg.eigh(g.double())
    v = q[:, 0]
    bad = g.double() - 1e-2 * float(lam[-1]) * torch.outer(v, v)
    assert exact_min_eig(bad) < -0.9e-2 * float(lam[-1])
    return bad.to(g.dtype)


def dense(m: torch.Tensor) -> gm.Dense:
    return gm.Dense(m, {"w": torch.zeros(m.shape[0], dtype=m.dtype)})


def kfac(a: torch.Tensor) -> gm.KFAC:
    """A ⊗ G for a layer with weight (2, N), G a fixed SPD 2×2 in A's dtype."""
    g = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=a.dtype)
    return gm.KFAC({"fc": (a, g)})


@pytest.mark.parametrize("build", [dense, kfac], ids=["Dense", "KFAC"])
def test_float32_round_off_passes_before_and_after_a_cast_to_float64(gram32, build):
    c32 = build(gram32)
    c32.check_psd(name="C")
    c64 = c32.to(dtype=torch.float64)
    assert c64._dtype_device()[0] == torch.float64
    assert c64.coarsest_dtype == torch.float32
    c64.check_psd(name="C")  # failed before: judged with 100·ε₆₄
    # and the same values born in float64 are judged at float64's precision
    with pytest.raises(gm.NotPositiveDefiniteError, match="not positive semi-definite"):
        build(gram32.double()).check_psd(name="C")


@pytest.mark.parametrize("build", [dense, kfac], ids=["Dense", "KFAC"])
def test_genuinely_indefinite_is_refused_at_every_precision(gram32, build):
    bad = build(indefinite(gram32))
    for c in (bad, bad.to(dtype=torch.float64)):
        with pytest.raises(gm.NotPositiveDefiniteError, match=r"C is not positive semi-definite"):
            c.check_psd(name="C")


def test_float64_born_keeps_float64_tolerance():
    # a negative eigenvalue of −1e-9·‖C‖: round-off for float32, a real one for float64
    d = torch.diag(torch.tensor([1.0, 0.5, -1e-9], dtype=torch.float64))
    born64 = dense(d)
    assert born64.coarsest_dtype == torch.float64
    with pytest.raises(gm.NotPositiveDefiniteError):
        born64.check_psd(name="C")
    born64.to(dtype=torch.float32).check_psd(name="C")  # float32 cannot tell it from zero
    with pytest.raises(gm.NotPositiveDefiniteError):  # float64 → float64 keeps its precision
        born64.scaled(2.0).to(dtype=torch.float64).check_psd(name="C")


def test_the_record_is_carried_by_every_derivation(gram32):
    k64 = kfac(gram32).to(dtype=torch.float64)
    d32 = gm.Diagonal({"norm.weight": torch.tensor([1.0, 2.0])})
    d64 = d32.to(dtype=torch.float64)  # Diagonal is not edited: the base class carries it
    assert d64.coarsest_dtype == torch.float32
    born64 = gm.Diagonal({"norm.weight": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    assert born64.coarsest_dtype == torch.float64
    assert (born64 + d64).coarsest_dtype == torch.float32  # sums: the coarsest term
    assert (born64 + 1.0).coarsest_dtype == torch.float64
    assert gm.ScaledIdentity(2.0).coarsest_dtype is None
    assert (3.0 * k64).coarsest_dtype == torch.float32  # scaled
    assert (k64 + 1e-3).coarsest_dtype == torch.float32
    assert k64.to(dtype=torch.float32).to(dtype=torch.float64).coarsest_dtype == torch.float32
    blocks = gm.Blocks([k64, born64])  # composites: the coarsest of their parts
    assert blocks.coarsest_dtype == torch.float32
    assert (blocks + blocks).coarsest_dtype == torch.float32
    assert (blocks + 0.5).coarsest_dtype == torch.float32
    diag_fc = gm.Diagonal({"fc.weight": torch.ones(2, N, dtype=torch.float64)})
    lazy = k64 + diag_fc  # K-FAC + diagonal: a lazy Sum
    assert isinstance(lazy, gm.Sum)
    assert lazy.coarsest_dtype == torch.float32
    assert lazy.to(dtype=torch.float64).coarsest_dtype == torch.float32
    half = gm.Diagonal({"w": torch.ones(2, dtype=torch.bfloat16)})
    assert half.to(dtype=torch.float64).coarsest_dtype == torch.bfloat16
    assert coarsest_dtype(torch.float16, torch.bfloat16, None) == torch.bfloat16


def test_composites_pass_the_psd_check_after_a_cast(gram32):
    k64 = kfac(gram32).to(dtype=torch.float64)
    norm = gm.Diagonal({"norm.weight": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    gm.Blocks([k64, norm]).check_psd(name="C")
    (k64 + gm.Diagonal({"fc.weight": torch.zeros(2, N, dtype=torch.float64)})).check_psd(name="C")
    born64 = gm.Blocks([kfac(gram32.double()), norm])
    with pytest.raises(gm.NotPositiveDefiniteError):
        born64.check_psd(name="C")


def test_dense_cast_keeps_a_matrix_symmetric_to_float32_precision():
    m = rounded_gram(1)
    m[0, 1] = torch.nextafter(m[0, 1], torch.tensor(np.inf, dtype=torch.float32))  # one ulp
    asym, scale = float((m - m.T).abs().max()), float(m.abs().max())
    assert 1e3 * EPS64 * scale < asym <= 1e3 * EPS32 * scale
    c64 = dense(m).to(dtype=torch.float64)  # refused as "not symmetric" before
    torch.testing.assert_close(c64.matrix, m.double(), rtol=0, atol=0)
    with pytest.raises(gm.NonFiniteError):  # a narrowing cast that overflows is still caught
        dense(torch.diag(torch.tensor([1e300, 1.0], dtype=torch.float64))).to(dtype=torch.float32)


def test_merge_with_a_float32_estimate_cast_to_float64(gram32):
    """End to end: Eq. 6 with a float32 Fisher cast to float64 (it used to be refused)."""
    like = {"w": torch.zeros(N, dtype=torch.float64)}
    h = dense(gram32).to(dtype=torch.float64)
    base, ft = like, {"w": torch.linspace(-1.0, 1.0, N, dtype=torch.float64)}
    got = gm.gradient_matching(base, [ft], [h], prior=1.0)["w"]
    # H̄ = I + H and H_0 + H_1 = H̄: one task at α = 1 recovers θ_1 (up to ε₆₄·κ(H̄))
    torch.testing.assert_close(got, ft["w"], rtol=0, atol=1e-12)


def test_a_loaded_float32_file_cast_on_load_keeps_its_precision(gram32, tmp_path):
    path = dense(gram32).save(tmp_path / "c.safetensors")
    loaded = open_curvature(path).load(dtype=torch.float64)
    assert loaded._dtype_device()[0] == torch.float64
    assert loaded.coarsest_dtype == torch.float32
    loaded.check_psd(name="C")


def test_diagonal_merge_judges_a_cast_float32_diagonal_at_float32():
    """The elementwise Eq. 6 path checks negative values at the curvature's coarsest precision:
    a float32 diagonal with a round-off value −1e-9·‖h‖ passes after a cast to float64; the same
    values born in float64 are refused (100·ε₆₄ < 1e-9)."""
    values = torch.tensor([2.0, 1.0, -2e-9], dtype=torch.float64)
    base = {"w": torch.zeros(3, dtype=torch.float64)}
    ft = {"w": torch.ones(3, dtype=torch.float64)}
    cast = gm.Diagonal({"w": values.float()}).to(dtype=torch.float64)
    merged = gm.gradient_matching(base, [ft], [cast], prior=1.0)["w"]
    torch.testing.assert_close(merged, ft["w"], rtol=0, atol=1e-12)  # one task, α = 1: θ_1
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"curvatures\[0\]"):
        gm.gradient_matching(base, [ft], [gm.Diagonal({"w": values})], prior=1.0)
