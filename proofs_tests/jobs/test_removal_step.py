"""Removal reports its step ‖θ_\\t − θ_LLM‖ against what it undoes, and refuses an explosion.

Reference: gm.remove / gm.influence_remove in memory, whose step norms the report must state.
The explosion: a diagonal remaining curvature with entries 0 and δ = 1e-6, so that H̄_\\t⁻¹
multiplies those directions by 10⁶ (the case of a real model with half its Fisher entries 0).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import ConfigError, InputWarning, StepTooLargeError
from gradmerge.jobs import RemoveConfig, run_remove

SHAPES = {"w": (4, 3), "b": (3,)}


def _params(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}


@pytest.fixture
def inputs(tmp_path):
    base, ft = _params(0), {k: v + 0.1 * _params(1)[k] for k, v in _params(0).items()}
    save_file(base, tmp_path / "base.safetensors")
    save_file(ft, tmp_path / "ft.safetensors")
    save_file(_params(2, 0.3), tmp_path / "grad.safetensors")
    g = torch.Generator().manual_seed(3)
    h_t = gm.Diagonal(
        {k: torch.rand(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
    )
    h_t.save(tmp_path / "ht.safetensors")
    rest = {k: torch.rand(s, generator=g, dtype=torch.float64) + 0.5 for k, s in SHAPES.items()}
    holes = {k: v * (torch.arange(v.numel()).reshape(v.shape) % 2) for k, v in rest.items()}
    gm.Diagonal(rest).save(tmp_path / "rest.safetensors")
    gm.Diagonal(holes).save(tmp_path / "holes.safetensors")  # half the entries 0
    return tmp_path, base, ft, h_t, gm.Diagonal(rest), gm.Diagonal(holes)


def _config(method, remaining, delta, **extra):
    config = {"method": method, "base_model": "base.safetensors", "compute_dtype": "float64"}
    if method == "remove":
        config.update(model="ft.safetensors", curvature="ht.safetensors", prior={"delta": 0.1})
    else:
        config["gradient"] = "grad.safetensors"
    config["remaining"] = {"delta": delta, "curvature": remaining}
    return {**config, **extra}


def _norm(d):
    return math.sqrt(sum(float(v.square().sum()) for v in d.values()))


def _run(tmp_path, config, out="out"):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(config))
    return cli.main(["remove", str(tmp_path / "r.yaml"), str(tmp_path / out), "--no-progress"])


def test_eq13_reports_its_step_relative_to_the_task_vector(inputs, capsys):
    tmp_path, base, ft, h_t, rest, _ = inputs
    assert _run(tmp_path, _config("remove", "rest.safetensors", 0.1)) == 0
    expected = gm.remove(base, ft, h_t, remaining=rest + 0.1, prior=0.1)
    step = _norm({k: expected[k] - base[k] for k in base})
    task = _norm({k: ft[k] - base[k] for k in base})
    out = capsys.readouterr().out
    assert f"= {step:.4g}, {step / task:.3g}× the task vector ‖θ_t − θ_LLM‖ ({task:.4g})" in out
    record = json.loads((tmp_path / "out" / "gradmerge_remove.json").read_text())
    assert record["step"]["ratio"] == pytest.approx(step / task, rel=1e-12)


def test_koh_and_liang_reports_its_step_relative_to_the_weights(inputs, capsys):
    tmp_path, base, _, _, rest, _ = inputs
    assert _run(tmp_path, _config("influence_remove", "rest.safetensors", 0.1)) == 0
    grad = _params(2, 0.3)
    expected = gm.influence_remove(base, grad, remaining=rest + 0.1)
    step, weights = _norm({k: expected[k] - base[k] for k in base}), _norm(base)
    assert f"{step / weights:.3g}× the weights ‖θ_LLM‖" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["remove", "influence_remove"])
def test_an_exploding_step_is_refused_and_writes_nothing(inputs, capsys, method):
    tmp_path = inputs[0]
    assert _run(tmp_path, _config(method, "holes.safetensors", 1e-6)) == 1
    err = capsys.readouterr().err
    assert "exceeds `max_relative_step:" in err and "`step_check: warn`" in err
    assert "remaining: {delta: ...}" in err
    assert not (tmp_path / "out").exists()


def test_step_check_warn_writes_with_a_warning_and_ignore_is_silent(inputs):
    tmp_path = inputs[0]
    config = RemoveConfig.from_dict(
        _config("remove", "holes.safetensors", 1e-6, step_check="warn"), root=tmp_path
    )
    with pytest.warns(InputWarning, match="exceeds `max_relative_step: 100`"):
        report = run_remove(config, tmp_path / "warned", progress=False)
    assert (tmp_path / "warned" / "model.safetensors").is_file()
    assert "the task vector" in report.notes[0]
    quiet = RemoveConfig.from_dict(
        _config("remove", "holes.safetensors", 1e-6, step_check="ignore"), root=tmp_path
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputWarning)
        run_remove(quiet, tmp_path / "quiet", progress=False)


def test_the_limit_is_a_yaml_key(inputs):
    tmp_path = inputs[0]
    strict = RemoveConfig.from_dict(
        _config("remove", "rest.safetensors", 0.1, max_relative_step=1e-3), root=tmp_path
    )
    with pytest.raises(StepTooLargeError, match=r"max_relative_step: 0\.001"):
        run_remove(strict, tmp_path / "strict", progress=False)
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_relative_step": 0}, "`max_relative_step` must be > 0"),
        ({"max_relative_step": "big"}, "`max_relative_step` must be a finite number"),
        ({"step_check": "maybe"}, "step_check"),
    ],
)
def test_bad_settings_name_the_key(inputs, extra, message):
    with pytest.raises(ConfigError, match=message):
        RemoveConfig.from_dict(_config("remove", "rest.safetensors", 0.1, **extra), root=inputs[0])
