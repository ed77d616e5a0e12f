"""Every default is written once in the code: its declaration.

A default restated elsewhere (a keyword default, a command-line flag, a docstring, a docs
string) drifts from the declaration the day one of them changes. The declarations:

- the solver's ``tol`` and ``maxiter``: :data:`gradmerge.solvers.spec.DEFAULT_TOL` and
  :data:`~gradmerge.solvers.spec.MAXITER`, which :class:`gradmerge.SolverSpec`'s ``solver``
  table, :func:`gradmerge.solvers.cg.conjugate_gradient` and ``gm.Sum`` read;
- the curvature estimator's options: the fields of :class:`gradmerge.EstimateOptions`, which
  ``gm.estimate_curvature``'s keywords (and the lower-level estimators' shared ones), the flags
  of ``gradmerge curvature`` and docs/config.md's ``estimate`` table read;
- a refinement's keys: the fields of :class:`gradmerge.jobs.refine.RefineConfig` (and
  ``TaskInput``), which its reader and docs/config.md's ``refine`` tables read (the estimator's
  keys take their defaults from ``EstimateOptions``, ``batch_size`` from
  :data:`gradmerge.io.forms.BATCH_SIZE`, which the commands' ``--batch-size`` and the data
  loaders read too);
- ``ignore_index``: :data:`gradmerge.foundation.settings.IGNORE_INDEX`, which ``EstimateOptions`` and the
  data loaders of :mod:`gradmerge.io` read.

Each test greps ``gradmerge/`` for the literal restatements of one default (the patterns below)
and allows them only where the default is declared, and checks that the users take the
declared value.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import gradmerge

ROOT = Path(gradmerge.__file__).parent
SOURCES = {
    path.relative_to(ROOT.parent).as_posix(): path.read_text(encoding="utf-8")
    for path in sorted(ROOT.rglob("*.py"))
}

RESTATED: dict[str, tuple[Any, ...]] = {
    "solver tol": (
        r"1e-0?10 in float64|1e-0?5 in float32|\btol: float(?: \| None)? = 1e-0?(?:10|5)\b",
        {"gradmerge/solvers/spec.py": 0},
    ),
    "solver maxiter": (
        r"\bmaxiter: int(?: \| None)? = 1000\b|\b1000 \(0 with",
        {},
    ),
    "estimator max_params": (r"\b20[_ ,]?000\b", {"gradmerge/estimate/options.py": 1}),
    "estimator kfac_max_factor_side": (
        r"\b16[_ ,]?384\b",
        {"gradmerge/estimate/options.py": 2},  # MAX_FACTOR_SIDE and its docstring's arithmetic
    ),
    "estimator keyword defaults": (
        r"\b(?:structure|fisher|loss|mc_samples|seed|ignore_index|kfac_approx|max_params)"
        r"\s*:\s*[^=\n,()]+=\s*(?:-?\d|\"(?:diag|empirical|cross_entropy|expand)\")",
        {},
        ("gradmerge/estimate/", "gradmerge/evaluation.py", "gradmerge/distributed/"),
    ),
    "estimator flag defaults": (
        r"default=(?:-100|1|0|20_?000|\"(?:diag|empirical|cross_entropy|expand|text|label)\"),",
        {},
        ("gradmerge/commands/curvature.py", "gradmerge/commands/_inputs.py"),
    ),
    "refine defaults": (
        r"(?m)^    \w+: (?:int|str|bool|float)(?: \| None)? = (?!setting\()[^,\n]*$"
        r"|default=(?:-?\d|\"|True|False)"
        r"|\(\w, \"\w+\", -?\d",
        {},
        ("gradmerge/jobs/refine.py",),
    ),
    "ignore_index": (
        r"(?<![\w.])-100\b",
        {
            "gradmerge/foundation/settings.py": 1,  # IGNORE_INDEX
            "gradmerge/commands/refine.py": 1,  # a value of the epilog's example configuration
        },
    ),
    "shard size": (
        r"\b5 \* 10\*\*9\b|\b5_?000_?000_?000\b",
        {
            "gradmerge/io/writer.py": 1,  # DEFAULT_SHARD_SIZE
            "gradmerge/jobs/config.py": 1,  # a doctest's output (checked by the doctests)
        },
    ),
    "batch size": (
        r"\bbatch_size: int = \d|batch_size or \d|\(16\)",
        {},
        ("gradmerge/io/", "gradmerge/commands/", "gradmerge/jobs/"),
    ),
}
"""A default → (a regex of its literal restatements, {file: how many it may hold}[, the files
searched: path prefixes; default every module of gradmerge/]). PyTorch's ``ignore_index=-100`` is
:data:`gradmerge.foundation.settings.IGNORE_INDEX`, below both the estimator and the loaders of gradmerge.io
(which read data without the estimator: the layers of docs/architecture.md)."""


@pytest.mark.parametrize("name", RESTATED)
def test_a_default_is_not_restated(name):
    pattern, allowed, *within = RESTATED[name]
    prefixes = within[0] if within else ("gradmerge/",)
    found = {
        file: [m.group(0) for m in re.finditer(pattern, text)]
        for file, text in SOURCES.items()
        if file.startswith(prefixes)
    }
    extra = {
        file: hits for file, hits in found.items() if len(hits) > allowed.get(file, 0) and hits
    }
    assert not extra, f"{name}: its default restated outside its declaration: {extra}"


def test_the_solver_defaults_come_from_their_declaration():
    import torch

    from gradmerge.solvers import cg, spec

    assert cg.default_tol(torch.float64) == spec.DEFAULT_TOL["float64"]
    assert cg.default_tol(torch.float32) == spec.DEFAULT_TOL["float32"]
    assert cg.default_tol(torch.float16) == spec.LOW_PRECISION_TOL
    keywords = inspect.signature(cg.conjugate_gradient).parameters
    assert keywords["tol"].default == spec.DEFAULT_TOL["float64"]
    assert keywords["maxiter"].default == spec.MAXITER
    assert gradmerge.KroneckerCG().maxiter == gradmerge.CG().maxiter == spec.MAXITER
    declared_doc = gradmerge.foundation.settings.declared(gradmerge.KroneckerCG)
    assert declared_doc["tol"].default_doc == (
        f"{spec.number_text(spec.DEFAULT_TOL['float32'])} in float32, "
        f"{spec.number_text(spec.DEFAULT_TOL['float64'])} in float64 (the solve's dtype)"
    )
    assert str(spec.MAXITER) in (declared_doc["maxiter"].default_doc or "")


def test_the_refine_reader_takes_the_declared_defaults():
    """A refinement that gives only its required keys gets every other key's declared default
    (and the estimator's keys those of ``EstimateOptions``, but ``structure``)."""
    from gradmerge.estimate.options import EstimateOptions
    from gradmerge.foundation.settings import REQUIRED, declared, default_of
    from gradmerge.io.forms import BATCH_SIZE
    from gradmerge.jobs.refine import RefineConfig, TaskInput

    given = {
        "start": ".",
        "base_model": ".",
        "steps": 1,
        "models": [{"model": ".", "data": "a.safetensors"}],
        "prior": {"delta": 0.5},
    }
    config = RefineConfig.from_dict(given, check_files=False)
    optional = [k for k in declared(RefineConfig) if default_of(RefineConfig, k) is not REQUIRED]
    assert set(optional) == set(declared(RefineConfig)) - set(given)
    for key in optional:
        assert getattr(config, key) == default_of(RefineConfig, key), key
    assert config.models[0].alpha == default_of(TaskInput, "alpha")
    for key in ("fisher", "loss", "ignore_index", "seed"):
        assert default_of(RefineConfig, key) == default_of(EstimateOptions, key), key
    assert config.batch_size == BATCH_SIZE


def test_the_loaders_and_the_estimator_ignore_the_same_positions():
    """``ignore_index``'s one declaration is the default of the estimator's option and of every
    data loader of gradmerge.io."""
    from gradmerge.estimate.options import EstimateOptions
    from gradmerge.foundation.settings import IGNORE_INDEX, default_of
    from gradmerge.io.data import TensorBatches, load_data
    from gradmerge.io.text_data import TextBatches

    assert IGNORE_INDEX == -100  # PyTorch's nn.CrossEntropyLoss default
    assert default_of(EstimateOptions, "ignore_index") == IGNORE_INDEX
    for loader in (load_data, TensorBatches, TextBatches):
        assert inspect.signature(loader).parameters["ignore_index"].default == IGNORE_INDEX
