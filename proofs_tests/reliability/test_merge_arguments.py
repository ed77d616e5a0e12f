"""Issue 13, cases 3, 9, 10 and 12: arguments of the merge and removal rules.

Each case reproduces a defect of an adversarial pass (the test failed before its fix): a removal
that returned Inf/NaN, a subnormal δ rounding a merge to integers, tensors that require grad, a
negative prior accepted, and error hints that pointed the wrong way.
"""

import math

import pytest
import torch

import gradmerge as gm

BASE = {"w": torch.tensor([1.0, 2.0])}
FT = {"w": torch.tensor([2.0, 3.0])}
H = gm.Diagonal({"w": torch.tensor([1.0, 1.0])})


# ----- case 3: removal never returns Inf/NaN; a subnormal δ is refused ---------------------------
@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf, 1e300])
def test_case3_remove_refuses_a_non_finite_or_unrepresentable_alpha(alpha):
    with pytest.raises(gm.ArgumentError, match=r"alpha must be finite.*largest float32"):
        gm.remove(BASE, FT, H, remaining=4.0, prior=1.0, alpha=alpha)
    with pytest.raises(gm.ArgumentError, match="alpha must be finite"):
        gm.influence_remove(BASE, FT, remaining=4.0, alpha=alpha)


@pytest.mark.parametrize("delta", [1e-45, 1e-39])
def test_case3_subnormal_remaining_is_refused(delta):
    with pytest.raises(gm.ArgumentError, match=r"remaining = .* below the smallest normal float32"):
        gm.remove(BASE, FT, H, remaining=delta, prior=1.0)
    with pytest.raises(gm.ArgumentError, match=r"remaining = .* below the smallest normal"):
        gm.influence_remove(BASE, FT, remaining=delta)


def test_case3_subnormal_prior_is_refused_not_rounded():
    # zero curvatures and δ = 1e-45 (a float32 subnormal with one significant bit): Eq. 6 is
    # θ_1 exactly, but the subnormal arithmetic returned [1, 3] for [1.3, 2.6]
    zero = gm.Diagonal({"w": torch.zeros(2)})
    ft = {"w": torch.tensor([1.3, 2.6])}
    with pytest.raises(gm.ArgumentError, match="prior = 1e-45 is below the smallest normal"):
        gm.gradient_matching(BASE, [ft], [zero], prior=1e-45)
    # the smallest normal δ computes correctly (the bound the message gives is usable)
    tiny = torch.finfo(torch.float32).tiny
    got = gm.gradient_matching(BASE, [ft], [zero], prior=tiny)
    torch.testing.assert_close(got["w"], ft["w"], rtol=0, atol=0)
    # float64 parameters resolve 1e-45 exactly
    ft64 = {"w": ft["w"].double()}
    base64 = {"w": BASE["w"].double()}
    got64 = gm.gradient_matching(base64, [ft64], [zero.to(dtype=torch.float64)], prior=1e-45)
    torch.testing.assert_close(got64["w"], ft64["w"], rtol=1e-15, atol=0)


def test_case3_removal_overflow_is_a_typed_error():
    # δ = 1e-37 is normal, but α (H_0 + H_t)τ/δ = 30 · 2 · 1/1e-37 = 6e38 exceeds float32
    big = {"w": torch.tensor([1.0, 2.0]) + 1e0}
    with pytest.raises(gm.ResultOverflowError, match="removal result 'w' overflowed float32"):
        gm.remove(BASE, big, H, remaining=1e-37, prior=1.0, alpha=3e1)
    with pytest.raises(gm.ResultOverflowError, match="larger `remaining` δ"):
        gm.influence_remove(BASE, {"w": torch.tensor([3e38, 3e38])}, remaining=1.0, alpha=2.0)
    # the same inputs in float64 are finite and equal Eq. 13 computed by hand
    base64, big64 = {"w": BASE["w"].double()}, {"w": big["w"].double()}
    got = gm.remove(base64, big64, H.to(dtype=torch.float64), remaining=1e-37, prior=1.0, alpha=30)
    expected = base64["w"] - 30 * (2 * (big64["w"] - base64["w"])) / 1e-37
    torch.testing.assert_close(got["w"], expected, rtol=1e-15, atol=0)


def test_case3_generic_merge_overflow_is_a_typed_error():
    k = gm.KFAC({"fc": (torch.eye(2), torch.eye(1))})
    base, ft = {"fc.weight": torch.zeros(1, 2)}, {"fc.weight": torch.full((1, 2), 3e38)}
    with pytest.raises(gm.ResultOverflowError, match=r"merged 'fc.weight' overflowed float32"):
        gm.gradient_matching(base, [ft, ft], [k, k], prior=1.0, alphas=1.0)


