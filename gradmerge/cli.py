"""The ``gradmerge`` command line: one module per subcommand in :mod:`gradmerge.commands`.

gradmerge verify              check every derivation of the appendix; exit 1 if one fails
gradmerge curvature MODEL DATA OUT  estimate a curvature (a SUM over examples) and save it
gradmerge gradient MODEL DATA OUT   the SUM of per-example loss gradients (Koh & Liang)
gradmerge convert-curvature SRC OUT convert a diagonal Fisher of the paper's official code
gradmerge inspect CURVATURE|CONFIG  exact scale of curvature files or a merge's H̄: δ window, κ
gradmerge merge CONFIG OUT_DIR      merge checkpoints (Eq. 6 and special cases), streaming
gradmerge remove CONFIG OUT_DIR     remove data from a model (Eq. 13, Koh & Liang), streaming
gradmerge refine CONFIG OUT_DIR     refine a merge on the tasks' data (gm.refine, Sec. 1.5)
gradmerge materialize ADAPTER OUT   a LoRA adapter as a full model folder, for other tools
gradmerge evaluate MODEL... DATA    accuracy and mean loss of models on labelled data (JSON)
gradmerge evaluate MODEL... --data DATA... --compare REF   several files; differences to REF with
                                    paired-bootstrap intervals, per file and mean over files
gradmerge tune CONFIG DATA...       choose α (and δ) on the tasks' training data, no test labels
gradmerge demo [--out DIR]          merge and un-merge MLPs on real data: table, JSON, plots
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence

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
from gradmerge.commands._writes import guard
from gradmerge.errors import MissingExtraError

# each has add_parser(subparsers); the parser's defaults carry run/check
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
    strings, never docstrings, so that they survive ``python -OO``."""
    parser = argparse.ArgumentParser(
        prog="gradmerge",
        description="Merge and un-merge fine-tuned models by uncertainty-based gradient matching.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradmerge`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check = getattr(args, "check", None)
        if check is not None:
            check(parser, args)
        guard(parser, args)  # the output guard, for every command that declares what it writes
        with one_line_warnings():
            return int(args.run(args))
    except MissingExtraError as err:  # an optional feature without its extra installed
        print(f"gradmerge {args.command}: error: {err}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """While the block runs, an :class:`~gradmerge.errors.InputWarning` is printed as one line,
    ``gradmerge: warning: MESSAGE``, without the file, line and Python source that Python's
    format adds (they name gradmerge's code, not the user's input). Other warnings, and the
    filters (``warnings.simplefilter("ignore", gm.InputWarning)``), are unchanged."""
    from gradmerge.errors import InputWarning

    default = warnings.formatwarning

    def one_line(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        line: str | None = None,
    ) -> str:
        if issubclass(category, InputWarning):
            return f"gradmerge: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = default


if __name__ == "__main__":
    sys.exit(main())
