"""`--dry-run` checks every unit's linear system and names the damping it needs.

The loop is closed against the real run: a configuration the dry run flags fails when run, and
the same configuration with the damping the dry run names succeeds. Systems: diagonal curvatures
with coordinates no task saw (0 in every H_t), a K-FAC layer estimated on fewer examples than its
input width (rank-deficient A), and a removal whose remaining curvature has zeros.
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.jobs import MergeConfig
from gradmerge.jobs.conditioning import check_systems, delta_note


def _diag(values):
    return gm.Diagonal({k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()})


@pytest.fixture
def diag_inputs(tmp_path):
    base = {"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    save_file(base, tmp_path / "base.safetensors")
    for t in range(2):
        save_file({k: v + t + 1 for k, v in base.items()}, tmp_path / f"ft{t}.safetensors")
    # 'a'[2] and 'b'[0] are 0 in both curvatures: never seen by either task
    _diag({"a": [1.0, 2.0, 0.0], "b": [0.0, 3.0]}).save(tmp_path / "c0.safetensors")
    _diag({"a": [0.5, 0.0, 0.0], "b": [0.0, 1.0]}).save(tmp_path / "c1.safetensors")
    return tmp_path


def _config(method, **extra):
    return {
        "method": method,
        "base_model": "base.safetensors",
        "models": [
            {"model": f"ft{t}.safetensors", "curvature": f"c{t}.safetensors"} for t in range(2)
        ],
        **extra,
    }


def _cli(tmp_path, command, config, *flags):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return cli.main([command, str(tmp_path / "c.yaml"), str(tmp_path / "out"), *flags])


def test_dry_run_names_every_singular_unit_and_the_damping_that_fixes_it(diag_inputs, capsys):
    code = _cli(diag_inputs, "merge", _config("fisher_average"), "--dry-run")
    out = capsys.readouterr().out
    assert code == 1
    assert "0 of 2 units solvable as configured" in out
    assert "['a']" in out and "['b']" in out  # both units, not only the first
    needed = float(re.search(r"set `damping` to at least ([0-9.e+-]+) \(the largest", out)[1])
    assert _cli(diag_inputs, "merge", _config("fisher_average"), "--no-progress") == 1
    err = capsys.readouterr().err
    assert "not positive definite" in err and "set `damping:`" in err and "--dry-run" in err
    assert "prior=" not in err  # a YAML run's error names YAML keys, not Python keywords
    fixed = _config("fisher_average", damping=needed)
    assert _cli(diag_inputs, "merge", fixed, "--dry-run") == 0
    assert "2 of 2 units solvable" in capsys.readouterr().out
    assert _cli(diag_inputs, "merge", fixed, "--no-progress") == 0


def test_gradient_matching_with_a_prior_is_solvable(diag_inputs, capsys):
    config = _config("gradient_matching", prior={"delta": 0.1})
    assert _cli(diag_inputs, "merge", config, "--dry-run") == 0
    assert "2 of 2 units solvable as configured" in capsys.readouterr().out


def test_a_rank_deficient_kfac_layer_is_flagged_and_its_damping_works(tmp_path, capsys):
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(6, 3)).double()
    x = torch.randn(2, 6, dtype=torch.float64)  # 2 examples, 7 inputs (with the bias): rank 2
    c = gm.estimate_curvature(layer, [(x, torch.tensor([0, 2]))], structure="kfac")
    params = {k: v.detach() for k, v in layer.named_parameters()}
    save_file(params, tmp_path / "base.safetensors")
    for t in range(2):
        save_file({k: v + t for k, v in params.items()}, tmp_path / f"ft{t}.safetensors")
        c.save(tmp_path / f"c{t}.safetensors")
    config = _config("fisher_average", compute_dtype="float64")
    checks = check_systems(MergeConfig.from_dict(config, root=tmp_path))
    assert len(checks) == 1 and not checks[0].ok
    assert set(checks[0].keys) == {"0.weight", "0.bias"}
    # the check's λ_min is that of the dense matrix of H_0 + H_1 = 2·C (built column by column)
    basis = torch.eye(sum(v.numel() for v in params.values()), dtype=torch.float64)
    columns = []
    for e in basis:
        v, start = {}, 0
        for k, p in params.items():
            v[k] = e[start : start + p.numel()].reshape(p.shape)
            start += p.numel()
        columns.append(torch.cat([t.flatten() for t in c.mv(v).values()]))
    dense = 2 * torch.stack(columns, dim=1)
    assert checks[0].min_eigenvalue == pytest.approx(
        float(torch.linalg.eigvalsh(dense).min()), abs=1e-12
    )
    assert _cli(tmp_path, "merge", {**config, "damping": checks[0].needed}, "--no-progress") == 0


def test_a_removal_with_zeros_in_the_remaining_curvature(diag_inputs, capsys):
    config = {
        "method": "remove",
        "base_model": "base.safetensors",
        "model": "ft0.safetensors",
        "curvature": "c0.safetensors",
        "prior": {"delta": 0.1},
        "remaining": {"curvature": "c1.safetensors"},
    }
    assert _cli(diag_inputs, "remove", config, "--dry-run") == 1
    assert "set `remaining: {delta: ...}` to at least" in capsys.readouterr().out


def test_a_delta_far_below_the_curvature_warns_that_it_is_fisher_averaging(diag_inputs, capsys):
    tiny = MergeConfig.from_dict(
        _config("gradient_matching", prior={"delta": 1e-9}), root=diag_inputs
    )
    note = delta_note(tiny)
    assert note is not None and "Fisher averaging" in note
    sensible = MergeConfig.from_dict(
        _config("gradient_matching", prior={"delta": 0.1}), root=diag_inputs
    )
    assert delta_note(sensible) is None
    _cli(diag_inputs, "merge", _config("gradient_matching", prior={"delta": 1e-9}), "--dry-run")
    assert "gives Fisher averaging's result" in capsys.readouterr().err


def test_a_singular_kfac_system_under_a_prior_suggests_a_larger_delta(tmp_path, capsys):
    """An indefinite K-FAC term (no δ suggested by the solver): the fix names the δ given and
    suggests more than it, never a smaller example (it used to say "e.g. 1.0e-6" under δ = 0.01)."""
    w = {"fc.weight": torch.zeros(2, 3, dtype=torch.float64)}
    save_file(w, tmp_path / "base.safetensors")
    bad = torch.diag(torch.tensor([1.0, 2.0, -5.0], dtype=torch.float64))  # indefinite A
    for t in range(3):
        ft = torch.ones(2, 3, dtype=torch.float64) + t
        save_file({"fc.weight": ft}, tmp_path / f"ft{t}.safetensors")
        a = bad if t == 0 else torch.eye(3, dtype=torch.float64)
        gm.KFAC({"fc": (a, torch.eye(2, dtype=torch.float64))}).save(tmp_path / f"c{t}.safetensors")
    config = _config("gradient_matching", prior={"delta": 0.01}, compute_dtype="float64")
    config["models"].append({"model": "ft2.safetensors", "curvature": "c2.safetensors"})
    assert _cli(tmp_path, "merge", config, "--no-progress") != 0
    err = capsys.readouterr().err
    assert "positive semi-definite" in err
    assert "more than the 0.01 given, e.g. 1.0e-01" in err and "e.g. 1.0e-6" not in err
