"""docs/tutorial.md runs: every ``python`` and ``bash`` block, in order, in one empty folder.

Python blocks share one namespace (as cells of a notebook) and their ``assert`` statements are
the tutorial's checks; bash blocks run with ``bash -euo pipefail``, where ``gradmerge`` is this
checkout's command line run by the interpreter running the tests. Any failing block fails the test,
naming the block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def blocks() -> list[tuple[str, str]]:
    """(language, code) of the tutorial's fenced blocks, in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(TUTORIAL.read_text())]


def test_the_tutorial_covers_the_path():
    kinds = [language for language, _ in blocks()]
    assert set(kinds) == {"python", "bash"}
    commands = "\n".join(code for language, code in blocks() if language == "bash")
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
    assert any("accuracy" in code for language, code in blocks() if language == "python")
    assert any("ModelCard" in code for language, code in blocks() if language == "python")


def test_the_tutorial_runs(tmp_path, monkeypatch):
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    launcher = bin_dir / "gradmerge"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gradmerge.cli "$@"\n')
    launcher.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    namespace: dict[str, object] = {"__name__": "__tutorial__"}
    for number, (language, code) in enumerate(blocks(), start=1):
        if language == "python":
            exec(compile(code, f"{TUTORIAL.name}, block {number}", "exec"), namespace)
        else:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                pytest.fail(f"block {number} (bash) exited {done.returncode}:\n{done.stderr}")
    assert (work / "unlearned" / "gradmerge_remove.json").is_file()
