"""NaN/Inf in a diagonal curvature file is still named when the engine defers the check.

The streaming engine reads diagonal curvatures with ``restrict(..., check_finite=False)`` and
leaves the NaN/Inf check to where they are used (the diagonal merge's own pass; when a unit's
rule fails, the engine looks for the non-finite value and names it), which saves one read of
each value. Every path must still refuse a bad value, naming it, and write nothing; the public
loaders check at once.
"""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge.curvature.io import open_curvature
from gradmerge.jobs import MergeConfig, RemoveConfig, run_merge, run_remove
from proofs_tests.workspace import make_workspace


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("diag"), "diag")


@pytest.fixture(scope="module", params=[float("nan"), float("inf")], ids=["nan", "inf"])
def bad_curvature(ws, request):
    """Curvature file 0 with one non-finite value in '2.weight' (same header, same metadata)."""
    with safe_open(str(ws.curvatures[0]), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(ws.curvatures[0])
    (key,) = [k for k in tensors if k.endswith("2.weight")]
    tensors[key].view(-1)[3] = request.param
    path = ws.root / f"bad-{request.param}.curvature.safetensors"
    save_file(tensors, path, metadata=metadata)
    return path


def _nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("method", ["gradient_matching", "fisher_average"])
@pytest.mark.parametrize("fused", ["on", "off"])
def test_merges_name_the_bad_curvature(ws, bad_curvature, tmp_path, method, fused):
    models = [
        {"model": str(ws.models[0]), "curvature": str(bad_curvature)},
        {"model": str(ws.models[1]), "curvature": str(ws.curvatures[1])},
    ]
    spec = {"method": method, "base_model": str(ws.base), "models": models}
    if method == "gradient_matching":
        spec["prior"] = {"delta": 1e-2}
    out = tmp_path / "out"
    with (
        gm.fused_kernels(fused),
        pytest.raises(gm.NonFiniteError, match=r"curvatures\[0\]\['2.weight'\].*while computing"),
    ):
        run_merge(MergeConfig.from_dict(spec), out, progress=False)
    _nothing_written(out)


def test_removal_names_the_bad_curvature(ws, bad_curvature, tmp_path):
    config = RemoveConfig.from_dict(
        {
            "method": "remove",
            "base_model": str(ws.base),
            "model": str(ws.models[0]),
            "curvature": str(bad_curvature),
            "prior": {"delta": 1e-2},
            "remaining": {"delta": 1.0, "curvature": str(ws.base_curvature)},
        }
    )
    out = tmp_path / "out"
    with pytest.raises(gm.NonFiniteError, match=r"curvature\['2.weight'\]"):
        run_remove(config, out, progress=False)
    _nothing_written(out)


def test_public_readers_check_at_once(bad_curvature):
    with pytest.raises(gm.NonFiniteError, match=r"2\.weight"):
        gm.load_curvature(bad_curvature)
    with open_curvature(bad_curvature) as f, pytest.raises(gm.NonFiniteError, match=r"2\.weight"):
        f.restrict(["2.weight", "2.bias"])


def test_the_engine_finds_a_bad_value_through_the_algebra(bad_curvature):
    """Whatever the algebra made of unchecked values (scaled, shifted, summed, cast, in blocks
    with a K-FAC part), the engine's search after a failed unit names the input it came from;
    checked values are left alone."""
    from gradmerge.jobs.opening import _raise_non_finite

    with open_curvature(bad_curvature) as f:
        lazy = f.restrict(["2.weight", "2.bias"], check_finite=False)
    kfac = gm.KFAC({"fc": (torch.eye(2), torch.eye(2))})
    derived = (
        lazy.scaled(2.0),
        lazy + 1.0,
        lazy + lazy,
        lazy.to(dtype=torch.float64),
        lazy.shifted(0.5, 1e-3),
        gm.Blocks([kfac, lazy]),
    )
    cause = gm.NotPositiveDefiniteError("the rule's own error")
    for curvature in derived:
        with pytest.raises(gm.NonFiniteError, match=r"curvatures\[1\]\['2\.weight'\]") as e:
            _raise_non_finite({"curvatures[0]": 0.1, "curvatures[1]": curvature}, cause)
        assert e.value.__cause__ is cause
    good = gm.Diagonal({"w": torch.ones(3)})
    _raise_non_finite({"prior": good, "curvatures[0]": None}, cause)  # nothing to name
