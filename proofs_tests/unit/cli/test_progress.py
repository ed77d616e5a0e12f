"""Progress off a terminal: timed plain log lines (done/total, rate, ETA), passes named up front.

Checked through the commands with stderr captured (not a terminal) and
GRADMERGE_PROGRESS_INTERVAL=0 (a line per step), and on the class with a fake clock-free stream.
"""

from __future__ import annotations

import io
import re
import textwrap

import pytest
import torch

import gradmerge as gm
from gradmerge import cli
from gradmerge.jobs.progress import Progress

ENTRY = textwrap.dedent(
    """
    import torch

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    """
)


def test_log_lines_count_up_to_the_total_with_an_eta():
    log = io.StringIO()
    p = Progress("step", total=10, unit="examples", stream=log, interval=0.0)
    for _ in range(5):
        p.update(2)
    p.close()
    lines = log.getvalue().splitlines()
    assert [re.match(r"step: (\d+)/10 examples", line)[1] for line in lines[:5]] == [
        "2",
        "4",
        "6",
        "8",
        "10",
    ]
    assert all("ETA" in line for line in lines[:4])
    assert "done in" in lines[-1]


def test_bytes_and_tensors_are_shown_together():
    log = io.StringIO()
    p = Progress(
        "gradmerge merge", 3e9, unit="B", items="tensors", items_total=4, stream=log, interval=0.0
    )
    p.update(1.5e9, items=2)
    assert log.getvalue().startswith("gradmerge merge: 2/4 tensors, 1.5 GB/3.0 GB (50%), ")


def test_no_line_before_the_interval():
    log = io.StringIO()
    p = Progress("slow", total=5, stream=log, interval=3600.0)
    p.update(1)
    assert log.getvalue() == ""
    p.close()
    assert log.getvalue().count("\n") == 1  # only the final line


def test_curvature_logs_examples_and_announces_kfac_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRADMERGE_PROGRESS_INTERVAL", "0")
    (tmp_path / "m.py").write_text(ENTRY)
    torch.save(
        {"inputs": torch.randn(10, 3), "targets": torch.randint(0, 2, (10,))}, tmp_path / "d.pt"
    )
    argv = [f"{tmp_path}/m.py:mlp", str(tmp_path / "d.pt"), str(tmp_path / "c.safetensors")]
    assert cli.main(["curvature", *argv, "--structure", "kfac", "--batch-size", "4"]) == 0
    err = capsys.readouterr().err
    assert "kfac: up to 2 passes over DATA" in err
    assert (
        "curvature kfac empirical (pass 1 of up to 2: the Kronecker factors): 4/10 examples" in err
    )
    assert "10/10 examples (100%)" in err and "examples/s" in err


def test_merge_logs_tensors_and_bytes(tmp_path, monkeypatch, capsys):
    from safetensors.torch import save_file

    monkeypatch.setenv("GRADMERGE_PROGRESS_INTERVAL", "0")
    save_file({"a": torch.zeros(4), "b": torch.zeros(2)}, tmp_path / "base.safetensors")
    save_file({"a": torch.ones(4), "b": torch.ones(2)}, tmp_path / "ft.safetensors")
    config = gm.MergeConfig.from_dict(
        {
            "method": "task_arithmetic",
            "base_model": "base.safetensors",
            "models": [{"model": "ft.safetensors"}],
        },
        root=tmp_path,
    )
    gm.run_merge(config, tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "gradmerge merge: 1/2 tensors" in err and "gradmerge merge: 2/2 tensors" in err
    assert "24 B/24 B (100%)" in err


@pytest.mark.parametrize("value", ["abc", "-5"])
def test_a_bad_interval_falls_back_or_clamps(monkeypatch, value):
    monkeypatch.setenv("GRADMERGE_PROGRESS_INTERVAL", value)
    p = Progress("x", stream=io.StringIO())
    assert p.interval == (30.0 if value == "abc" else 0.0)
