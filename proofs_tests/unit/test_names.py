"""One meaning per name: the names that meant two things were split, and the old ones are gone.

- α is a model's own weight (``models[].alpha``, ``alphas=``); the factor on every α_t is
  ``scale``, and ``gradmerge tune`` grids it with ``--scales`` (``--alphas`` is refused:
  proofs_tests/reliability/test_tune_arguments.py);
- the prior or remaining term a streamed rule takes (a curvature, or a float δ for δ·I) is
  ``gradmerge.merge.inputs.CurvatureLike``, as the in-memory rules' curvature arguments; the prior
  precision the closed-form testbed takes (a number, a diagonal or a matrix) is
  ``gradmerge.theory.problems.PrecisionLike``;
- the running job is :class:`gradmerge.jobs.job.Job`; the command a method serves
  (``merge``/``remove``) is :data:`gradmerge.methods.base.Command`, ``MergeMethod.command``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import get_args

import torch

from gradmerge.curvature import Curvature
from gradmerge.jobs import job
from gradmerge.merge import inputs
from gradmerge.methods import base, registry
from gradmerge.theory import problems


def test_the_two_precision_aliases_have_their_own_names():
    assert not hasattr(base, "Precision") and not hasattr(problems, "Precision")
    assert set(get_args(inputs.CurvatureLike)) == {Curvature, float}
    assert set(get_args(problems.PrecisionLike)) == {float, int, torch.Tensor}
    eye = problems.precision_matrix(2.0, 3)  # δ = 2 as a PrecisionLike: 2·I
    assert torch.equal(eye, 2.0 * torch.eye(3, dtype=torch.float64))


def test_a_methods_command_is_not_called_job():
    assert get_args(base.Command) == ("merge", "remove")
    assert not hasattr(base, "JobKind")
    names = {f.name for f in fields(base.MergeMethod)}
    assert "command" in names and "job" not in names
    assert {m.command for m in registry.REGISTRY} == {"merge", "remove"}
    assert {m.runs for m in registry.REGISTRY} <= set(get_args(base.Command))
    assert isinstance(job.Job, type)  # the running job keeps the name
