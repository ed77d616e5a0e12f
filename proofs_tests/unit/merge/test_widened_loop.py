"""The C loop on bfloat16 tensors (gradmerge.kernels.fused.merge_widened) against the float32 path.

It widens each bfloat16 to float32 in registers and rounds θ back to bfloat16 itself, so its
result must be, bit for bit, the float32 loop on the tensors ``.float()`` followed by torch's
``.to(torch.bfloat16)``, and the chunked torch pass (``kernel=None``) the same way: over random
bit patterns with subnormals, ±0 and values near the bfloat16 maximum, for every kind of curvature
(δ·I, a tensor, a lazily shifted one), over sizes that take the split and the streaming stores.
Every result it does not certify — a NaN/Inf input, h < 0, a finite float32 θ that rounds to
±Inf in bfloat16 — is ``None``, as the float32 loop's (or its rounding) is. Ties round to even.
"""

import pytest
import torch

import gradmerge as gm
from gradmerge.elementwise.matching import Affine
from gradmerge.kernels import fused, native

BF16 = torch.bfloat16
BF16_MAX = torch.finfo(BF16).max


def _bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(BF16)


def _random(g: torch.Generator, n: int, *, nonnegative: bool = False) -> torch.Tensor:
    """bfloat16 values of exponents 0..169 (subnormals, ±0 included), most near 1."""
    sign = torch.zeros(n, dtype=torch.int32) if nonnegative else torch.randint(2, (n,), generator=g)
    exponent = torch.randint(0, 170, (n,), generator=g)
    exponent = torch.where(torch.rand(n, generator=g) < 0.8, 127 + exponent % 9 - 4, exponent)
    mantissa = torch.randint(128, (n,), generator=g)
    x = _bits(((sign << 15) | (exponent << 7) | mantissa).tolist())
    x[:4] = _bits([0x0000, 0x8000, 0x0001, 0x007F if nonnegative else 0x807F])  # ±0, subnormals
    return x


def _widen(h):
    if isinstance(h, Affine):
        return Affine(h.values.float(), h.scale, h.delta, lambda: None)
    return h.float() if isinstance(h, torch.Tensor) else h


def _reference(base, fts, alphas, h):
    """The float32 loop on the widened tensors, rounded by torch; None where it is uncertified
    or the rounding overflows."""
    out = native.merge_tensor(
        base.float(), [f.float() for f in fts], alphas, [_widen(x) for x in h]
    )
    if out is None:
        return None
    rounded = out.to(BF16)
    return rounded if bool(torch.isfinite(rounded).all()) else None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == BF16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


