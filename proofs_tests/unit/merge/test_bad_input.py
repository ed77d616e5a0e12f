"""Every rule rejects bad input with a typed error that says what came and how to fix it."""

import pytest
import torch

import gradmerge as gm

BASE = {"a.weight": torch.zeros(2, 2), "a.bias": torch.zeros(2)}
FT = {"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2)}
H = gm.Diagonal({"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2)})


def test_mismatched_keys_are_named():
    ft = {"a.weight": torch.ones(2, 2), "b.bias": torch.ones(2)}
    with pytest.raises(gm.StructureError, match=r"finetuned\[0\].*'a.bias'.*'b.bias'"):
        gm.gradient_matching(BASE, [ft], [H], prior=1.0)


def test_mismatched_shapes_are_named():
    ft = {"a.weight": torch.ones(2, 3), "a.bias": torch.ones(2)}
    with pytest.raises(gm.StructureError, match=r"finetuned\[0\]\['a.weight'\] has shape \(2, 3\)"):
        gm.task_arithmetic(BASE, [ft])


def test_curvature_over_other_parameters():
    h = gm.Diagonal({"a.weight": torch.ones(2, 2)})
    with pytest.raises(gm.StructureError, match=r"curvatures\[0\].*missing.*'a.bias'"):
        gm.gradient_matching(BASE, [FT], [h], prior=1.0)


def test_wrong_number_of_alphas_and_curvatures():
    with pytest.raises(gm.ArgumentError, match="got 2 alphas for 1 fine-tuned"):
        gm.gradient_matching(BASE, [FT], [H], prior=1.0, alphas=[1.0, 2.0])
    with pytest.raises(gm.ArgumentError, match="1 fine-tuned models but 2 curvatures"):
        gm.gradient_matching(BASE, [FT], [H, H], prior=1.0)
    with pytest.raises(gm.ArgumentError, match="at least one"):
        gm.task_arithmetic(BASE, [])
    with pytest.raises(gm.ArgumentError, match="finite"):
        gm.task_arithmetic(BASE, [FT], alphas=float("nan"))


def test_nan_and_inf_inputs():
    bad = {"a.weight": torch.full((2, 2), float("nan")), "a.bias": torch.ones(2)}
    with pytest.raises(gm.NonFiniteError, match=r"finetuned\[0\]\['a.weight'\]"):
        gm.gradient_matching(BASE, [bad], [H], prior=1.0)
    with pytest.raises(gm.NonFiniteError, match="Diagonal values"):
        gm.Diagonal({"w": torch.tensor([float("inf")])})
    with pytest.raises(gm.NonFiniteError, match="δ"):
        gm.ScaledIdentity(float("inf"))


def test_singular_merged_precision_suggests_damping():
    zero = gm.Diagonal({"a.weight": torch.zeros(2, 2), "a.bias": torch.zeros(2)})
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"δ > 0"):
        gm.gradient_matching(BASE, [FT], [zero], prior=0.0)
    with pytest.raises(gm.NotPositiveDefiniteError):
        gm.fisher_average([FT], [zero])


def test_non_psd_curvature_is_rejected_by_name():
    neg = gm.Diagonal({"a.weight": -torch.ones(2, 2), "a.bias": torch.ones(2)})
    with pytest.raises(gm.NotPositiveDefiniteError, match=r"curvatures\[0\] is not positive semi"):
        gm.gradient_matching(BASE, [FT], [neg], prior=1.0)
    with pytest.raises(gm.NotPositiveDefiniteError, match="remaining is not positive semi"):
        gm.remove(BASE, FT, H, remaining=-1.0, prior=1.0)


def test_wrong_dtype_and_device():
    ft64 = {k: v.double() for k, v in FT.items()}
    with pytest.raises(gm.DTypeError, match=r"finetuned\[0\]\['a.weight'\] is torch.float64"):
        gm.gradient_matching(BASE, [ft64], [H], prior=1.0)
    with pytest.raises(gm.DTypeError, match="curvatures"):
        gm.gradient_matching(BASE, [FT], [H.to(dtype=torch.float64)], prior=1.0)
    with pytest.raises(gm.DeviceError, match="move every input"):
        gm.gradient_matching(BASE, [FT], [H.to("meta")], prior=1.0)


def test_wrong_types():
    with pytest.raises(TypeError, match="prior must be a curvature"):
        gm.gradient_matching(BASE, [FT], [H], prior="1e-3")
    with pytest.raises(TypeError, match="dict of tensors"):
        gm.task_arithmetic([1, 2], [FT])


def test_influence_remove_gradient_mismatch():
    with pytest.raises(gm.StructureError, match="gradient"):
        gm.influence_remove(BASE, {"a.weight": torch.ones(2, 2)}, remaining=1.0)


def test_gradient_mismatch_checks_gradient_functions():
    bad_grad = lambda p: {"a.weight": torch.ones(2, 2)}  # noqa: E731 - misses a.bias
    with pytest.raises(gm.StructureError, match=r"gradients\[0\]"):
        gm.gradient_mismatch(BASE, [FT], [bad_grad])
    with pytest.raises(gm.ArgumentError, match="gradient functions"):
        gm.gradient_mismatch(BASE, [FT], [])
