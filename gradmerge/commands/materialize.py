"""``gradmerge materialize ADAPTER OUT``: a LoRA adapter written as a full Hugging Face folder.

What it writes is :data:`DESCRIPTION` (the command's ``--help``, a string so that it survives
``python -OO``); the work is :func:`gradmerge.io.materialize.materialize`. Imports at the top are
light (no torch): the parser is built without them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gradmerge.commands._flags import ADAPTER_BASE, OVERWRITE
from gradmerge.commands._writes import Writes
from gradmerge.foundation.text import parse_size

DESCRIPTION = """\
Write the PEFT LoRA adapter ADAPTER applied to its base model as a full Hugging Face model folder
OUT: every LoRA target weight W + (lora_alpha/r)·B·A (rsLoRA, fan_in_fan_out and rank_pattern
honoured), the adapter's modules_to_save tensors, every other tensor the base's bit for bit, in
the base's dtypes, with the base's config and tokenizer files and a record
(gradmerge_materialize.json). It equals peft's merge_and_unload() saved with save_pretrained,
and any tool that reads a model folder reads it: mergekit's TIES/DARE, transformers, an
evaluation harness. gradmerge's own commands need no materialising: merge, remove, curvature,
gradient and evaluate take the adapter folder itself.

OUT appears only when complete; it may not be, lie inside or contain ADAPTER or its base.
"""

EPILOG = """\
examples:
  gradmerge materialize runs/lora-sst2 full/sst2
  gradmerge materialize runs/lora-sst2 full/sst2 --adapter-base models/minilm
  # then, e.g., TIES with mergekit over materialised adapters
  mergekit-yaml ties.yaml merged/   # models: full/sst2, full/imdb, ...; base_model: models/minilm
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge materialize``."""
    p = sub.add_parser(
        "materialize",
        help="write a LoRA adapter as a full model folder (base + merged LoRA) for other tools",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument("adapter", metavar="ADAPTER", help="a PEFT LoRA adapter folder")
    p.add_argument("out", metavar="OUT", help="the model folder to write")
    ADAPTER_BASE.add(p, which="ADAPTER: ", refused="")
    p.add_argument(
        "--max-shard-size",
        type=size,
        default="5GB",  # argparse converts a string default with type=
        metavar="SIZE",
        help="the largest shard: bytes, or e.g. 5GB, 500MB, 2GiB (default: %(default)s)",
    )
    OVERWRITE.add(p, what="an existing OUT")
    p.set_defaults(run=run, check=check, writes=writes)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage)."""
    if not (Path(args.adapter) / "adapter_config.json").is_file():  # no torch for a usage error
        parser.error(
            f"ADAPTER {args.adapter} is not a PEFT adapter folder (no adapter_config.json): a "
            "full model folder needs no materialising"
        )
    if args.adapter_base is not None and not Path(args.adapter_base).is_dir():
        parser.error(f"--adapter-base {args.adapter_base} is not a folder")


def size(text: str) -> int:
    """``--max-shard-size``: bytes, or a number with a unit (5GB, 500MB, 2GiB), above 0: read by
    :func:`gradmerge.foundation.text.parse_size` (the YAML key ``max_shard_size``'s reader too,
    and torch-free, so ``--help`` stays so), its refusal said as an argparse error.

    Example:
        >>> size("1.5GB"), size("2KiB"), size("100")
        (1500000000, 2048, 100)
    """
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive size such as 5GB, 500MB or 2GiB, got {text!r}"
        ) from None


def writes(args: argparse.Namespace) -> Writes:
    """The output guard's declaration: the folder OUT; ADAPTER and its base."""
    from gradmerge.foundation.guard import Output
    from gradmerge.io.materialize import inputs

    return Writes(
        [Output("OUT", Path(args.out), "folder")], inputs(args.adapter, args.adapter_base)
    )


def run(args: argparse.Namespace) -> int:
    """Materialise; 0 on success, 1 on bad input (one line on stderr; OUT is not written)."""
    from gradmerge.errors import GradmergeError
    from gradmerge.io.materialize import materialize

    try:
        done = materialize(
            args.adapter,
            args.out,
            base=args.adapter_base,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
        )
    except (GradmergeError, OSError) as err:
        print(f"gradmerge materialize: error: {err}", file=sys.stderr)
        return 1
    print(
        f"wrote {done.out_dir}: {done.tensors} tensors ({done.changed} changed by the adapter), "
        f"{done.bytes_written / 1e6:.1f} MB in {len(done.files)} files ({done.seconds:.1f} s)"
    )
    return 0
