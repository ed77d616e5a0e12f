"""docs/config.md's generated blocks: the settings' tables and every command's arguments.

The tables of YAML keys and options come from the settings' declarations
(:func:`gradmerge.jobs.reference.tables`); the ``flags`` block lists each command's arguments —
name, default and help — read from the argparse parsers themselves
(:func:`gradmerge.commands.parser.build_parser` and, for what the data-parallel entry point adds,
:func:`gradmerge.commands.distributed.build_parser`), so the page says what ``gradmerge CMD --help``
says. ``proofs_tests/docs/test_config_reference.py`` and
``proofs_tests/docs/test_flags_reference.py`` check that the committed page equals what
:func:`tables` gives; after changing a declaration or a flag, rewrite the page with

    python -m gradmerge.commands.reference docs/config.md

Example:
    >>> "| `--device {auto,cpu,cuda}` | `auto` |" in flags()
    True
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from gradmerge.jobs import reference


def tables() -> dict[str, str]:
    """Every generated block of docs/config.md, by name: the settings' tables and ``flags``."""
    return {**reference.tables(), "flags": flags()}


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its command line (``gradmerge curvature``, ...; the
    data-parallel entry point's as ``torchrun ... distributed merge``)."""
    from gradmerge.commands import distributed
    from gradmerge.commands.parser import build_parser

    found = {f"gradmerge {name}": p for name, p in _commands(build_parser()).items()}
    for name, p in _commands(distributed.build_parser()).items():
        found[f"torchrun -m gradmerge.commands.distributed {name}"] = p
    return found


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments ``--help`` shows (``-h`` and hidden ones, e.g. renamed flags, left out)."""
    return [
        a
        for a in parser._actions
        if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


def flags() -> str:
    """Per command, a table of its arguments: name (with the value's form), default, help.

    Under the data-parallel entry point only the arguments that differ from the single-process
    command's are listed (its ``curvature`` is ``gradmerge curvature`` with ``--distributed``
    implied; its ``merge`` and ``remove`` add ``--timeout``).
    """
    every = parsers()
    parts = []
    for command, parser in every.items():
        rows = [_row(a, parser) for a in arguments(parser)]
        single = every.get("gradmerge " + command.rpartition(" ")[2])
        if single is not None and single is not parser:
            rows = [r for r in rows if r not in {_row(a, single) for a in arguments(single)}]
            if not rows:
                continue
        head = ["| argument | default | meaning |", "| --- | --- | --- |"]
        parts.append(f"`{command}`:\n\n" + "\n".join([*head, *rows]) + "\n")
    return "\n".join(parts)


def _row(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    cells = [f"`{_name(action)}`", _default(action), _help(action, parser)]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest) + (" ..." if action.nargs == "+" else "")
    value = "" if action.nargs == 0 else " " + _value(action)
    return ", ".join(name + value for name in action.option_strings)


def _value(action: argparse.Action) -> str:
    if action.metavar is not None:
        text = str(action.metavar)
    elif action.choices is not None:
        text = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        text = action.dest.upper()
    return text + (" ..." if action.nargs == "+" else "")


def _default(action: argparse.Action) -> str:
    value: Any = action.default
    if not action.option_strings:
        return "required"
    if action.required:
        return "required"
    if action.nargs == 0:
        return "off"
    if value is None or value == []:
        return "—"
    return f"`{value}`"


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    """The help as ``--help`` prints it (``%(default)s`` and ``%%`` expanded), on one line."""
    text = parser._get_formatter()._expand_help(action)
    return re.sub(r"\s+", " ", text).strip()


def render(text: str) -> str:
    """``text`` (docs/config.md) with every generated block replaced (:func:`tables`)."""
    return reference.render(text, tables())


def main(argv: list[str] | None = None) -> int:
    """``python -m gradmerge.commands.reference PAGE``: rewrite PAGE's generated blocks."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gradmerge.commands.reference docs/config.md", file=sys.stderr)
        return 2
    page = Path(args[0])
    page.write_text(render(page.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
