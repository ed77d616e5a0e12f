"""Entry points with arguments: one DATA function serving several tasks (``--data-arg``).

Reference: ``gm.estimate_curvature`` called here on the function's own output for each task.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import ArgumentError
from gradmerge.io.sources import call_entry_point, parse_argument

ENTRY = textwrap.dedent(
    """
    import torch

    def model(width=3, seed=0):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.Tanh(),
                                   torch.nn.Linear(4, 2)).double()

    def batches(task, n=6):
        g = torch.Generator().manual_seed({"a": 1, "b": 2}[task])
        x = torch.randn(n, 3, generator=g, dtype=torch.float64)
        return [(x, (x[:, 0] > 0).long())]
    """
)


@pytest.fixture
def entry(tmp_path):
    (tmp_path / "tasks.py").write_text(ENTRY)
    return tmp_path / "tasks.py"


def _estimate(entry, tmp_path, *flags):
    out = tmp_path / "c.safetensors"
    argv = ["curvature", f"{entry}:model", f"{entry}:batches", str(out), "--overwrite", *flags]
    assert cli.main([*argv, "--no-progress"]) == 0
    return load_file(str(out)), gm.load_curvature(str(out)).meta


@pytest.mark.parametrize("task", ["a", "b"])
def test_one_data_function_serves_several_tasks(entry, tmp_path, task):
    tensors, meta = _estimate(entry, tmp_path, "--data-arg", f"task={task}", "--data-arg", "n=5")
    module = call_entry_point(f"{entry}:model", "MODEL")
    data = call_entry_point(f"{entry}:batches", "DATA", {"task": task, "n": 5})
    reference = gm.estimate_curvature(module.eval(), data, structure="diag")
    path = tmp_path / "ref.safetensors"
    reference.save(path)
    expected = load_file(str(path))
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(tensors[name], value, rtol=0, atol=0)
    assert meta["num_examples"] == "5"
    assert meta["source.data_arguments"] == '{"n": 5, "task": "' + task + '"}'


def test_model_arguments_reach_the_model_function(entry, tmp_path):
    a, _ = _estimate(entry, tmp_path, "--data-arg", "task=a", "--model-arg", "seed=1")
    b, meta = _estimate(entry, tmp_path, "--data-arg", "task=a", "--model-arg", "seed=2")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert meta["source.model_arguments"] == '{"seed": 2}'


def test_an_argument_the_function_does_not_take_names_its_signature(entry, tmp_path, capsys):
    argv = [f"{entry}:model", f"{entry}:batches", str(tmp_path / "o.safetensors")]
    assert cli.main(["curvature", *argv, "--data-arg", "tsk=a", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "cannot be called with tsk='a'" in err and "batches(task, n=6)" in err
    assert cli.main(["curvature", *argv, "--no-progress"]) == 1  # task is required
    assert "cannot be called with no arguments" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("task=a", ("task", "a")),
        ("n=3", ("n", 3)),
        ("rate=0.5", ("rate", 0.5)),
        ("flag=true", ("flag", True)),
        ("ids=[1, 2]", ("ids", [1, 2])),
        ('name="a b"', ("name", "a b")),
        ("path=data/x=1.jsonl", ("path", "data/x=1.jsonl")),
        ("empty=", ("empty", "")),
    ],
)
def test_argument_values_are_json_when_they_parse(text, expected):
    assert parse_argument(text) == expected


@pytest.mark.parametrize("text", ["task", "=a", "1x=2", "a b=1"])
def test_malformed_arguments_are_errors(text, entry, tmp_path, capsys):
    with pytest.raises(ArgumentError, match="expected KEY=VALUE"):
        parse_argument(text)
    with pytest.raises(SystemExit):
        cli.main(["curvature", f"{entry}:model", f"{entry}:batches", "o.st", "--data-arg", text])
    assert "expected KEY=VALUE" in capsys.readouterr().err
