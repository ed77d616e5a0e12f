"""The command line's help under ``python -OO``, which strips every docstring: each command's help
and description are explicit strings, so registration works and ``--help`` prints the same text as
without ``-OO`` (nothing of it comes from a docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gradmerge import cli
from proofs_tests.limits import HANG_S

PROBE = """
import contextlib, io, json, sys
from gradmerge import cli
if sys.flags.optimize >= 2:
    assert cli.main.__doc__ is None, "docstrings were not stripped"
texts = {}
for argv in [[]] + [[name] for name in sys.argv[1:]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([*argv, "--help"])
        except SystemExit as stop:
            code = stop.code
    texts[" ".join(argv)] = [code, out.getvalue()]
print(json.dumps(texts))
"""


def _command_names() -> list[str]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return list(action.choices)


def _helps(*flags: str) -> dict[str, list]:
    done = subprocess.run(
        [sys.executable, *flags, "-c", PROBE, *_command_names()],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_help_is_the_same_under_python_OO():
    optimized, plain = _helps("-OO"), _helps()
    assert set(optimized) == {"", *_command_names()}
    for command, (code, text) in optimized.items():
        assert code == 0, command
        assert text.startswith(f"usage: gradmerge {command}".rstrip()), command
        assert text == plain[command][1], f"gradmerge {command} --help differs under -OO"
    for command in _command_names():  # every command is listed with its one-line help
        assert command in optimized[""][1]
        assert len(optimized[command][1].split("\n\n")) >= 3, f"{command}: no description"


def test_python_OO_m_gradmerge_help():
    done = subprocess.run(
        [sys.executable, "-OO", "-m", "gradmerge", "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: gradmerge")


def test_python_OO_distributed_commands_help():
    """The torchrun entry (``-m gradmerge.commands.distributed``) and its subcommands."""
    probe = (
        "import contextlib, io, json\n"
        "from gradmerge.commands import distributed\n"
        "texts = {}\n"
        "for argv in ([], ['curvature'], ['merge'], ['remove']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            distributed.main([*argv, '--help'])\n"
        "        except SystemExit as stop:\n"
        "            texts[' '.join(argv)] = [stop.code, out.getvalue()]\n"
        "print(json.dumps(texts))\n"
    )
    done = subprocess.run(
        [sys.executable, "-OO", "-c", probe], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr
    texts = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(texts) == {"", "curvature", "merge", "remove"}
    for argv, (code, text) in texts.items():
        assert code == 0 and text.startswith("usage: torchrun"), argv
