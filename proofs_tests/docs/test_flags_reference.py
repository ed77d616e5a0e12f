"""Every command's arguments on docs/config.md, and the shared flags declared once.

- The page's ``flags`` block is what :func:`gradmerge.commands.reference.flags` reads from the
  parsers, and every argument ``--help`` shows, of every command (the data-parallel entry
  point's included), has its row there, in its command's table.
- A flag several commands share (:data:`gradmerge.commands._flags.SHARED`) is, in every command,
  the one declaration's: same names, default, choices, type and action, and a help that its
  template gives; no command adds it by hand.
- Where a flag's value is written for the torch-free parser (``--device``'s choices, the timeout's
  seconds), it equals the declaration it stands for; the estimator's and the text keys' flags
  take their defaults from :class:`gradmerge.EstimateOptions` and ``TextOptions``.
"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

from gradmerge.commands import _flags
from gradmerge.commands import reference as page
from gradmerge.jobs import reference

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
PARSERS = page.parsers()


def _sections() -> dict[str, str]:
    """The page's flags block, split by command ("`gradmerge curvature`:" opens a table)."""
    block = reference.blocks(TEXT)["flags"]
    parts = re.split(r"^`([^`]+)`:$", block, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_flags_block_is_generated_from_the_parsers():
    assert reference.blocks(TEXT)["flags"] == page.flags(), (
        "docs/config.md's flags are stale: python -m gradmerge.commands.reference docs/config.md"
    )


@pytest.mark.parametrize("command", PARSERS)
def test_every_argument_of_every_command_is_on_the_page(command):
    sections = _sections()
    single = "gradmerge " + command.rpartition(" ")[2]
    documented = sections.get(command, "") + sections.get(single, "")
    cells = re.findall(r"^\| `([^`]+)` \|", documented, flags=re.M)
    names = {part.split()[0] for cell in cells for part in cell.replace("\\|", "|").split(", ")}
    shown = page.arguments(PARSERS[command])
    assert shown
    for action in shown:
        for name in action.option_strings or [str(action.metavar or action.dest)]:
            assert name in names, f"{command}: {name} is not on docs/config.md"


def _every_action() -> list[tuple[str, argparse.Action]]:
    return [(command, a) for command, p in PARSERS.items() for a in p._actions]


def _template(flag: _flags.Flag) -> re.Pattern[str]:
    """The helps ``flag``'s template gives: its ``{field}`` parts anything."""
    parts = re.split(r"\{\w+\}", flag.help)
    return re.compile("^" + "(.*)".join(re.escape(p) for p in parts) + "$", re.S)


@pytest.mark.parametrize("dest", _flags.SHARED)
def test_a_shared_flag_is_its_declaration_in_every_command(dest):
    flag = _flags.SHARED[dest]
    users = [(c, a) for c, a in _every_action() if flag.names[0] in a.option_strings]
    assert len({c.rpartition(" ")[2] for c, _ in users}) >= 2, f"{flag.names[0]}: not shared"
    for command, action in users:
        assert tuple(action.option_strings) == flag.names, command
        assert action.dest == dest, command
        expected = argparse.ArgumentParser().add_argument(*flag.names, **flag.options)
        for attribute in ("default", "choices", "type", "nargs", "metavar", "const"):
            assert getattr(action, attribute) == getattr(expected, attribute), (command, attribute)
        assert type(action) is type(expected), command
        assert _template(flag).match(action.help or ""), f"{command}: {action.help!r}"
    if "{" not in flag.help:  # no field: one help, word for word, in every command
        assert len({a.help for _, a in users}) == 1


def test_device_is_the_same_flag_in_demo_and_the_data_commands():
    """``demo --device`` had its own help and no choices; now every command's is one flag."""
    devices = {
        command: (a.help, a.default, a.choices)
        for command, a in _every_action()
        if "--device" in a.option_strings
    }
    assert {"gradmerge demo", "gradmerge curvature", "gradmerge evaluate"} <= set(devices)
    assert len(set(devices.values())) == 1, devices


def test_no_command_adds_a_shared_flag_by_hand():
    names = "|".join(re.escape(n) for flag in _flags.SHARED.values() for n in flag.names)
    by_hand = re.compile(r"add_argument\(\s*\"(?:" + names + r")\"")
    found = {
        path.name: by_hand.findall(path.read_text(encoding="utf-8"))
        for path in (ROOT / "gradmerge" / "commands").glob("*.py")
    }
    assert not {name: hits for name, hits in found.items() if hits}


def test_the_values_written_for_the_parser_equal_their_declarations():
    from gradmerge.distributed import DEFAULT_TIMEOUT
    from gradmerge.foundation.devices import AUTO
    from gradmerge.foundation.settings import default_of
    from gradmerge.jobs.options import Options

    assert DEFAULT_TIMEOUT.total_seconds() == _flags.TIMEOUT_SECONDS
    assert _flags.DEVICES[0] == default_of(Options, "device") == AUTO


@pytest.mark.parametrize("owner", ["EstimateOptions", "TextOptions"])
def test_the_setting_flags_take_the_declared_defaults(owner):
    from gradmerge.estimate.options import EstimateOptions
    from gradmerge.foundation.settings import REQUIRED, declared, default_of
    from gradmerge.io.text_records import TextOptions

    cls = {"EstimateOptions": EstimateOptions, "TextOptions": TextOptions}[owner]
    actions = {
        name: a
        for name, a in (
            (a.option_strings[0], a)
            for a in PARSERS["gradmerge curvature"]._actions
            if a.option_strings
        )
    }
    flagged = {key: s for key, s in declared(cls).items() if s.flag}
    assert flagged
    for key, s in flagged.items():
        action = actions[s.flag]
        default = default_of(cls, key)
        if default is REQUIRED or action.default is None:  # resolved by the reader
            continue
        assert action.default == default, s.flag
        if s.choices:
            assert tuple(action.choices) == s.choices, s.flag


def test_distributed_merge_waits_the_declared_timeout(monkeypatch):
    """``--timeout`` left out under ``torchrun ... distributed merge``: the ranks wait
    :data:`gradmerge.distributed.DEFAULT_TIMEOUT`."""
    from gradmerge.commands import distributed
    from gradmerge.distributed import DEFAULT_TIMEOUT

    seen = []

    def init(backend, device, timeout):
        seen.append(timeout)
        raise SystemExit(1)

    monkeypatch.setattr(distributed, "_init", init)
    args = distributed.build_parser().parse_args(["merge", "c.yaml", "out"])
    assert args.timeout is None
    with pytest.raises(SystemExit):
        distributed.run_merge_command(args)
    given = distributed.build_parser().parse_args(["remove", "c.yaml", "out", "--timeout", "5"])
    with pytest.raises(SystemExit):
        distributed.run_remove_command(given)
    assert seen == [DEFAULT_TIMEOUT.total_seconds(), 5.0]


def _default(command: str, flag: str):
    parser = PARSERS[f"gradmerge {command}"]
    return next(a for a in parser._actions if flag in a.option_strings).default


def _keyword(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_the_commands_defaults_are_the_librarys():
    """A flag whose parser cannot read its library's default (that module imports torch) writes
    it once in its command, and it equals the library's: the help shows it with
    ``%(default)s``."""
    from gradmerge.bootstrap import paired_bootstrap
    from gradmerge.commands import evaluate
    from gradmerge.commands.materialize import size
    from gradmerge.curvature.summary import RHO
    from gradmerge.demo import run_demo
    from gradmerge.foundation.settings import default_of
    from gradmerge.io.materialize import DEFAULT_SHARD_SIZE
    from gradmerge.io.official import convert_curvature
    from gradmerge.jobs.options import Options
    from gradmerge.theory.verify import collect

    assert _default("inspect", "--rho") == RHO
    assert _keyword(paired_bootstrap, "resamples") == evaluate.RESAMPLES
    assert _keyword(paired_bootstrap, "seed") == evaluate.SEED
    assert _default("demo", "--seed") == _keyword(run_demo, "seed")
    assert _default("demo", "--threads") == _keyword(run_demo, "threads")
    assert _default("demo", "--device") == _keyword(run_demo, "device")
    assert _default("convert-curvature", "--scale") == _keyword(convert_curvature, "scale")
    assert _default("verify", "--seeds") == _keyword(collect, "seeds")
    shard = size(_default("materialize", "--max-shard-size"))
    assert shard == DEFAULT_SHARD_SIZE == default_of(Options, "max_shard_size")


@pytest.mark.parametrize(
    "command, flag",
    [
        ("verify", "--seeds"),
        ("verify", "--study"),
        ("convert-curvature", "--scale"),
        ("demo", "--seed"),
        ("inspect", "--rho"),
        ("materialize", "--max-shard-size"),
    ],
)
def test_a_help_shows_its_flags_default_from_the_flag(command, flag):
    action = next(a for a in PARSERS[f"gradmerge {command}"]._actions if flag in a.option_strings)
    assert "%(default)" in (action.help or ""), f"{command} {flag}: default restated in its help"


def _setting_flags() -> dict[str, tuple[type, str]]:
    """Every flag of the estimator's options: flag → (owner, setting name)."""
    from gradmerge.estimate.options import EstimateOptions
    from gradmerge.foundation.settings import declared

    return {
        str(s.flag): (EstimateOptions, name)
        for name, s in declared(EstimateOptions).items()
        if s.flag
    }


READING = ("--loss", "--ignore-index")
"""The estimator's flags that every command reading MODEL and DATA has (``add_reading_arguments``);
``gradmerge curvature`` has them all."""


def test_a_setting_flag_has_one_description_its_settings():
    """``--mc-samples``, ``--loss``, ... of every command that has them: the help is the
    setting's description (docs/config.md's ``estimate`` table) in the command line's words
    and its default, never a second text; docs/config.md's flags table shows the same."""
    from gradmerge.foundation.settings import declared, default_of

    flags = _setting_flags()
    sections = _sections()
    seen = set()
    for command, action in _every_action():
        if not action.option_strings or action.option_strings[0] not in flags:
            continue
        if not command.endswith("curvature") and action.option_strings[0] not in READING:
            continue  # e.g. evaluate's --seed: the bootstrap's, another setting
        owner, name = flags[action.option_strings[0]]
        s = declared(owner)[name]
        words = {key: str(other.flag) for key, other in declared(owner).items() if other.flag}
        expected = f"{_flags.setting_help(s, words)}; default: {default_of(owner, name)}"
        assert action.help == expected, (command, s.flag)
        assert action.dest == name and action.default == default_of(owner, name), command
        single = "gradmerge " + command.rpartition(" ")[2]  # the data-parallel one: its rows
        page = sections.get(command, "") + sections.get(single, "")
        assert f"| {expected} |" in page, (command, s.flag)
        seen.add(s.flag)
    assert seen == set(flags)


def test_the_words_of_a_setting_on_the_command_line():
    """A setting named in a description is its flag; ``name: value`` the flag and the value."""
    from gradmerge.estimate.options import EstimateOptions
    from gradmerge.foundation.settings import declared

    options = declared(EstimateOptions)
    flags = {key: str(s.flag) for key, s in options.items() if s.flag}
    assert _flags.setting_help(options["mc_samples"], flags) == (
        "targets drawn per example for --fisher mc (--structure kfac refuses values other than "
        "1 with another --fisher)"
    )
    assert _flags.setting_help(options["max_params"], flags) == (
        "the largest model, in parameters, that --structure full accepts: its n × n matrix "
        "takes n² × 4 bytes in float32"
    )
    assert "`" not in _flags.setting_help(options["structure"], flags)


def test_no_command_writes_a_setting_flag_by_hand():
    """The modules that give commands the estimator's flags add none by hand (``demo`` and
    ``evaluate`` have a ``--seed`` of their own: other settings)."""
    names = "|".join(re.escape(flag) for flag in _setting_flags())
    by_hand = re.compile(r"add_argument\(\s*\"(?:" + names + r")\"")
    found = {
        name: by_hand.findall((ROOT / "gradmerge" / "commands" / name).read_text("utf-8"))
        for name in ("curvature.py", "_inputs.py", "distributed.py")
    }
    assert not {name: hits for name, hits in found.items() if hits}
