"""``gradmerge evaluate MODEL [MODEL ...] DATA``: accuracy and mean loss of models on labelled data.

What it computes is :data:`DESCRIPTION`, the command's ``--help`` (a string, not this
docstring, so that the help survives ``python -OO``); the scores are
:func:`gradmerge.evaluation.evaluate`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from typing import Any

from gradmerge.commands._inputs import (
    DATA_HELP,
    MODEL_HELP,
    add_reading_arguments,
    check_reading,
    load,
    progress,
    provenance,
)
from gradmerge.commands._writes import Writes, file_output, reading_inputs

FORMAT = "gradmerge-evaluate/1"
DESCRIPTION = """\
Each MODEL (a Hugging Face classifier or causal LM folder, a LoRA adapter folder, or an entry
point) is scored on DATA, read as gradmerge curvature reads it (text with the model's own
tokenizer, tensor files, entry points; the same flags), in evaluation mode (no dropout), without
gradients (gradmerge.evaluation.evaluate):

- a classifier: accuracy = fraction of examples whose argmax logit is the label; mean loss = mean
  cross-entropy per example (nats);
- a causal LM: accuracy = fraction of next tokens predicted exactly; mean loss = negative
  log-likelihood per predicted token (nats; perplexity = its exp);
- --loss mse: mean of ½‖f − y‖² per example, no accuracy.

A table goes to stdout; --out FILE writes the figures as JSON (atomically; --out -:
JSON on stdout, the table on stderr). --per-example adds each example's loss, correct count
and prediction in DATA's order, so that models scored on the same DATA can be compared pair by
pair (a paired bootstrap of the accuracy difference resamples the indices of both lists alike).
"""
EXAMPLES = """\
examples:
  # three classifiers on a JSONL test set ({"text": ..., "label": "positive"} per line)
  gradmerge evaluate runs/ft-a runs/ft-b merged/ data/test.jsonl --max-length 128
  # JSON with every example's correctness, for paired bootstrap confidence intervals
  gradmerge evaluate merged/ta merged/gm data/test.jsonl --out scores.json --per-example
  # a causal LM on plain text (one example per line): next-token accuracy and loss per token
  gradmerge evaluate runs/ft-lm data/heldout.txt --max-length 512 --out -
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge evaluate``."""
    p = sub.add_parser(
        "evaluate",
        help="accuracy and mean loss of classifiers or causal LMs on labelled data",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    p.add_argument("models", metavar="MODEL", nargs="+", help=MODEL_HELP)
    p.add_argument("data", metavar="DATA", help=DATA_HELP)
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the figures as JSON to FILE ('-': to stdout, the table to stderr)",
    )
    p.add_argument(
        "--per-example",
        action="store_true",
        help="add each example's loss, correct count and prediction to the JSON",
    )
    add_reading_arguments(p)
    p.set_defaults(run=run, check=check, writes=writes)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage)."""
    check_reading(parser, args, args.models)
    if args.per_example and args.out is None:
        parser.error("--per-example adds lists to the JSON: give --out FILE (or --out -)")


def writes(args: argparse.Namespace) -> Writes:
    """The output guard's declaration: ``--out`` FILE, every MODEL (with a LoRA adapter's
    base), DATA and the reading flags' folders."""
    return Writes(file_output("--out", args.out), reading_inputs(args, args.models, [args.data]))


def run(args: argparse.Namespace) -> int:
    """``gradmerge evaluate``: 0 on success, 1 on bad input (one line of stderr, nothing
    written)."""
    from gradmerge.errors import GradmergeError

    try:
        return execute(args)
    except (GradmergeError, OSError) as err:
        print(f"gradmerge evaluate: error: {err}", file=sys.stderr)
        return 1


def execute(args: argparse.Namespace) -> int:
    """Score every MODEL, then print the table and write the JSON (only when all succeeded)."""
    from gradmerge._devices import resolve_device
    from gradmerge.evaluation import evaluate
    from gradmerge.io.text_data import TextBatches

    device = resolve_device(args.device)
    rows: list[dict[str, Any]] = []
    for spec in args.models:
        start = time.perf_counter()
        model, data = load(args, device, announce=True, model_spec=spec)
        order: list[int] | None = None
        batches: Iterable[Any] = data
        if isinstance(data, TextBatches):  # similar lengths together: less padding to compute
            batches, order = data.by_length()
        if not args.no_progress:
            batches = progress(batches, f"evaluate {spec}")
        result = evaluate(
            model, batches, loss=args.loss, ignore_index=args.ignore_index, device=device
        )
        if order is not None:
            result = result.in_order(order)
        row: dict[str, Any] = {"model": spec}
        if isinstance(data, TextBatches):
            row["task"] = data.task
        row.update(result.summary(per_example=args.per_example))
        row["seconds"] = round(time.perf_counter() - start, 3)
        row["provenance"] = provenance(args, device, data, model_spec=spec)
        rows.append(row)
    report = {"format": FORMAT, "data": args.data, "models": rows}
    table = _table(rows)
    if args.out == "-":
        print(table, file=sys.stderr)
        print(json.dumps(report, indent=1))
        return 0
    print(table)
    if args.out is not None:
        from gradmerge._guard import write_json

        write_json(report, args.out, "--out")
        print(f"wrote {args.out}")
    return 0


def _table(rows: list[dict[str, Any]]) -> str:
    """One line per model: examples (positions), accuracy, mean loss."""
    width = max(len("model"), *(len(r["model"]) for r in rows))
    lines = [f"{'model':<{width}}  {'examples':>8}  {'positions':>9}  {'accuracy':>8}  mean loss"]
    for r in rows:
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}"
        positions = r.get("positions", r["examples"])
        lines.append(
            f"{r['model']:<{width}}  {r['examples']:>8}  {positions:>9}  {accuracy:>8}  "
            f"{r['mean_loss']:.4f}"
        )
    return "\n".join(lines)
