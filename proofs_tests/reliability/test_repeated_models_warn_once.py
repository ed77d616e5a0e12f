"""Issue 21, item 11: one model listed 1,000 times warned 999 times, each with a Python source
line. Now one :class:`InputWarning` names each repeated checkpoint with its count; the command
line prints it as one line (``gradmerge merge: warning: ...``) without a source line; the class is kept
(InputWarning: the first test).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import yaml
from safetensors.torch import save_file

import gradmerge as gm
from gradmerge.jobs.config import MergeConfig


@pytest.fixture
def folder(tmp_path):
    for name, value in (("base", 0.0), ("a", 1.0), ("b", 2.0)):
        save_file({"w": torch.full((2,), value)}, tmp_path / f"{name}.safetensors")
    return tmp_path


def _config(times_a: int, times_b: int = 1):
    models = [{"model": "a.safetensors", "alpha": 0.001}] * times_a
    models += [{"model": "./b.safetensors"}] * times_b
    return {"method": "task_arithmetic", "base_model": "base.safetensors", "models": models}


def test_a_model_listed_1000_times_warns_once_with_the_count(folder):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        MergeConfig.from_dict(_config(1000, 2), root=folder)
    messages = [str(w.message) for w in record if issubclass(w.category, gm.InputWarning)]
    assert len(messages) == 1
    (message,) = messages
    assert "models[0].model, models[1].model, models[2].model, ... (997 more)" in message
    assert "listed 1000 times" in message and "alpha 1" in message
    assert "models[1000].model and models[1001].model" in message and "listed 2 times" in message


def _merge(path, out):
    """`gradmerge merge` in a fresh interpreter (its own warning state); its stderr."""
    code = "import sys; from gradmerge.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "merge", str(path), str(out)]
    done = subprocess.run([*argv, "--no-progress"], capture_output=True, text=True, check=True)
    return done.stderr


def test_the_command_line_prints_one_line_without_source(folder):
    path = folder / "m.yaml"
    path.write_text(yaml.safe_dump(_config(100)))
    err = _merge(path, folder / "out")
    lines = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(lines) == 1 and "warning: models[0].model, models[1].model" in lines[0]
    assert "warnings.warn" not in err and ".py:" not in err
