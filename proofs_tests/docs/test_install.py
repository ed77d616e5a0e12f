"""The README's install lines work: pip's resolver accepts each one against this checkout, with no
network (``--dry-run --no-index``: what the line asks must be satisfiable by the packages at hand,
the extras it names must exist), so that the section cannot name a package that is not there (no
``gradmerge`` on PyPI) or an extra that was renamed. The missing-extra message names a command of
the same form, and it resolves too."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradmerge.foundation.extras import EXTRAS, install_command
from proofs_tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _install_lines() -> list[str]:
    section = README.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None, "the Install section has no bash block"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def _resolve(argv: list[str], tmp_path: Path) -> tuple[list[dict], str]:
    """pip's resolver on ``pip install ARGS`` without the network; what it would install."""
    args = list(argv)
    if "--index-url" in args:  # the CPU index: resolved against the packages at hand instead
        at = args.index("--index-url")
        del args[at : at + 2]
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--quiet",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--report",
            str(report),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, (argv, done.stderr)
    assert "does not provide the extra" not in done.stderr, (argv, done.stderr)
    return json.loads(report.read_text())["install"], done.stderr


def test_the_install_section_lists_the_package_and_every_extra():
    lines = _install_lines()
    assert all(line.startswith("pip install ") for line in lines), lines
    assert "pip install gradmerge" not in lines  # not on the package index
    targets = [shlex.split(line)[2:] for line in lines]
    named = {t[0] for t in targets}
    assert "." in named and {f".[{extra}]" for extra in EXTRAS} <= named


def test_every_install_line_and_the_missing_extra_command_resolve(tmp_path):
    """One resolver run (pip merges the lines' requirements), so that the check stays fast."""
    targets = [arg for line in _install_lines() for arg in shlex.split(line)[2:]]
    command = shlex.split(install_command("demo"))
    assert command[:2] == ["pip", "install"] and command[2:] == [f"{ROOT}[demo]"]
    installs, _ = _resolve([*targets, *command[2:]], tmp_path)
    (ours,) = [i for i in installs if i["metadata"]["name"] == "gradmerge"]
    assert ours["download_info"]["url"] == ROOT.as_uri()  # this checkout, not an index


def test_a_wrong_extra_or_package_is_caught(tmp_path):
    """The check is not vacuous: an extra that does not exist fails (pip only warns about it),
    and so does a package not at hand (``gradmerge`` itself is installed here, so another name)."""
    with pytest.raises(AssertionError, match="does not provide the extra"):
        _resolve([".[no-such-extra]"], tmp_path)
    with pytest.raises(AssertionError, match="No matching distribution"):
        _resolve(["gradmerge-no-such-package"], tmp_path)
