"""Issue 21, items 5 and 9: entry points run code, and what they yield is bounded.

- Item 5: a refine YAML naming ``module:function`` runs that code. It is refused unless
  ``--allow-entry-points`` or ``GRADMERGE_ALLOW_ENTRY_POINTS=1`` says to trust the file as a
  script (the module is not even imported); ``--help`` says that entry points run code.
- Item 9: an endless DATA entry point ran forever (``--max-examples`` was refused for entry
  points). ``--max-examples N`` takes its first N examples (reference: the curvature of those N
  rows estimated directly), and without it an iterator that does not end stops with an error.
  ``refine`` refuses more than ``MAX_STEPS`` steps.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import yaml
from safetensors.torch import load_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.errors import ArgumentError, ConfigError, EntryPointsNotAllowedError
from gradmerge.io import data as data_module
from gradmerge.io import sources
from gradmerge.jobs.refine import MAX_STEPS, RefineConfig

ENTRY = textwrap.dedent(
    """
    import pathlib
    import torch

    pathlib.Path(__file__).with_name("imported").write_text("ran")  # what an attacker's code does

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 2)).double()

    def rows(n):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n, 3, generator=g, dtype=torch.float64)
        return x, (x[:, 0] > 0).long()

    def data():
        x, y = rows(8)
        return [(x[:4], y[:4]), (x[4:], y[4:])]

    def endless():
        x, y = rows(3)
        while True:
            yield x, y
    """
)


@pytest.fixture
def entry(tmp_path):
    (tmp_path / "ep.py").write_text(ENTRY)
    return tmp_path / "ep.py"


def _refine_yaml(tmp_path, steps=1):
    config = {
        "start": "ep.py:model",
        "base_model": "ep.py:model",
        "models": [{"model": "ep.py:model", "data": "ep.py:data"}],
        "prior": {"delta": 1.0},
        "steps": steps,
        "structure": "diag",
        "device": "cpu",
    }
    (tmp_path / "refine.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "refine.yaml"


def test_a_yaml_naming_entry_points_is_refused_without_the_opt_in(
    entry, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("GRADMERGE_ALLOW_ENTRY_POINTS", raising=False)
    path = _refine_yaml(tmp_path)
    assert cli.main(["refine", str(path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "names Python entry points" in err and "models[0].data" in err
    assert "--allow-entry-points" in err and "GRADMERGE_ALLOW_ENTRY_POINTS=1" in err
    assert not (tmp_path / "imported").exists() and not (tmp_path / "out").exists()
    with pytest.raises(EntryPointsNotAllowedError, match="like a script"):
        RefineConfig.from_yaml(path)
    monkeypatch.setenv("GRADMERGE_ALLOW_ENTRY_POINTS", "0")
    with pytest.raises(EntryPointsNotAllowedError):
        RefineConfig.from_yaml(path)
    assert not (tmp_path / "imported").exists()


def test_the_opt_in_lets_it_run(entry, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("GRADMERGE_ALLOW_ENTRY_POINTS", raising=False)
    path = _refine_yaml(tmp_path)
    argv = ["refine", str(path), str(tmp_path / "out"), "--allow-entry-points"]
    assert cli.main(argv) == 0
    assert (tmp_path / "imported").read_text() == "ran"
    assert (tmp_path / "out" / "model.safetensors").is_file()
    monkeypatch.setenv("GRADMERGE_ALLOW_ENTRY_POINTS", "1")
    assert RefineConfig.from_yaml(path).entry_points()[0] == ("start", f"{tmp_path}/ep.py:model")


@pytest.mark.parametrize("command", ["curvature", "gradient", "refine"])
def test_help_says_entry_points_run_code(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    if command == "refine":
        assert "--allow-entry-points" in text and "RUNS CODE" in text
    else:
        for flag in ("--model-arg", "--data-arg"):
            after = text.rsplit(flag + " KEY=VALUE", 1)[-1]
            assert "it runs code, like a Python import" in after[:300]
        assert "(an entry point RUNS that code)" in text


def test_max_examples_takes_the_first_examples_of_an_entry_point(entry, tmp_path):
    out = tmp_path / "c.safetensors"
    argv = ["curvature", f"{entry}:model", f"{entry}:endless", str(out), "--max-examples", "7"]
    assert cli.main([*argv, "--no-progress"]) == 0
    c = gm.load_curvature(out)
    assert c.meta["num_examples"] == "7" and c.meta["source.max_examples"] == "7"
    module = sources.call_entry_point(f"{entry}:model", "MODEL")
    x, y = sources.call_entry_point(f"{entry}:rows", "DATA", {"n": 3})
    first7 = [(x, y), (x, y), (x[:1], y[:1])]
    reference = gm.estimate_curvature(module.eval(), first7, structure="diag")
    reference.save(tmp_path / "ref.safetensors")
    expected, got = load_file(str(tmp_path / "ref.safetensors")), load_file(str(out))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_an_endless_entry_point_stops_with_an_error(entry, monkeypatch):
    monkeypatch.setattr(data_module, "MAX_ENTRY_POINT_EXAMPLES", 30)  # where bounded() reads it
    data = sources.load_data(f"{entry}:endless")
    with pytest.raises(ArgumentError, match="more than 30 examples and has not ended"):
        for _ in data:
            pass
    bounded = sources.load_data(f"{entry}:data", max_examples=5)
    assert [x.shape[0] for x, _ in bounded] == [4, 1]
    assert [x.shape[0] for x, _ in bounded] == [4, 1]  # re-iterable, as the list it wraps


def test_refine_steps_are_bounded(entry, tmp_path):
    def read(steps):
        return RefineConfig.from_dict(
            yaml.safe_load(_refine_yaml(tmp_path, steps).read_text()), root=tmp_path
        )

    with pytest.raises(ConfigError, match=f"`steps` must be at most {MAX_STEPS}, got 1000000"):
        read(1_000_000)
    assert read(MAX_STEPS).steps == MAX_STEPS
