"""Issue 13, cases 3 and 12 through `gradmerge merge` / `gradmerge remove`: a typed one-line error
(exit 1, no output folder) where a removal wrote Inf or raised a raw RuntimeError, and hints that
name the YAML keys that fix the problem."""

import pytest
import torch
import yaml
from safetensors.torch import save_file

from gradmerge import cli
from proofs_tests.workspace import make_workspace


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("reliability-cli"), "diag")


def _remove(ws, **changes):
    config = {
        "method": "remove",
        "base_model": "base.safetensors",
        "model": "ft0.safetensors",
        "curvature": "ft0.curvature.safetensors",
        "prior": {"delta": 1.0e-2},
        "remaining": {"delta": 1.0e-1},
    }
    config.update(changes)
    return str(ws.yaml("remove.yaml", config))


def _merge(ws, **changes):
    return str(ws.yaml("merge.yaml", ws.merge_dict(**changes)))


def _fails(argv, capsys):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("delta", [1.0e-39, 1.0e-45])
def test_case3_remove_with_subnormal_remaining_delta_fails_cleanly(ws, tmp_path, capsys, delta):
    out = tmp_path / "removed"
    err = _fails(
        ["remove", _remove(ws, remaining={"delta": delta}), str(out), "--no-progress"], capsys
    )
    assert "below the smallest normal float32" in err
    assert not out.exists()


def test_case3_remove_with_huge_alpha_is_a_typed_error(ws, tmp_path, capsys):
    out = tmp_path / "removed"
    err = _fails(["remove", _remove(ws, alpha=1.0e300), str(out), "--no-progress"], capsys)
    assert "alpha must be finite numbers of magnitude ≤ 3.403e+38" in err
    assert not out.exists()


def test_case3_removal_overflow_names_the_yaml_fixes(ws, tmp_path, capsys):
    out = tmp_path / "removed"
    argv = [
        "remove",
        _remove(ws, alpha=1.0e38, remaining={"delta": 1.0e-30}),
        str(out),
        "--no-progress",
    ]
    err = _fails(argv, capsys)
    assert "overflowed float32" in err and "`compute_dtype: float64`" in err
    assert not out.exists()


def test_case12_huge_alpha_does_not_suggest_the_dtype_already_used(ws, tmp_path, capsys):
    out = tmp_path / "merged"
    config = _merge(
        ws,
        models=[
            {"model": "ft0.safetensors", "curvature": "ft0.curvature.safetensors", "alpha": 1.0e308}
        ],
    )
    err = _fails(["merge", config, str(out), "--no-progress"], capsys)
    assert "merge in float32" not in err and "magnitude ≤ 3.403e+38" in err


def test_case12_output_overflow_suggests_a_wider_output_dtype(ws, tmp_path, capsys):
    # computed in float64 the merge is finite, but it exceeds float32, the output dtype
    config = {
        "method": "task_arithmetic",
        "base_model": "base.safetensors",
        "models": [{"model": "ft0.safetensors"}],
        "compute_dtype": "float64",
        "scale": 1.0e40,
    }
    out = tmp_path / "merged"
    err = _fails(["merge", str(ws.yaml("ta.yaml", config)), str(out), "--no-progress"], capsys)
    assert "output dtype float32" in err and "`dtype: float64`" in err
    assert "float32 or bfloat16" not in err


def test_case12_negative_alpha_hint_names_the_alpha_key(ws, tmp_path, capsys):
    models = [
        {"model": "ft0.safetensors", "curvature": "ft0.curvature.safetensors", "alpha": 1.0},
        {"model": "ft1.safetensors", "curvature": "ft1.curvature.safetensors", "alpha": -50.0},
    ]
    err = _fails(["merge", _merge(ws, models=models), str(tmp_path / "m"), "--no-progress"], capsys)
    assert "models[1].alpha (times `scale`) is negative" in err


def test_case12_kfac_singular_hint_gives_a_delta_above_the_floor(tmp_path, capsys):
    from gradmerge.curvature import KFAC

    a = torch.diag(torch.tensor([1e4, 1e-3]))
    KFAC({"fc": (a, torch.eye(1))}).save(tmp_path / "c.curvature.safetensors")
    save_file({"fc.weight": torch.zeros(1, 2)}, tmp_path / "base.safetensors")
    save_file({"fc.weight": torch.ones(1, 2)}, tmp_path / "ft.safetensors")
    config = {
        "method": "fisher_average",
        "base_model": "base.safetensors",
        "models": [{"model": "ft.safetensors", "curvature": "c.curvature.safetensors"}],
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(config))
    err = _fails(
        ["merge", str(tmp_path / "m.yaml"), str(tmp_path / "out"), "--no-progress"], capsys
    )
    assert "set `damping:` (at least " in err and "e.g. 1.0e-6" not in err
