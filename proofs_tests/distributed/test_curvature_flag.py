"""``gradmerge curvature --distributed``: the flag's argument checks, in one process, no torchrun.

The run itself (2 gloo processes under torchrun, compared with the single-process estimate) is
``test_distributed.py::test_gradmerge_curvature_distributed_flag_writes_the_single_process_estimate``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradmerge.cli import main
from proofs_tests.distributed import cases

ENTRY = str(Path(cases.__file__).resolve())
ARGS = ["curvature", f"{ENTRY}:mlp_model", f"{ENTRY}:mlp_batches"]


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--timeout", "5"], "--timeout apply only with --distributed"),
        (["--expected-examples", "3", "--backend", "gloo"], "--expected-examples, --backend"),
        (["--distributed", "--timeout", "0"], "--timeout must be a positive number"),
        (["--distributed"], "--distributed runs under torchrun (RANK/WORLD_SIZE are not set)"),
    ],
)
def test_misused_distributed_options_are_usage_errors(
    no_torchrun, tmp_path, capsys, extra, message
):
    with pytest.raises(SystemExit) as exit_:
        main([*ARGS, str(tmp_path / "c.safetensors"), *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c.safetensors").exists()


def test_help_documents_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["curvature", "--help"])
    text = capsys.readouterr().out
    assert "--distributed" in text
    assert "torchrun --nproc-per-node 4 --no-python gradmerge curvature" in text


def test_without_the_flag_the_command_runs_in_one_process(no_torchrun, tmp_path, capsys):
    import gradmerge as gm

    out = tmp_path / "c.safetensors"
    assert main([*ARGS, str(out), "--structure", "diag", "--loss", "mse", "--no-progress"]) == 0
    written = gm.load_curvature(out, like=cases.mlp_model())
    assert "ranks" not in written.meta and written.meta["num_examples"] == "12"
