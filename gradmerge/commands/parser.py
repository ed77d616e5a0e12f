"""The ``gradmerge`` parser: every subcommand of :mod:`gradmerge.commands` registered.

Here, not in :mod:`gradmerge.cli` (which runs it), so that the commands' own tools read it
without importing the entry point: :mod:`gradmerge.commands.reference` writes every command's
arguments into docs/config.md from it.

Example:
    >>> sorted(build_parser().parse_args(["verify"]).__dict__)[:2]
    ['check', 'command']
"""

from __future__ import annotations

import argparse

from gradmerge._version import __version__
from gradmerge.commands import (
    convert_curvature,
    curvature,
    demo,
    evaluate,
    gradient,
    inspect,
    materialize,
    merge,
    refine,
    remove,
    tune,
    verify,
)

# each has add_parser(subparsers); the parser's defaults carry run/check. Building the parser and
# printing any help imports no torch (proofs_tests/unit/cli/test_cli_start.py): a command module
# imports what its run needs inside run.
COMMANDS = [
    verify,
    curvature,
    gradient,
    convert_curvature,
    inspect,
    merge,
    remove,
    refine,
    materialize,
    evaluate,
    tune,
    demo,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``gradmerge`` parser with every subcommand registered. Help texts are explicit
    strings, never docstrings, so that they survive ``python -OO``. Each subcommand's parser is
    its namespace's ``command_parser``, so that its checks fail as ``gradmerge CMD: error:``
    with that command's usage."""
    parser = argparse.ArgumentParser(
        prog="gradmerge",
        description="Merge and un-merge fine-tuned models by uncertainty-based gradient matching.",
        epilog="`gradmerge COMMAND --help` shows a command's arguments, with examples.",
    )
    parser.add_argument(
        "--version", action="version", version=f"gradmerge {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for command in COMMANDS:
        command.add_parser(sub)
    for subparser in sub.choices.values():
        subparser.set_defaults(command_parser=subparser)
    return parser
