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
gradmerge tune CONFIG DATA...       choose scale (and δ) on the tasks' training data, no test labels
gradmerge demo [--out DIR]          merge and un-merge MLPs on real data: table, JSON, plots
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from gradmerge.commands._writes import guard
from gradmerge.commands.parser import COMMANDS as COMMANDS
from gradmerge.commands.parser import build_parser
from gradmerge.errors import MissingExtraError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradmerge`` command.

    ``gradmerge`` alone prints the help on standard output and exits 0, as ``--help`` does:
    a bare command is a request for help, not a usage error (argparse's exit 2 stays for
    arguments it refuses)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None and not unknown:
        parser.print_help()
        return 0
    command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
    if unknown:  # argparse reports them with the top-level usage; they are the command's
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with one_line_warnings(args.command), quiet_progress(getattr(args, "no_progress", False)):
            check = getattr(args, "check", None)
            if check is not None:
                check(command_parser, args)
            guard(command_parser, args)  # the output guard, for every command declaring writes
            return int(args.run(args))
    except MissingExtraError as err:  # an optional feature without its extra installed
        print(f"gradmerge {args.command}: error: {err}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def one_line_warnings(command: str = "") -> Iterator[None]:
    """While the block runs, every warning is printed as one line,
    ``gradmerge COMMAND: warning: MESSAGE``, without the file, line and Python source that
    Python's format adds (they name code, not the user's input); a warning that is not
    gradmerge's own (:class:`~gradmerge.errors.InputWarning`, its ``SelectionWarning``) ends
    with its category, ``(UserWarning)``. The filters
    (``warnings.simplefilter("ignore", gm.InputWarning)``) are unchanged."""
    from gradmerge.errors import InputWarning

    default = warnings.formatwarning
    prefix = f"gradmerge {command}" if command else "gradmerge"

    def one_line(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        line: str | None = None,
    ) -> str:
        text = " ".join(str(message).split())
        if not issubclass(category, InputWarning):
            text += f" ({category.__name__})"
        return f"{prefix}: warning: {text}\n"

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = default


HUB_PROGRESS = "HF_HUB_DISABLE_PROGRESS_BARS"
"""The variable huggingface_hub (and transformers with it) reads on import: progress bars off."""


@contextlib.contextmanager
def quiet_progress(quiet: bool) -> Iterator[None]:
    """With ``quiet`` (``--no-progress``), no progress bar while the block runs: gradmerge's own
    bars are the commands' (they test the flag); Hugging Face's ("Loading weights", downloads)
    are turned off here, through ``transformers.utils.logging`` or huggingface_hub when they are
    loaded already, through :data:`HUB_PROGRESS` for an import inside the block. Afterwards
    everything is as it was, so that a caller's own bars (a notebook calling :func:`main`) come
    back (but for huggingface_hub's download bars when it was first imported inside the block:
    it keeps the variable's value). Imports nothing: a command that reads no Hugging Face folder
    pays nothing."""
    if not quiet:
        yield
        return
    import os

    def hub_utils() -> Any:
        return sys.modules.get("huggingface_hub.utils")

    logging = sys.modules.get("transformers.utils.logging")
    before = os.environ.get(HUB_PROGRESS)
    was_on = (
        logging.is_progress_bar_enabled()
        if logging is not None
        else not hub_utils().are_progress_bars_disabled()
        if hub_utils() is not None
        else before is None or before.strip().lower() not in ("1", "on", "yes", "true")
    )
    os.environ[HUB_PROGRESS] = "1"
    if logging is not None:
        logging.disable_progress_bar()
    elif hub_utils() is not None:
        hub_utils().disable_progress_bars()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HUB_PROGRESS, None)
        else:
            os.environ[HUB_PROGRESS] = before
        logging = sys.modules.get("transformers.utils.logging")
        with warnings.catch_warnings():  # imported inside the block, huggingface_hub keeps the
            warnings.simplefilter("ignore")  # variable's value and says so when asked for bars
            if was_on and logging is not None:
                logging.enable_progress_bar()
            elif was_on and hub_utils() is not None:
                hub_utils().enable_progress_bars()


if __name__ == "__main__":
    sys.exit(main())
