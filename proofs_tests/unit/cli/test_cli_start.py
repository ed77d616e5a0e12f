"""The command line answers at once: ``gradmerge``, ``gradmerge --help``, ``gradmerge --version``,
every ``gradmerge CMD --help`` and every error argparse raises load neither torch nor
transformers, safetensors or numpy (each is checked in a fresh interpreter, counting the modules
in ``sys.modules``, not seconds); an error names its command and prints that command's usage.

What the help shows without loading them is checked against the modules it stands in for: the
jobs' registries (:mod:`gradmerge.commands._job_help`), the estimator's choices, the tuning
criteria and the entry-point limit."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from gradmerge import cli
from gradmerge.commands._inputs import Renamed
from proofs_tests.limits import HANG_S

HEAVY = ("torch", "transformers", "safetensors", "numpy")

PROBE = """
import contextlib, io, json, sys
from gradmerge import cli

def call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
    return [code, out.getvalue(), err.getvalue()]

calls = {" ".join(argv): call(argv) for argv in json.loads(sys.argv[1])}
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
print(json.dumps({"calls": calls, "heavy": heavy}))
""".replace("HEAVY", repr(HEAVY))


def _commands() -> list[str]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices)


def _run(argvs: list[list[str]]) -> dict:
    """Call ``cli.main`` on each argv in ONE fresh interpreter; what each printed, and which
    heavy modules were loaded at the end."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_version_and_every_commands_help_load_no_torch():
    argvs = [[], ["--help"], ["--version"], *([c, "--help"] for c in _commands())]
    result = _run(argvs)
    assert result["heavy"] == [], f"printing help loaded {result['heavy']}"
    calls = result["calls"]
    bare, helped = calls[""], calls["--help"]
    # bare `gradmerge` is a request for help: the same text on stdout, exit 0
    assert bare[0] == 0 and bare[1] == helped[1] and bare[2] == ""
    assert helped[0] == 0 and helped[1].startswith("usage: gradmerge")
    for command in _commands():
        assert command in helped[1]
    from gradmerge import __version__

    assert calls["--version"][:2] == [0, f"gradmerge {__version__}\n"]
    for command in _commands():
        code, out, _ = calls[f"{command} --help"]
        assert code == 0 and out.startswith(f"usage: gradmerge {command}"), command


def test_argument_errors_load_no_torch_and_name_their_command():
    commands = _commands()
    argvs = [[c, "--no-such-flag"] for c in commands]
    argvs += [[c] for c in commands if c != "demo" and c != "verify"]  # required arguments
    argvs += [["demo", "--seed", "-1"], ["demo", "--threads", "0"], ["nope"]]
    result = _run(argvs)
    assert result["heavy"] == [], f"an argument error loaded {result['heavy']}"
    for argv, (code, out, err) in result["calls"].items():
        command = argv.split()[0]
        assert code == 2 and out == "", argv
        if command == "nope":
            assert "gradmerge: error: argument COMMAND: invalid choice: 'nope'" in err
            continue
        # the command's own usage and prefix, never the top-level ones
        assert err.startswith(f"usage: gradmerge {command}"), (argv, err)
        assert f"\ngradmerge {command}: error: " in err, (argv, err)
    seed = result["calls"]["demo --seed -1"][2]
    assert seed.rstrip().endswith("gradmerge demo: error: --seed must be 0 or more, got -1")


def test_job_help_is_what_the_registries_say():
    """The merge and remove help's method table and keys (kept as text) equal the registries'."""
    from gradmerge.commands._job_help import TEXTS, from_registries

    assert from_registries() == TEXTS, "run: python -m gradmerge.commands._job_help"


def test_choices_written_out_are_the_modules_own():
    from gradmerge.commands import _inputs, curvature, tune
    from gradmerge.estimate import options
    from gradmerge.io import data
    from gradmerge.jobs import tune as jobs_tune

    assert tuple(s.value for s in options.Structure) == curvature.STRUCTURES
    assert tuple(f.value for f in options.Fisher) == curvature.FISHERS
    assert tuple(a.value for a in options.KFACApprox) == curvature.KFAC_APPROXES
    assert curvature.MAX_FACTOR_SIDE == options.MAX_FACTOR_SIDE
    assert tune.CRITERIA == jobs_tune.CRITERIA
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub.choices["curvature"]._actions}
    assert f"{data.MAX_ENTRY_POINT_EXAMPLES:,}" in helps["max_examples"]
    import torch

    assert _inputs.autocast_dtype("bfloat16") is torch.bfloat16
    assert _inputs.autocast_dtype(None) is None


