"""docs/tutorial.md runs as written: docs/tutorial.py runs every ``python`` and ``bash`` block, in
order, in one empty folder (``make tutorial``), and every ``text`` block is what the block before
it printed.

The run here is docs/tutorial.py's own, with the ``gradmerge`` commands of the ``bash`` blocks run
in this process (:func:`benchmarks.inprocess.run_cli`, which gives what the executable gives:
``proofs_tests/benchmarks/test_inprocess.py``): the same blocks, the same files, without a
process's imports per command. ``python`` blocks share one namespace and their ``assert``
statements are the tutorial's own checks; any failing block fails the test, naming the block.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from benchmarks.inprocess import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    """docs/tutorial.py as a module (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_tutorial", ROOT / "docs" / "tutorial.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tutorial = _runner()


def test_the_tutorial_covers_the_path():
    blocks = tutorial.blocks()
    assert {b.language for b in blocks} == {"python", "bash", "text", "console"}
    commands = "\n".join(b.code for b in blocks if b.language == "bash")
    for step in (
        "gradmerge curvature",
        "--structure diag",
        "--structure kfac",
        ".jsonl",
        "method: task_arithmetic",
        "method: gradient_matching",
        "gradmerge inspect",
        "gradmerge merge",
        "gradmerge remove",
        "gradmerge evaluate",
        "--compare",
    ):
        assert step in commands, step
    python = [b.code for b in blocks if b.language == "python"]
    assert any("accuracy" in code for code in python)
    assert any("ModelCard" in code for code in python)
    # one δ for every prior, chosen in the tutorial from inspect's window (no literal value)
    assert "delta: $DELTA" in commands and "delta: 0" not in commands


def test_the_runner_refuses_a_shell_that_reads_a_deferred_commands_output(tmp_path):
    text = "```bash\ngradmerge inspect a.safetensors | head -3\n```\n"
    with pytest.raises(tutorial.BlockFailed, match="read by the shell"):
        tutorial.run(tmp_path, gradmerge=run_cli, text=text)


def test_the_tutorial_runs_and_prints_what_it_quotes(tmp_path):
    work = tmp_path / "work"
    transcript = tutorial.run(
        work, gradmerge=lambda argv: run_cli(argv, env={"HF_HUB_OFFLINE": "1"})
    )
    assert (work / "unlearned" / "gradmerge_remove.json").is_file()
    blocks = tutorial.blocks()
    quoted = 0
    for i, block in enumerate(blocks):
        if block.language != "text":
            continue
        source = next(b for b in reversed(blocks[:i]) if b.language in tutorial.RUNNABLE)
        printed = {line.strip() for line in transcript.printed[source.number].splitlines()}
        for line in block.code.splitlines():
            assert line.strip() in printed, (block.number, line, sorted(printed))
            quoted += 1
    assert quoted >= 4
    # gradient matching differs from task arithmetic at the tutorial's δ: under 5% of the
    # coordinates have the prior's share s > 0.999 (at the old δ = 0.01 it was 98.9%)
    share = next(line for line in transcript.printed_lines() if line.startswith("prior share s"))
    assert float(share.split("(task arithmetic) on ")[1].rstrip("%")) < 5