# h_0, h_1.. as kinds: "d" δ·I, "h" a bfloat16 tensor, "a" a lazily shifted one (c·s + δ)
PATTERNS = ["dh", "dhhh", "hhd", "ahh", "dd"]
SIZES = [4097, (1 << 18) + 37, 3 * (1 << 18) + 5]  # one piece; streamed; split over threads


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("n", SIZES)
def test_bit_identical_to_the_float32_loop_and_its_rounding(pattern, n, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    g = torch.Generator().manual_seed(len(pattern) * n)
    tasks = len(pattern) - 1
    base = _random(g, n)
    fts = [_random(g, n) for _ in range(tasks)]
    alphas = [0.3 + 0.45 * t for t in range(tasks)]
    kinds = {"d": lambda: 1e-3, "h": lambda: _random(g, n, nonnegative=True)}
    kinds["a"] = lambda: Affine(_random(g, n, nonnegative=True), 2.0, 0.5, lambda: None)
    h = [kinds[p]() for p in pattern]
    out = fused.merge_widened(base, fts, alphas, h)
    ref = _reference(base, fts, alphas, h)
    assert ref is not None and out is not None
    assert _same_bits(out, ref)
    assert bool((out.view(torch.int16) & 0x7F80 == 0).any())  # subnormal or zero results too


def test_chunked_pass_rounded_is_the_same_bits():
    """Independent of the C loop: the chunked torch pass in float32, rounded by torch."""
    g = torch.Generator().manual_seed(7)
    n = 10_000
    base = _random(g, n).clamp(-1e4, 1e4)
    fts = [_random(g, n).clamp(-1e4, 1e4) for _ in range(2)]
    hs = [_random(g, n, nonnegative=True).clamp(max=1e4) for _ in range(2)]
    out = fused.merge_widened(base, fts, [0.6, 0.9], [1e-3, *hs])
    expected = gm.gradient_matching(
        {"w": base.float()},
        [{"w": f.float()} for f in fts],
        [gm.Diagonal({"w": h.float()}) for h in hs],
        prior=1e-3,
        alphas=[0.6, 0.9],
        kernel=None,
    )["w"].to(BF16)
    assert out is not None and _same_bits(out, expected)


@pytest.mark.parametrize(
    ("f1", "f2", "expected"),
    [  # θ = (f1 + f2)/2 exactly in float32, halfway between two bfloat16 neighbours
        (1.0, 1.0 + 2**-7, 1.0),  # between 1 (even) and 1 + 2^-7 (odd): down to the even one
        (1.0 + 2**-7, 1.0 + 2**-6, 1.0 + 2**-6),  # between odd and even: up to the even one
        (-1.0, -(1.0 + 2**-7), -1.0),
        (-(1.0 + 2**-7), -(1.0 + 2**-6), -(1.0 + 2**-6)),
    ],
)
def test_a_tie_rounds_to_even(f1, f2, expected):
    n = 4096
    base = torch.zeros(n, dtype=BF16)
    fts = [torch.full((n,), f, dtype=BF16) for f in (f1, f2)]
    ones = [torch.ones(n, dtype=BF16)] * 2
    out = fused.merge_widened(base, fts, [0.5, 0.5], [0.0, *ones])  # H̄ = 1: θ = (f1 + f2)/2
    wide = native.merge_tensor(base.float(), [f.float() for f in fts], [0.5, 0.5], [0.0, 1.0, 1.0])
    assert wide is not None and wide[0].item() == (f1 + f2) / 2  # the float32 tie itself
    assert out is not None and out.tolist() == [expected] * n
    assert _same_bits(out, wide.to(BF16))


@pytest.mark.parametrize(
    ("alpha", "written"),
    [  # θ = BF16_MAX + α·2^120 (exact in float32) on half the elements, BF16_MAX on the rest
        (-0.25, BF16_MAX),  # below the midpoint to 2^128: rounds down to the largest bfloat16
        (-0.5, None),  # the midpoint itself: the tie goes to the even neighbour, Inf: refused
        (-0.75, None),  # finite in float32, above the midpoint: Inf in bfloat16, refused
    ],
)
def test_a_finite_float32_result_that_rounds_to_inf_is_refused(alpha, written):
    n = 4096
    base = torch.full((n,), BF16_MAX, dtype=BF16)
    f = base.clone()
    f[n // 2 :] = BF16_MAX - 2.0**120  # τ = −2^120 there, 0 elsewhere
    out = fused.merge_widened(base, [f], [alpha], [1.0, 0.0])  # H̄ = 1: θ = θ_LLM + α·τ
    wide = native.merge_tensor(base.float(), [f.float()], [alpha], [1.0, 0.0])
    assert wide is not None and wide[-1].item() == BF16_MAX - alpha * 2.0**120  # finite
    if written is None:
        assert bool(torch.isinf(wide.to(BF16)[-1])) and out is None
    else:
        assert out is not None and out.tolist() == [written] * n
        assert _same_bits(out, wide.to(BF16))


@pytest.mark.parametrize("bad", [0x7FC0, 0x7F80, 0xFF80])  # NaN, +Inf, -Inf
@pytest.mark.parametrize("where", ["base", "finetuned", "curvature"])
def test_nan_and_inf_inputs_are_refused(bad, where):
    n = 4096
    base, f, h = (torch.ones(n, dtype=BF16) for _ in range(3))
    {"base": base, "finetuned": f, "curvature": h}[where][17] = _bits([bad])[0]
    assert fused.merge_widened(base, [f], [0.5], [1e-3, h]) is None
    assert _reference(base, [f], [0.5], [1e-3, h]) is None


def test_a_negative_curvature_is_refused():
    n = 4096
    h = torch.ones(n, dtype=BF16)
    h[5] = -1.0
    out = fused.merge_widened(
        torch.zeros(n, dtype=BF16), [torch.ones(n, dtype=BF16)], [1.0], [1.0, h]
    )
    assert out is None


def test_only_bfloat16_on_cpu_is_taken():
    x = torch.ones(4096)
    assert fused.merge_widened(x, [x], [1.0], [1.0, 1.0]) is None  # float32: the plain loop's
    y = torch.ones(4096, dtype=BF16)
    assert fused.merge_widened(y, [x.half()], [1.0], [1.0, 1.0]) is None  # mixed dtypes
