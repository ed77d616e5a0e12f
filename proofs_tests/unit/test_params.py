"""Parameter-dict algebra: flatten/unflatten, structure checks, fused updates."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradmerge as gm
from gradmerge import params as P
from proofs_tests.reference import random_layout


@given(st.integers(0, 2**32 - 1))
def test_flatten_unflatten_round_trip(seed):
    params = random_layout(np.random.default_rng(seed))
    vec = P.flatten(params)
    assert vec.numel() == P.numel(params) == sum(v.numel() for v in params.values())
    back = P.unflatten(vec, P.layout_of(params))
    assert list(back) == list(params)
    for k in params:
        assert torch.equal(back[k], params[k])
    # flatten concatenates row-major reshapes in key order
    ref = np.concatenate([v.numpy().reshape(-1) for v in params.values()])
    np.testing.assert_array_equal(vec.numpy(), ref)


def test_flatten_follows_layout_not_insertion_order():
    a = {"x": torch.tensor([1.0]), "y": torch.tensor([2.0, 3.0])}
    b = {"y": a["y"], "x": a["x"]}
    assert torch.equal(P.flatten(b, P.layout_of(a)), torch.tensor([1.0, 2.0, 3.0]))


def test_algebra_matches_numpy():
    rng = np.random.default_rng(0)
    a, b = random_layout(rng), None
    b = {k: torch.as_tensor(rng.standard_normal(v.shape)) for k, v in a.items()}
    fa, fb = P.flatten(a).numpy(), P.flatten(b).numpy()
    np.testing.assert_allclose(P.flatten(P.axpy(-0.5, a, b)).numpy(), fb - 0.5 * fa)
    np.testing.assert_allclose(P.flatten(P.sub(a, b)).numpy(), fa - fb)
    np.testing.assert_allclose(float(P.dot(a, b)), fa @ fb)
    np.testing.assert_allclose(P.norm(a), np.linalg.norm(fa))
    np.testing.assert_allclose(
        P.relative_distance(a, b), np.linalg.norm(fa - fb) / np.linalg.norm(fb)
    )


def test_check_compatible_names_missing_and_extra_keys():
    base = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(gm.StructureError, match=r"missing 1 key.*'b'.*1 key\(s\) not in base.*'c'"):
        P.check_compatible(
            base, {"a": torch.zeros(2), "c": torch.zeros(2)}, ref_name="base", name="ft"
        )


def test_check_compatible_names_shape_dtype_device():
    base = {"a": torch.zeros(2, 3)}
    with pytest.raises(gm.StructureError, match=r"ft\['a'\] has shape \(3, 2\).*\(2, 3\)"):
        P.check_compatible(base, {"a": torch.zeros(3, 2)}, ref_name="base", name="ft")
    with pytest.raises(gm.DTypeError, match=r"float64.*float32"):
        P.check_compatible(
            base, {"a": torch.zeros(2, 3, dtype=torch.float64)}, ref_name="base", name="ft"
        )
    with pytest.raises(gm.DeviceError):
        P.check_compatible(
            base, {"a": torch.zeros(2, 3, device="meta")}, ref_name="base", name="ft"
        )


def test_check_params_rejects_bad_tensors():
    with pytest.raises(gm.NonFiniteError, match=r"x\['w'\] holds 1 NaN/Inf"):
        P.check_params({"w": torch.tensor([1.0, float("nan")])}, name="x")
    with pytest.raises(gm.NonFiniteError):
        P.check_params({"w": torch.tensor([float("inf")])}, name="x")
    with pytest.raises(gm.DTypeError, match="floating-point"):
        P.check_params({"step": torch.tensor([1])}, name="x")
    with pytest.raises(gm.DTypeError, match="mixes dtypes"):
        P.check_params({"a": torch.zeros(1), "b": torch.zeros(1, dtype=torch.float64)}, name="x")
    with pytest.raises(gm.StructureError, match="empty"):
        P.check_params({}, name="x")
    with pytest.raises(TypeError, match="dict of tensors"):
        P.check_params([torch.zeros(1)], name="x")
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        P.check_params({"w": np.zeros(1)}, name="x")


def test_unflatten_rejects_wrong_size():
    with pytest.raises(gm.StructureError, match="cannot unflatten"):
        P.unflatten(torch.zeros(5), P.layout_of({"w": torch.zeros(2, 2)}))


def test_finite_check_fast_path_still_names_nan_and_inf_and_accepts_overflowing_sums():
    big = torch.full((4,), torch.finfo(torch.float16).max, dtype=torch.float16)  # sum overflows
    gm.params.check_params({"w": big}, name="x")  # finite values: accepted
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(gm.NonFiniteError, match=r"x\['w'\] holds 1 NaN/Inf"):
            gm.params.check_params({"w": torch.tensor([1.0, bad, 2.0])}, name="x")
