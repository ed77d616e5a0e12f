"""The README stays short and true: at most 250 lines; `.ci/run` runs exactly the README's test
command; its Python example prints what its comment says; its YAML examples, and docs/guide.md's, parse
(the full reference, docs/config.md, is checked by test_config_reference.py)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch
import yaml

import gradmerge as gm

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_readme_is_short():
    assert len(README.splitlines()) <= 250


def test_ci_runs_the_readmes_test_command():
    quick_start = next(b for b in _blocks("bash") if "make test" in b)
    command = re.search(r"^(make test)\b", quick_start, flags=re.M)
    assert command is not None
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert command.group(1) in [line.strip() for line in ci]


def test_python_example_prints_what_its_comment_says():
    example = next(b for b in _blocks("python") if "gm.task_arithmetic(base" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {})
    printed = out.getvalue()
    comment = re.search(r"# (tensor\(.*?\)) (tensor\(.*?\)):", example)
    assert comment is not None
    for said in comment.groups():
        assert said in printed, (said, printed)
    # and the comment is Eq. 6 itself: θ = H̄⁻¹ Σ_t (δ + H_t) θ_t with θ_LLM = 0, α_t = 1
    h = torch.tensor([[9.0, 0.1, 1.0], [0.1, 9.0, 1.0]], dtype=torch.float64)
    theta = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 2.0]], dtype=torch.float64)
    exact = ((0.01 + h) * theta).sum(0) / (0.01 + h.sum(0))
    assert torch.tensor([0.9890, 0.9890, 2.0100], dtype=torch.float64).sub(exact).abs().max() < 1e-4


def test_yaml_examples_parse():
    """The README's and docs/guide.md's YAML examples (both also in docs/config.md)."""
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    texts = _blocks("yaml") + re.findall(r"```yaml\n(.*?)```", guide, flags=re.S)
    assert len(texts) >= 3
    for text in texts:
        data = yaml.safe_load(text)
        cls = (
            gm.RemoveConfig if data["method"] in ("remove", "influence_remove") else gm.MergeConfig
        )
        cls.from_dict(data, check_files=False)