def test_the_estimator_flags_are_its_declared_options():
    """Each option of ``gm.EstimateOptions`` that declares a flag is a flag of ``gradmerge
    curvature`` with the declared default, choices and kind (an integer option parses as one),
    and its help says that default; the options without a flag have none."""
    from gradmerge.estimate.options import EstimateOptions
    from gradmerge.foundation.settings import declared, default_of

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = {a.dest: a for a in sub.choices["curvature"]._actions}
    flagged = {name: s for name, s in declared(EstimateOptions).items() if s.flag}
    assert set(flagged) == set(declared(EstimateOptions)) - {"params", "progress"}
    for name, s in flagged.items():
        action, default = actions[name], default_of(EstimateOptions, name)
        assert s.flag in action.option_strings, name
        assert action.default == default, name
        assert f"default: {default}" in (action.help or ""), name
        if s.choices:
            assert list(action.choices or ()) == [str(c) for c in s.choices], name
        if s.kind == "integer" and name != "kfac_max_factor_side":  # 'none' parses too
            assert action.type is int, name
    parsed = parser.parse_args(["curvature", "m", "d", "out"])
    assert {name: getattr(parsed, name) for name in flagged} == {
        name: default_of(EstimateOptions, name) for name in flagged
    }


WARN = """
import warnings
from gradmerge import cli
from gradmerge.errors import InputWarning
with cli.one_line_warnings("curvature"):
    warnings.warn("K-FAC left out\\n  2 layers", UserWarning)
    warnings.warn("DATA repeats a file", InputWarning)
warnings.warn("after the command", UserWarning)
"""


def test_warnings_print_as_one_line_without_source():
    """Every warning under the command line: ``gradmerge CMD: warning: MESSAGE`` on one line,
    with the category of one that is not gradmerge's own; no file, line or source. Python's own
    format is back afterwards."""
    done = subprocess.run(
        [sys.executable, "-c", WARN], capture_output=True, text=True, timeout=HANG_S, check=True
    )
    lines = done.stderr.splitlines()
    assert lines[:2] == [
        "gradmerge curvature: warning: K-FAC left out 2 layers (UserWarning)",
        "gradmerge curvature: warning: DATA repeats a file",
    ]
    assert "<string>:" in lines[2] and "UserWarning: after the command" in lines[2]


@pytest.mark.parametrize("command", _commands())
def test_every_flag_has_help_and_its_default(command):
    """Each option of each command says what it does, and its default where it has one (the
    help text shows the value argparse would use)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, Renamed)):
            continue  # a renamed flag is hidden: it only refuses, naming the new one
        flag = action.option_strings[0]
        assert action.help and action.help != argparse.SUPPRESS, f"{command} {flag}: no help"
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS) or isinstance(
            action, (argparse._StoreTrueAction, argparse._VersionAction)
        ):
            continue
        text = action.help.replace("%(default)s", str(default))
        assert any(form in text for form in _forms(default)), (
            f"gradmerge {command} {flag}: the help does not show its default {default!r}"
        )


def _forms(value: object) -> set[str]:
    """How a help text may write a default: 20000 as 20000 or 20,000; 1e-3 as 0.001 or 1e-3;
    1.0 as 1.0 or 1; a list as its items."""
    forms = {str(value)}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        forms |= {f"{value:g}", f"{value:,}", f"{value:.0e}".replace("e-0", "e-")}
    if isinstance(value, (list, tuple)):
        forms.add(" ".join(map(str, value)))
    return forms


def test_estimator_option_errors_say_the_flag(capsys):
    """EstimateOptions names its options as Python does; the command line says the flags."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["curvature", "m", "d", "o", "--mc-samples", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (
        "gradmerge curvature: error: --mc-samples must be a positive integer (labels drawn per "
        "example for --fisher mc), got 0"
    )


def test_the_text_flags_are_the_declared_text_options():
    """``--text-field`` ... ``--max-examples`` are the declared fields of ``TextOptions`` (a
    refinement's ``text`` keys), with their defaults."""
    from gradmerge.foundation.settings import declared, default_of
    from gradmerge.io.text_records import TextOptions

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("curvature", "gradient", "evaluate"):
        actions = {a.dest: a for a in sub.choices[command]._actions}
        for name, s in declared(TextOptions).items():
            assert s.flag in actions[name].option_strings, (command, name)
            assert actions[name].default == default_of(TextOptions, name), (command, name)
