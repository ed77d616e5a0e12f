"""Packaging: the wheel installs one top-level package, ``gradmerge`` (the theory testbed is
``gradmerge.theory``); ``import gradmerge`` loads the in-memory rules only, the checkpoint and
distributed machinery load on first use of their public names, which keep working."""

import subprocess
import sys
from pathlib import Path

import pytest
from setuptools import find_packages

from proofs_tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_only_gradmerge_is_packaged():
    """The packages pyproject's ``packages.find`` selects all live under ``gradmerge``."""
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(ROOT), include=include)
    assert "gradmerge.theory" in packages and "gradmerge.theory.symbolic" in packages
    assert all(p == "gradmerge" or p.startswith("gradmerge.") for p in packages), packages


HEAVY = (
    "gradmerge.distributed",
    "gradmerge.io",
    "gradmerge.jobs",
    "gradmerge.kernels",
    "gradmerge.commands",
    "gradmerge.theory",
)


def _loaded_after(code: str) -> set[str]:
    """The heavy gradmerge packages in sys.modules after running ``code`` in a fresh process."""
    probe = (
        f"{code}\nimport sys\n"
        "print(sorted({'.'.join(m.split('.')[:2]) for m in sys.modules"
        f" if m.startswith({HEAVY!r})}}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=HANG_S
    )
    return set(eval(out.stdout.strip().splitlines()[-1]))


def test_import_gradmerge_is_light():
    assert _loaded_after("import gradmerge as gm; gm.gradient_matching, gm.KFAC") == set()


def test_the_kernels_load_on_the_first_diagonal_merge():
    """The in-memory rules' default kernel is the engine's choice, loaded when first needed."""
    merge = "gm.gradient_matching({'w': torch.zeros(2)}, [{'w': torch.ones(2)}], [1.0], prior=1.0)"
    assert _loaded_after(f"import torch, gradmerge as gm; {merge}") == {"gradmerge.kernels"}


@pytest.mark.parametrize(
    ("access", "loads"),
    [
        ("gm.run_merge", {"gradmerge.jobs"}),
        ("gm.open_checkpoint", {"gradmerge.io"}),
        ("gm.jobs.MergeConfig", {"gradmerge.jobs"}),
        ("gm.distributed.estimate_curvature", {"gradmerge.distributed"}),
    ],
)
def test_public_names_load_on_first_use(access, loads):
    loaded = _loaded_after(f"import gradmerge as gm; {access}")
    assert loads <= loaded
    assert not loaded & {"gradmerge.commands", "gradmerge.theory"}  # the CLI and the testbed


def test_lazy_names_are_the_real_ones():
    import gradmerge as gm
    from gradmerge import distributed, io, jobs

    assert gm.run_merge is jobs.run_merge and gm.distributed is distributed
    assert gm.open_checkpoint is io.open_checkpoint
    assert set(gm.__all__) <= set(dir(gm))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = gm.nope


def test_the_removed_checkpoints_alias_is_gone():
    """``gradmerge.checkpoints`` (the alias of ``io`` and ``jobs`` kept after the split) was
    removed in 0.x: the package holds no such module and the facade does not offer the name."""
    import gradmerge as gm

    package = Path(gm.__file__).parent
    assert not (package / "checkpoints").exists() and not (package / "checkpoints.py").exists()
    with pytest.raises(AttributeError, match="no attribute 'checkpoints'"):
        _ = gm.checkpoints