# ----- case 9: tensors that require grad ---------------------------------------------------------
def test_case9_parameters_that_require_grad_are_accepted():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    plain_a = {k: v.detach().clone() for k, v in pa.items()}
    plain_b = {k: v.detach().clone() for k, v in pb.items()}
    got = gm.task_arithmetic(pa, [pb], alphas=0.5)
    for k, v in gm.task_arithmetic(plain_a, [plain_b], alphas=0.5).items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
        assert not got[k].requires_grad
    hs = [gm.Diagonal({k: torch.ones_like(v) for k, v in plain_a.items()})]
    got = gm.gradient_matching(pa, [pb], hs, prior=0.5)
    for k, v in gm.gradient_matching(plain_a, [plain_b], hs, prior=0.5).items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    got = gm.remove(pa, pb, hs[0], remaining=2.0, prior=0.5)
    for k, v in gm.remove(plain_a, plain_b, hs[0], remaining=2.0, prior=0.5).items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
        assert not got[k].requires_grad


# ----- case 10: a negative prior precision ------------------------------------------------------
@pytest.mark.parametrize("prior", [-1.0, -1e-6])
def test_case10_negative_prior_is_refused(prior):
    big = gm.Diagonal({"w": torch.tensor([5.0, 5.0])})  # H̄ = prior + 5 stays positive
    with pytest.raises(gm.NotPositiveDefiniteError, match="negative precision"):
        gm.gradient_matching(BASE, [FT], [big], prior=prior)
    with pytest.raises(gm.NotPositiveDefiniteError, match="negative precision"):
        gm.remove(BASE, FT, big, remaining=1.0, prior=prior)


# ----- case 12: hints that point the right way --------------------------------------------------
def test_case12_negative_alpha_error_names_the_alpha():
    with pytest.raises(gm.NotPositiveDefiniteError) as info:
        gm.gradient_matching(
            BASE, [FT], [gm.Diagonal({"w": torch.tensor([4.0, 4.0])})], prior=1.0, alphas=-1.0
        )
    text = str(info.value)
    assert "alphas[0] = -1 < 0 subtracts" in text and "Add damping" not in text


def test_case12_kfac_singular_hint_suggests_a_delta_that_works():
    # A has eigenvalues 1e4 and 1e-3: λ_min 1e-3 lies below the system's round-off floor
    # (2·10·ε·1e4 ≈ 2.4e-2), so δ = 1e-6 (the old hint) cannot help; the suggested δ does
    a = torch.diag(torch.tensor([1e4, 1e-3]))
    k = gm.KFAC({"fc": (a, torch.eye(1))})
    base, ft = {"fc.weight": torch.zeros(1, 2)}, {"fc.weight": torch.ones(1, 2)}
    with pytest.raises(gm.NotPositiveDefiniteError) as info:
        gm.gradient_matching(base, [ft], [k], prior=0.0)
    delta = info.value.suggested_delta
    assert delta is not None and f"δ ≥ {delta:.1e}" in str(info.value)
    assert "prior=1e-6" not in str(info.value)
    with pytest.raises(gm.NotPositiveDefiniteError):
        gm.gradient_matching(base, [ft], [k], prior=1e-6)
    got = gm.gradient_matching(base, [ft], [k], prior=delta)
    # dense reference: (δI + A)⁻¹ (δI + A) τ = τ
    torch.testing.assert_close(got["fc.weight"], ft["fc.weight"], rtol=1e-4, atol=0)


def test_case12_task_arithmetic_without_models_names_itself():
    with pytest.raises(gm.ArgumentError, match=r"^task_arithmetic needs at least one"):
        gm.task_arithmetic(BASE, [])


@pytest.mark.parametrize("alphas", ["2", ["2"], [True], [None]])
def test_case12_non_numeric_alphas_are_refused(alphas):
    with pytest.raises(gm.ArgumentError, match="alphas must be numbers"):
        gm.gradient_matching(BASE, [FT], [H], prior=1.0, alphas=alphas)
    with pytest.raises(gm.ArgumentError, match="alphas must be numbers"):
        gm.task_arithmetic(BASE, [FT], alphas=alphas)


def test_case12_numeric_alphas_of_other_types_still_work():
    np = pytest.importorskip("numpy")
    ref = gm.task_arithmetic(BASE, [FT, FT], alphas=[0.25, 0.5])
    for alphas in (torch.tensor([0.25, 0.5]), np.array([0.25, 0.5]), (0.25, 0.5), [0.25, 1 / 2]):
        got = gm.task_arithmetic(BASE, [FT, FT], alphas=alphas)
        torch.testing.assert_close(got["w"], ref["w"], rtol=0, atol=0)
