"""The dry run tells the truth: for every method and structure, `--dry-run` and the real run reach
the same verdict (issue 22, item 1). Cases as data: each names its inputs, its configuration
and the verdict expected of both runs (0: runs, 1: refused); the test runs both commands and
asserts they agree with each other and with the expectation.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge.cli import main


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    g = torch.Generator().manual_seed(0)
    n_in, n_out = 24, 12
    base = {"fc.weight": 0.1 * torch.randn(n_out, n_in, generator=g), "fc.bias": torch.zeros(n_out)}
    save_file(base, root / "base.safetensors")
    for t in range(2):
        ft = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        save_file(ft, root / f"ft{t}.safetensors")
        x = torch.randn(3, n_in + 1, generator=g)
        x[:, -1] = 1
        y = torch.randn(3, n_out, generator=g) * torch.logspace(0, -4, n_out)
        kfac = gm.KFAC({"fc": (x.T @ x / 3, y.T @ y)}, bias=["fc"], counts={"fc": 3})
        kfac.save(root / f"k{t}.safetensors")  # rank 3 of 25 inputs: singular alone
        diag = {
            k: torch.rand(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.5)
            for k, v in base.items()
        }
        gm.Diagonal(diag).save(root / f"d{t}.safetensors")  # about half the entries 0
    f0 = {
        k: torch.rand(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.2)
        for k, v in base.items()
    }
    gm.Diagonal(f0).save(root / "f0.safetensors")
    return root


def _merge(method, kind, **extra):
    models = [
        {"model": f"ft{t}.safetensors", "curvature": f"{kind}{t}.safetensors"} for t in range(2)
    ]
    return {"method": method, "base_model": "base.safetensors", "models": models, **extra}


def _remove(remaining, **extra):
    return {
        "method": "remove",
        "base_model": "base.safetensors",
        "model": "ft0.safetensors",
        "curvature": "d0.safetensors",
        "prior": {"delta": 1e-3},
        "remaining": remaining,
        **extra,
    }


CASES = [
    ("diag-fisher-zeros", "merge", _merge("fisher_average", "d"), 1),
    ("diag-fisher-damped", "merge", _merge("fisher_average", "d", damping=1e-3), 0),
    ("diag-gm", "merge", _merge("gradient_matching", "d", prior={"delta": 1e-6}), 0),
    (
        "kfac-fisher-rank-deficient",
        "merge",
        _merge("fisher_average", "k", compute_dtype="float64"),
        1,
    ),
    ("kfac-fisher-damped", "merge", _merge("fisher_average", "k", damping=1e-2), 0),
    ("kfac-gm", "merge", _merge("gradient_matching", "k", prior={"delta": 1e-2}), 0),
    # K-FAC tasks + the diagonal base-Fisher prior at δ = 1e-12 (item 8)
    (
        "kfac-diag-prior-1e-12-f64",
        "merge",
        _merge(
            "gradient_matching",
            "k",
            prior={"delta": 1e-12, "curvature": "f0.safetensors"},
            compute_dtype="float64",
        ),
        1,
    ),
    (
        "kfac-diag-prior-1e-4-f64",
        "merge",
        _merge(
            "gradient_matching",
            "k",
            prior={"delta": 1.3e-4, "curvature": "f0.safetensors"},
            compute_dtype="float64",
        ),
        0,
    ),
    ("regmean-plain-closed-form", "merge", _merge("regmean", "k", off_diagonal=1.0), 1),
    ("regmean-jin-default", "merge", _merge("regmean", "k"), 0),
    ("remove-zeros", "remove", _remove({"curvature": "d1.safetensors"}), 1),
    (
        "remove-damped",
        "remove",
        _remove({"delta": 1e-2, "curvature": "d1.safetensors"}, step_check="ignore"),
        0,
    ),
    (
        "remove-amplified",
        "remove",
        _remove(
            {"delta": 1e-12, "curvature": "d1.safetensors"},
            prior={"delta": 1.0},
            step_check="ignore",
        ),
        1,
    ),
]


@pytest.mark.parametrize(("name", "command", "config", "verdict"), CASES, ids=[c[0] for c in CASES])
def test_dry_run_and_real_run_agree(root, capsys, name, command, config, verdict):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = root / f"out-{name}"
    dry = main([command, str(path), str(out), "--dry-run"])
    dry_text = capsys.readouterr()
    assert not out.exists()
    real = main([command, str(path), str(out), "--no-progress"])
    real_text = capsys.readouterr()
    assert (dry, real) == (verdict, verdict), (dry_text, real_text)
    assert out.exists() == (verdict == 0)


def test_each_input_warning_is_printed_once_and_names_the_command(root, capsys):
    from gradmerge.curvature import provenance

    c = gm.load_curvature(root / "d1.safetensors")
    c.meta[provenance.META_KEY] = "0" * 64  # estimated at other weights than any input
    c.save(root / "stale.safetensors")
    config = _remove({"delta": 1e-2, "curvature": "stale.safetensors"}, step_check="ignore")
    (root / "stale.yaml").write_text(yaml.safe_dump(config))
    for flags in (["--dry-run"], ["--no-progress"]):
        assert main(["remove", str(root / "stale.yaml"), str(root / "out-stale"), *flags]) == 0
        err = capsys.readouterr().err
        assert err.count("was estimated at other weights") == 1, err
        assert err.startswith("gradmerge remove: warning:") and "commands/merge.py" not in err


@pytest.mark.parametrize("wide", [False, True])
def test_a_solve_that_does_not_converge_advises_float64_only_when_not_in_float64(wide):
    """The solvers' NotConvergedError advises float64; a run already in float64 drops that."""
    from types import SimpleNamespace

    from gradmerge.errors import NotConvergedError
    from gradmerge.jobs.job import _run_unit
    from gradmerge.jobs.plan import Unit
    from gradmerge.solvers.cg import solve_or_raise

    def compute(unit, rows=None):  # a UnitFn (gradmerge.jobs.job)
        dtype = torch.float64 if wide else torch.float32
        b = {"w": torch.ones(3, dtype=dtype)}
        solve_or_raise(
            lambda v: {"w": v["w"] * torch.tensor([1.0, 1e-9, 1e9], dtype=dtype)},
            b,
            gm.CG(tol=1e-14, maxiter=1),
            what="H̄",
        )

    job = SimpleNamespace(compute=compute, wide=wide)
    with pytest.raises(NotConvergedError) as info:
        _run_unit(job, Unit(("w",), True))
    message = str(info.value)
    assert "maxiter" in message and "while computing ['w']" in message
    advises = "work in float64" in message or "compute in float64" in message
    assert advises == (not wide)
    assert ("already runs in float64" in message) == wide
