"""`remaining:` / `prior:` with several curvature files: their SUM, as one file holding the sum.

References: the same run with one file holding ``C_a + C_b`` (summed in memory by the curvature
algebra), and, for removing a task from a gradient-matching merge, the exact identity

    re-merge without task b = remove(θ_m, θ_b, H_b, H_0, H̄_\\b) − H̄_\\b⁻¹ H_0 (θ_m − θ_0)

(Eq. 6 and Eq. 13 with diagonal curvatures, α = 1; the recipe of docs/config.md, 'Removal'), checked
elementwise in float64.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import ConfigError, MissingInputError
from gradmerge.jobs import RemoveConfig

SHAPES = {"w": (3, 4), "b": (4,)}
DELTA = 0.3


def _params(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}


def _diag(seed):
    g = torch.Generator().manual_seed(seed)
    return gm.Diagonal(
        {k: torch.rand(s, generator=g, dtype=torch.float64) * 4 for k, s in SHAPES.items()}
    )


@pytest.fixture
def files(tmp_path):
    theta0 = _params(0)
    fts = {
        t: {k: v + _params(10 + i, 0.5)[k] for k, v in theta0.items()} for i, t in enumerate("abc")
    }
    save_file(theta0, tmp_path / "base.safetensors")
    for t, p in fts.items():
        save_file(p, tmp_path / f"ft_{t}.safetensors")
    curvatures = {t: _diag(20 + i) for i, t in enumerate("abc")}
    for t, c in curvatures.items():
        c.save(tmp_path / f"{t}.curvature.safetensors")
    return tmp_path, theta0, fts, curvatures


def _run(command, config, tmp_path, out):
    (tmp_path / f"{out}.yaml").write_text(yaml.safe_dump(config))
    code = cli.main([command, str(tmp_path / f"{out}.yaml"), str(tmp_path / out), "--no-progress"])
    assert code == 0
    return load_file(str(tmp_path / out / "model.safetensors"))


def _merge_config(tasks, prior_curvature=None):
    prior = {"delta": DELTA}
    if prior_curvature is not None:
        prior["curvature"] = prior_curvature
    return {
        "method": "gradient_matching",
        "base_model": "base.safetensors",
        "models": [
            {"model": f"ft_{t}.safetensors", "curvature": f"{t}.curvature.safetensors"}
            for t in tasks
        ],
        "prior": prior,
        "compute_dtype": "float64",
    }


def _remove_config(remaining):
    return {
        "method": "remove",
        "base_model": "merged/model.safetensors",
        "model": "ft_b.safetensors",
        "curvature": "b.curvature.safetensors",
        "prior": {"delta": DELTA},
        "remaining": {"delta": DELTA, "curvature": remaining},
        "compute_dtype": "float64",
    }


def test_several_remaining_files_equal_one_file_of_their_sum(files):
    tmp_path, _, _, curvatures = files
    (curvatures["a"] + curvatures["c"]).save(tmp_path / "ac.curvature.safetensors")
    _run("merge", _merge_config("abc"), tmp_path, "merged")
    listed = _run(
        "remove",
        _remove_config(["a.curvature.safetensors", "c.curvature.safetensors"]),
        tmp_path,
        "listed",
    )
    summed = _run("remove", _remove_config("ac.curvature.safetensors"), tmp_path, "summed")
    for k in SHAPES:
        torch.testing.assert_close(listed[k], summed[k], rtol=1e-15, atol=0)


def test_removing_a_task_from_a_merge_is_the_re_merge_up_to_the_prior_term(files):
    tmp_path, theta0, _, curvatures = files
    merged = _run("merge", _merge_config("abc"), tmp_path, "merged")
    removed = _run(
        "remove",
        _remove_config(["a.curvature.safetensors", "c.curvature.safetensors"]),
        tmp_path,
        "removed",
    )
    remerged = _run("merge", _merge_config("ac"), tmp_path, "remerged")
    for k in SHAPES:
        rest = DELTA + curvatures["a"].values[k] + curvatures["c"].values[k]  # H̄_\b
        correction = DELTA * (merged[k] - theta0[k]) / rest
        torch.testing.assert_close(remerged[k], removed[k] - correction, rtol=1e-12, atol=1e-14)
        assert correction.abs().max() > 1e-3  # the identity's last term is not negligible here


def test_a_prior_of_several_files_is_their_sum(files):
    tmp_path, _, _, curvatures = files
    (curvatures["a"] + curvatures["b"]).save(tmp_path / "ab.curvature.safetensors")
    listed = _run(
        "merge",
        _merge_config("c", ["a.curvature.safetensors", "b.curvature.safetensors"]),
        tmp_path,
        "listed",
    )
    summed = _run("merge", _merge_config("c", "ab.curvature.safetensors"), tmp_path, "summed")
    for k in SHAPES:
        torch.testing.assert_close(listed[k], summed[k], rtol=1e-15, atol=0)
    record = (tmp_path / "listed" / "gradmerge_merge.json").read_text()
    assert "prior.curvature[1]" in record


@pytest.mark.parametrize(
    ("remaining", "error", "message"),
    [
        ([], ConfigError, "`remaining.curvature` is an empty list"),
        (
            ["a.curvature.safetensors", "nowhere.safetensors"],
            MissingInputError,
            "`remaining.curvature[1]`: no file at",
        ),
        (["a.curvature.safetensors", 3], ConfigError, "`remaining.curvature[1]` must be a path"),
    ],
)
def test_bad_lists_name_the_yaml_key(files, remaining, error, message):
    tmp_path = files[0]
    config = _remove_config(remaining)
    config["base_model"] = "base.safetensors"
    with pytest.raises(error) as err:
        RemoveConfig.from_dict(config, root=tmp_path)
    assert message in str(err.value)
