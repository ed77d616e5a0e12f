"""`--dry-run` names, for each unit it refuses, the least δ at which that unit is finite and
certified — overflow included — and says only what it checked (issue 31, item 2).

The case: two tasks whose (dense) curvatures are nearly parallel rank-one matrices, H_t = v_t v_tᵀ
with v_1 = (1, 1), v_2 = (1, 1 + η), and task vectors of opposite sign along them. In exact
arithmetic Eq. 6's solution then grows like 1/η as δ → 0: about 2·10⁶·|τ| for η = 10⁻⁶. It
overflows a float16 output (|τ| = 1), or float64 itself (|τ| = 10³⁰³), below some δ and fits
above it. At the official δ = 1e-12 the run refuses; the dry run must refuse too, name the δ
from which the run succeeds, and the δ it found failing below it must fail when run.
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge.cli import main

D = torch.float64
ETA = 1e-6


@pytest.fixture(
    scope="module", params=[(1.0, "float16"), (1e303, "float64")], ids=["f16-out", "f64"]
)
def case(request, tmp_path_factory):
    size, dtype = request.param
    root = tmp_path_factory.mktemp("overflow")
    save_file({"w": torch.zeros(2, dtype=D)}, root / "base.safetensors")
    for t, (tau, v) in enumerate((([1.0, 0.0], [1.0, 1.0]), ([0.0, -1.0], [1.0, 1.0 + ETA]))):
        save_file({"w": size * torch.tensor(tau, dtype=D)}, root / f"ft{t}.safetensors")
        v = torch.tensor(v, dtype=D)
        gm.Dense(torch.outer(v, v), like={"w": torch.zeros(2, dtype=D)}).save(
            root / f"c{t}.safetensors"
        )
    return root, dtype


def _run(root, dtype, delta, *flags):
    config = {
        "method": "gradient_matching",
        "base_model": "base.safetensors",
        "models": [
            {"model": f"ft{t}.safetensors", "curvature": f"c{t}.safetensors"} for t in range(2)
        ],
        "prior": {"delta": delta},
        "compute_dtype": "float64",
        "dtype": dtype,
    }
    name = f"d{delta:.3e}{''.join(flags)}"
    (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return main(
        ["merge", str(root / f"{name}.yaml"), str(root / f"out-{name}"), "--no-progress", *flags]
    )


def test_the_dry_run_names_the_least_delta_and_the_real_run_agrees(case, capsys):
    root, dtype = case
    assert _run(root, dtype, 1e-12, "--dry-run") == 1
    out = capsys.readouterr().out
    # it says what it checked: the unit was computed, its overflow included
    assert "1 computed as the real run computes them (solve, certificate, overflow" in out
    assert "its result overflows" in out
    found = re.search(r"finite and certified from δ = ([0-9.e+-]+) \(δ = ([0-9.e+-]+) fails\)", out)
    assert found, out
    least, below = float(found[1]), float(found[2])
    assert 1e-12 <= below < least <= 4 * below  # a bracket within a factor 4
    assert f"set `prior: {{delta: ...}}` to at least {least:.2g}" in out
    # the verdicts are the real run's: 1e-12 and the bracket's lower end fail, its upper end runs
    assert _run(root, dtype, 1e-12) == 1
    assert "overflow" in capsys.readouterr().err
    assert _run(root, dtype, below) == 1
    capsys.readouterr()
    assert _run(root, dtype, float(f"{least:.2g}")) == 0
    assert _run(root, dtype, float(f"{least:.2g}"), "--dry-run") == 0


def test_a_run_the_dry_run_passes_succeeds(case, capsys):
    root, dtype = case
    assert _run(root, dtype, 1.0, "--dry-run") == 0
    assert "1 of 1 units solvable" in capsys.readouterr().out
    assert _run(root, dtype, 1.0) == 0


def test_when_no_delta_helps_the_dry_run_says_so(tmp_path, capsys):
    """Task vectors whose sum overflows float64: Eq. 6's right-hand side Σ_t α_t (H_0 + H_t) τ_t
    overflows at every δ (and δ → ∞ gives task arithmetic, whose sum overflows too), so no δ
    makes the unit finite: the dry run says so instead of naming a value."""
    save_file({"w": torch.zeros(2, dtype=D)}, tmp_path / "base.safetensors")
    for t in range(2):
        save_file({"w": torch.full((2,), 1.5e308, dtype=D)}, tmp_path / f"ft{t}.safetensors")
        gm.Dense(torch.eye(2, dtype=D), like={"w": torch.zeros(2, dtype=D)}).save(
            tmp_path / f"c{t}.safetensors"
        )
    assert _run(tmp_path, "float64", 1e-3, "--dry-run") == 1
    out = capsys.readouterr().out
    assert "no δ makes it finite and certified" in out and "overflow" in out
    assert "and run again" not in out  # no value to set
    assert _run(tmp_path, "float64", 1e-3) == 1
