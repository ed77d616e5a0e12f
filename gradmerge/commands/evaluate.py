"""``gradmerge evaluate MODEL... DATA`` or ``MODEL... --data DATA...``: accuracy and mean loss of
models on labelled data, and with ``--compare REF`` each model's difference to REF with paired
bootstrap intervals.

What it computes is :data:`DESCRIPTION`, the command's ``--help`` (a string, not this
docstring, so that the help survives ``python -OO``); the scores are
:func:`gradmerge.evaluation.evaluate`'s, the intervals
:func:`gradmerge.bootstrap.paired_bootstrap`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradmerge.bootstrap import PairedBootstrap
    from gradmerge.evaluation import Evaluation

from gradmerge.commands._inputs import (
    DATA_HELP,
    MODEL_HELP,
    add_autocast_argument,
    add_reading_arguments,
    autocast_dtype,
    check_reading,
    load_data,
    load_model,
    progress,
    provenance,
)
from gradmerge.commands._same_inputs import same_inputs
from gradmerge.commands._writes import Writes, file_output, reading_inputs

FORMAT = "gradmerge-evaluate/2"
RESAMPLES = 2000
"""--resamples by default (:func:`gradmerge.bootstrap.paired_bootstrap`'s, checked by a test)."""
SEED = 0
"""--seed by default (the bootstrap's)."""
LEVEL = 0.95
USAGE = """\
gradmerge evaluate MODEL [MODEL ...] DATA [options]
       gradmerge evaluate MODEL [MODEL ...] --data DATA [DATA ...] [--compare REF [REF ...]]
                          [options]"""
DESCRIPTION = f"""\
Each MODEL (a Hugging Face classifier or causal LM folder, a LoRA adapter folder, or an entry
point) is scored on each DATA, read as gradmerge curvature reads it (text with the model's own
tokenizer, tensor files, entry points; the same flags), in evaluation mode (no dropout), without
gradients (gradmerge.evaluation.evaluate). One DATA: the last argument; several: --data A B ...
(then every argument before it is a MODEL). Figures:

- a classifier: accuracy = fraction of examples whose argmax logit is the label; mean loss = mean
  cross-entropy per example (nats);
- a causal LM: accuracy = fraction of next tokens predicted exactly; mean loss = negative
  log-likelihood per predicted token (nats; perplexity = its exp);
- --loss mse: mean of ½‖f − y‖² per example, no accuracy.

--compare REF (REF one of the MODELs, by its path as given or by its folder's name) adds each
other model's difference to REF, accuracy(model) − accuracy(REF) and mean loss(model) − mean
loss(REF), per DATA and pooled, with 95% paired-bootstrap intervals over the test examples
(gradmerge.bootstrap): each resample draws every DATA's examples with replacement, the same ones
for the model and REF; the pooled figure is the MEAN OVER DATA of the per-DATA figures (every
DATA counts alike, as merging papers average accuracy over tasks), resampled within each DATA
(stratified). Percentile intervals, --resamples (default {RESAMPLES:,}) draws seeded by --seed
(default {SEED}): the same seed gives the same intervals. Several REFs (--compare A B) compare every
other model with each, in one pass (each model scored once; every comparison on the same draws,
as separate runs would give). Only like figures are compared: a classifier's accuracy per example
with a causal LM's per token is refused (exit 2).

A MODEL or DATA given twice under two spellings (d/a.jsonl, d/./a.jsonl, a symlink), and two DATA
files holding the same bytes, are refused (exit 2): a test set counted twice narrows every
interval. --autocast on a model stored in the other 16-bit dtype (bfloat16 weights, --autocast
float16, or the reverse) upcasts its weights to float32 first (exact; said on stderr), as
autocast of a float32 model then runs.

Tables go to stdout; --out FILE writes the figures as JSON (atomically; --out -: JSON on stdout,
the tables on stderr). --per-example adds each example's loss, correct count and prediction in
DATA's order. Any model failing on any DATA fails the command (exit 1, naming both; nothing
written).
"""
EXAMPLES = """\
examples:
  # three classifiers on a JSONL test set ({"text": ..., "label": "positive"} per line)
  gradmerge evaluate runs/ft-a runs/ft-b merged/ data/test.jsonl --max-length 128
  # two merges on three tasks' test sets, each against task arithmetic, pooled over the tasks
  gradmerge evaluate merged/ta merged/gm --data a.jsonl b.jsonl c.jsonl --compare ta \\
      --out scores.json
  # a tuned merge against task arithmetic and against the fine-tune, in one pass
  gradmerge evaluate merged/ta merged/tuned runs/ft-a --data a.jsonl --compare ta ft-a
  # a causal LM on plain text (one example per line): next-token accuracy and loss per token
  gradmerge evaluate runs/ft-lm data/heldout.txt --max-length 512 --out -
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge evaluate``."""
    p = sub.add_parser(
        "evaluate",
        help="accuracy and mean loss of classifiers or causal LMs on labelled data; with "
        "--compare, differences to a reference with paired-bootstrap intervals",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    p.add_argument(
        "paths",
        metavar="MODEL",
        nargs="+",
        help=f"{MODEL_HELP}; without --data the last one is DATA: {DATA_HELP}",
    )
    p.add_argument(
        "--data",
        dest="datas",
        nargs="+",
        action="extend",
        default=None,
        metavar="DATA",
        help="the labelled data (one or several; each MODEL is scored on each): " + DATA_HELP,
    )
    p.add_argument(
        "--compare",
        nargs="+",
        action="extend",
        default=None,
        metavar="REF",
        help="one or several of the MODELs (each by its path as given, or its folder's name): "
        "every other model's difference to each, per DATA and mean over DATA, with 95%% "
        "paired-bootstrap intervals",
    )
    p.add_argument(
        "--resamples",
        type=int,
        default=None,
        help=f"bootstrap resamples of --compare (default {RESAMPLES:,})",
    )
    p.add_argument(
        "--seed", type=int, default=None, help=f"seed of --compare's resamples (default {SEED})"
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the figures as JSON to FILE ('-': to stdout, the tables to stderr)",
    )
    p.add_argument(
        "--per-example",
        action="store_true",
        help="add each example's loss, correct count and prediction to the JSON",
    )
    add_reading_arguments(p)
    add_autocast_argument(p)
    p.set_defaults(run=run, check=check, writes=writes)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage); set
    ``args.models``, ``args.datas`` and ``args.references`` (the REFs' indices, empty without
    ``--compare``)."""
    for ref in args.compare or ():
        if Path(ref).is_file():  # --compare takes every argument after it
            parser.error(
                f"--compare {ref}: a file, not a MODEL (REF is one of the MODELs); --compare "
                "takes every argument after it: give DATA before --compare, or as --data DATA..."
            )
    if args.datas is None:
        if len(args.paths) < 2:
            parser.error(
                "give MODEL... DATA (the last argument is DATA) or MODEL... --data DATA...; "
                f"only {args.paths[0]} was given"
            )
        args.models, args.datas = args.paths[:-1], args.paths[-1:]
    else:
        args.models = args.paths
    for data in args.datas:
        if (Path(data) / "config.json").is_file():  # --data takes every argument after it
            parser.error(
                f"DATA {data} is a model folder (it holds config.json): give the MODELs before "
                "--data DATA..."
            )
    for flag in ("--data", "MODEL"):
        values = args.datas if flag == "--data" else args.models
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            parser.error(f"{flag} {', '.join(repeated)} given twice; give each once")
    for data in args.datas:
        check_reading(parser, args, args.models, data)
    for role, values, contents in (("MODEL", args.models, False), ("DATA", args.datas, True)):
        same = same_inputs(role, values, contents=contents)
        if same is not None:
            parser.error(same)
    args.references = []
    if args.compare is None:
        for flag, value in (("--resamples", args.resamples), ("--seed", args.seed)):
            if value is not None:
                parser.error(f"{flag} applies to --compare REF; give --compare")
    else:
        args.references = [reference(parser, args.models, ref) for ref in args.compare]
        twice = sorted({i for i in args.references if args.references.count(i) > 1})
        if twice:
            parser.error(f"--compare names MODEL {args.models[twice[0]]} twice; give each REF once")
        if len(args.models) < 2:
            parser.error("--compare needs at least two MODELs: REF and a model to compare to it")
        if args.resamples is not None and args.resamples < 1:
            parser.error(f"--resamples must be at least 1, got {args.resamples}")
        if args.seed is not None and args.seed < 0:
            parser.error(f"--seed must be a non-negative integer, got {args.seed}")
    if args.per_example and args.out is None:
        parser.error("--per-example adds lists to the JSON: give --out FILE (or --out -)")


def writes(args: argparse.Namespace) -> Writes:
    """The output guard's declaration: ``--out`` FILE, every MODEL (with a LoRA adapter's
    base), every DATA and the reading flags' folders (after :func:`check`, which sets
    ``args.models`` and ``args.datas``)."""
    return Writes(file_output("--out", args.out), reading_inputs(args, args.models, args.datas))


def reference(parser: argparse.ArgumentParser, models: Sequence[str], ref: str) -> int:
    """The index of REF among ``models``: the MODEL given as ``ref``, else the one at the same
    path, else the one whose folder's name is ``ref`` (argparse error when none or several)."""
    if ref in models:
        return models.index(ref)
    same = [i for i, m in enumerate(models) if Path(ref).exists() and _same_path(m, ref)]
    if not same:
        same = [i for i, m in enumerate(models) if _name(m) == ref]
    if len(same) == 1:
        return same[0]
    if same:
        parser.error(
            f"--compare {ref} names several MODELs ({', '.join(models[i] for i in same)}); give "
            "REF's path as given among the MODELs"
        )
    parser.error(
        f"--compare {ref} is not among the MODELs; give one of them by its path as given "
        f"({', '.join(models)}) or by its folder's name ({', '.join(map(_name, models))})"
    )


def _same_path(model: str, ref: str) -> bool:
    return Path(model).exists() and Path(model).resolve() == Path(ref).resolve()


def _name(model: str) -> str:
    """What ``--compare`` may call a MODEL: its folder's (or file's) name; an entry point as
    given."""
    path = Path(model)
    return path.name if path.exists() and path.name else model


def run(args: argparse.Namespace) -> int:
    """``gradmerge evaluate``: 0 on success, 1 on bad input (one line of stderr, nothing
    written), 2 for a comparison of unlike figures (:class:`~gradmerge.errors.ComparisonError`,
    an argument error found once the models are scored)."""
    from gradmerge.errors import ComparisonError, GradmergeError

    try:
        return execute(args)
    except (GradmergeError, OSError) as err:
        print(f"gradmerge evaluate: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ComparisonError) else 1


def execute(args: argparse.Namespace) -> int:
    """Score every MODEL on every DATA (the REFs first, so that a comparison of unlike figures
    stops at the first model that has them), compare them with each REF, then print the tables
    and write the JSON (only when all succeeded)."""
    from gradmerge.foundation.devices import resolve_device
    from gradmerge.io.text_data import TextBatches

    device = resolve_device(args.device)
    results: dict[tuple[int, int], Evaluation] = {}
    scored: dict[tuple[int, int], dict[str, Any]] = {}
    order = [*args.references, *(i for i in range(len(args.models)) if i not in args.references)]
    for i in order:
        spec = args.models[i]
        with _where(spec):
            model = autocast_ready(args, load_model(args, device, spec), spec)
        for j, data_spec in enumerate(args.datas):
            start = time.perf_counter()
            with _where(spec, data_spec):
                result, data = _score(args, device, model, spec, data_spec)
            results[i, j] = result
            check_like(args, results, i, j)
            row: dict[str, Any] = {"model": spec, "data": data_spec}
            if isinstance(data, TextBatches):
                row["task"] = data.task
            row.update(result.summary(per_example=args.per_example))
            row["seconds"] = round(time.perf_counter() - start, 3)
            row["provenance"] = provenance(args, device, data, model_spec=spec, data_spec=data_spec)
            scored[i, j] = row
        del model  # one model in memory at a time
    rows = [scored[i, j] for i in range(len(args.models)) for j in range(len(args.datas))]
    report: dict[str, Any] = {
        "format": FORMAT,
        "data": list(args.datas),
        "models": rows,
        "mean_over_data": _means(args, results),
    }
    tables = [_table(rows)]
    if len(args.datas) > 1:
        tables.append(_means_table(report["mean_over_data"], len(args.datas)))
    if args.references:
        comparisons = [compare(args, results, ref) for ref in args.references]
        # "comparison": the first REF's, as before several REFs were taken; "comparisons": each
        report["comparison"], report["comparisons"] = comparisons[0], comparisons
        tables += [_comparison_table(c, args.datas) for c in comparisons]
    text = "\n\n".join(tables)
    if args.out == "-":
        print(text, file=sys.stderr)
        print(json.dumps(report, indent=1))
        return 0
    print(text)
    if args.out is not None:
        from gradmerge.foundation.guard import write_json

        write_json(report, args.out, "--out")
        print(f"wrote {args.out}")
    return 0


def _score(
    args: argparse.Namespace, device: torch.device, model: nn.Module, spec: str, data_spec: str
) -> tuple[Evaluation, Iterable[Any]]:
    """MODEL ``spec``'s :class:`~gradmerge.evaluation.Evaluation` on DATA ``data_spec`` (in
    DATA's order), and the data read."""
    from gradmerge.evaluation import evaluate
    from gradmerge.io.text_data import TextBatches

    data = load_data(args, model, spec, data_spec, announce=True)
    order: list[int] | None = None
    batches: Iterable[Any] = data
    if isinstance(data, TextBatches):  # similar lengths together: less padding to compute
        batches, order = data.by_length()
    if not args.no_progress:
        batches = progress(batches, f"evaluate {spec} on {data_spec}")
    result = evaluate(
        model,
        batches,
        loss=args.loss,
        ignore_index=args.ignore_index,
        device=device,
        autocast=autocast_dtype(args.autocast),
    )
    return (result if order is None else result.in_order(order)), data


@contextmanager
def _where(spec: str, data_spec: str | None = None) -> Iterator[None]:
    """Gradmerge errors raised inside, prefixed with the MODEL (and DATA) they came from."""
    from gradmerge.errors import GradmergeError

    try:
        yield
    except GradmergeError as err:
        where = f"MODEL {spec}" + ("" if data_spec is None else f" on DATA {data_spec}")
        raise type(err)(f"{where}: {err}") from err


def _means(
    args: argparse.Namespace, results: dict[tuple[int, int], Evaluation]
) -> list[dict[str, Any]]:
    """Per MODEL, the mean over DATA of its accuracy and of its mean loss (every DATA alike)."""
    import math

    out = []
    for i, spec in enumerate(args.models):
        scores = [results[i, j] for j in range(len(args.datas))]
        accuracies = [r.accuracy for r in scores if r.accuracy is not None]
        out.append(
            {
                "model": spec,
                "accuracy": math.fsum(accuracies) / len(scores) if accuracies else None,
                "mean_loss": math.fsum(r.mean_loss for r in scores) / len(scores),
            }
        )
    return out


def autocast_ready(args: argparse.Namespace, model: nn.Module, spec: str) -> nn.Module:
    """``model``, upcast to float32 when ``--autocast`` asks for the other 16-bit dtype than its
    weights' (:func:`gradmerge.evaluation.autocast_conflict`: bfloat16 weights under float16
    autocast, or the reverse, which torch cannot run). The upcast is exact (every bfloat16 and
    float16 value is a float32), so the scores are those of autocast on the float32 model: each
    autocast op casts the weights to the autocast dtype, the others run in float32. Said on
    stderr, with the memory it costs."""
    from gradmerge.evaluation import autocast_conflict

    dtype = autocast_dtype(args.autocast)
    stored = autocast_conflict(model, dtype)
    if stored is None:
        return model
    print(
        f"MODEL {spec}: {str(stored).removeprefix('torch.')} weights under --autocast "
        f"{args.autocast}: upcast to float32 (exact; twice the memory) and scored as autocast "
        "scores a float32 model",
        file=sys.stderr,
    )
    return model.float()


def check_like(
    args: argparse.Namespace, results: dict[tuple[int, int], Evaluation], i: int, j: int
) -> None:
    """Refuse a comparison of unlike figures as soon as MODEL ``i`` is scored on DATA ``j``: its
    loss function and level (per example or per token) must be each REF's.

    Raises:
        ComparisonError: MODEL ``i`` and a REF measured different things on DATA ``j`` (a
            causal LM's next-token accuracy and a classifier's per-example accuracy).
    """
    from gradmerge.errors import ComparisonError

    for ref in args.references:
        if ref == i or (ref, j) not in results:
            continue
        mine, theirs = _figure(results[i, j]), _figure(results[ref, j])
        if mine != theirs:
            raise ComparisonError(
                f"--compare: MODEL {args.models[i]} is scored by {mine} on DATA {args.datas[j]} "
                f"but REF {args.models[ref]} by {theirs}: their difference would mean nothing; "
                "compare models of one kind (classifiers with classifiers, causal LMs with "
                "causal LMs)"
            )


def _figure(result: Evaluation) -> str:
    """What ``result``'s accuracy and loss measure, in words."""
    if result.loss != "cross_entropy":
        return f"{result.loss} per example (no accuracy)"
    if result.token_level:
        return "next-token accuracy and loss per token (a causal LM, or labels per position)"
    return "accuracy and loss per example (a classifier)"


def compare(
    args: argparse.Namespace, results: dict[tuple[int, int], Evaluation], ref: int
) -> dict[str, Any]:
    """Every MODEL but REF (MODEL ``ref``) against it: accuracy and mean-loss differences per
    DATA and their mean over DATA, with paired-bootstrap intervals
    (:func:`gradmerge.bootstrap.paired_bootstrap`, the same draws for every model, both figures
    and every REF: the same seed and DATA sizes give the same resampled examples).

    Raises:
        StructureError: a MODEL scored a different number of examples than REF on some DATA
            (an entry point that yields other data on each call): no pairs to compare.
    """
    from gradmerge.bootstrap import paired_bootstrap
    from gradmerge.errors import StructureError

    resamples = RESAMPLES if args.resamples is None else args.resamples
    seed = SEED if args.seed is None else args.seed
    datas = range(len(args.datas))
    out: dict[str, Any] = {
        "reference": args.models[ref],
        "method": "paired bootstrap over test examples, stratified by DATA; percentile intervals",
        "pooled": "mean over DATA of the per-DATA figure (every DATA counts alike)",
        "level": LEVEL,
        "resamples": resamples,
        "seed": seed,
        "models": [],
    }
    for i, spec in enumerate(args.models):
        if i == ref:
            continue
        for j in datas:
            if results[i, j].examples != results[ref, j].examples:
                raise StructureError(
                    f"MODEL {spec} scored {results[i, j].examples} examples of DATA "
                    f"{args.datas[j]} but REF {args.models[ref]} {results[ref, j].examples}: a "
                    "paired comparison needs the same examples (an entry point must yield the "
                    "same data on every call)"
                )
        figures: dict[str, PairedBootstrap | None] = {}
        for figure, values in (
            ("accuracy", lambda r: r.correct_per_example),
            ("mean_loss", lambda r: r.loss_per_example),
        ):
            if any(values(results[k, j]) is None for k in (i, ref) for j in datas):
                figures[figure] = None  # --loss mse: no accuracy
                continue
            figures[figure] = paired_bootstrap(
                [values(results[i, j]) for j in datas],
                [values(results[ref, j]) for j in datas],
                a_weights=_weights([results[i, j] for j in datas]),
                b_weights=_weights([results[ref, j] for j in datas]),
                resamples=resamples,
                seed=seed,
                level=LEVEL,
            )
        out["models"].append(
            {
                "model": spec,
                "data": [
                    {"data": args.datas[j]}
                    | {f: None if b is None else b.strata[j].to_dict() for f, b in figures.items()}
                    for j in datas
                ],
                "pooled": {
                    f: None if b is None else b.pooled.to_dict() for f, b in figures.items()
                },
            }
        )
    return out


def _weights(results: Sequence[Evaluation]) -> list[list[int]] | None:
    """Scored positions per example on each DATA (the weight of each example's correct count
    and loss); ``None``: one per example (mse)."""
    weights = [r.positions_per_example for r in results]
    return None if any(w is None for w in weights) else [w for w in weights if w is not None]


def _table(rows: list[dict[str, Any]]) -> str:
    """One line per model and DATA: examples (positions), accuracy, mean loss."""
    width = max(len("model"), *(len(r["model"]) for r in rows))
    data_width = max(len("data"), *(len(r["data"]) for r in rows))
    lines = [
        f"{'model':<{width}}  {'data':<{data_width}}  {'examples':>8}  {'positions':>9}  "
        f"{'accuracy':>8}  mean loss"
    ]
    for r in rows:
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}"
        positions = r.get("positions", r["examples"])
        lines.append(
            f"{r['model']:<{width}}  {r['data']:<{data_width}}  {r['examples']:>8}  "
            f"{positions:>9}  {accuracy:>8}  {r['mean_loss']:.4f}"
        )
    return "\n".join(lines)


def _means_table(means: list[dict[str, Any]], count: int) -> str:
    """Per model, the mean over the ``count`` DATA of accuracy and mean loss."""
    width = max(len("model"), *(len(m["model"]) for m in means))
    lines = [f"mean over {count} DATA", f"{'model':<{width}}  {'accuracy':>8}  mean loss"]
    for m in means:
        accuracy = "-" if m["accuracy"] is None else f"{m['accuracy']:.4f}"
        lines.append(f"{m['model']:<{width}}  {accuracy:>8}  {m['mean_loss']:.4f}")
    return "\n".join(lines)


def _comparison_table(comparison: dict[str, Any], datas: Sequence[str]) -> str:
    """Per model and DATA (and mean over DATA): the differences to REF and their intervals."""

    def cell(figure: dict[str, Any] | None) -> str:
        if figure is None:
            return "-"
        low, high = figure["interval"]
        return f"{figure['difference']:+.4f} [{low:+.4f}, {high:+.4f}]"

    pooled = f"mean over {len(datas)} DATA"
    lines = []
    for entry in comparison["models"]:
        named = [(d["data"], d) for d in entry["data"]]
        if len(datas) > 1:
            named.append((pooled, entry["pooled"]))
        for data, figures in named:
            lines.append(
                (entry["model"], data, cell(figures["accuracy"]), cell(figures["mean_loss"]))
            )
    header = ("model", "data", "accuracy", "mean loss")
    widths = [max(len(h), *(len(line[k]) for line in lines)) for k, h in enumerate(header)]
    title = (
        f"difference to REF {comparison['reference']} ({comparison['level']:.0%} paired-bootstrap "
        f"intervals, {comparison['resamples']:,} resamples, seed {comparison['seed']})"
    )
    out = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    out += [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    return "\n".join(out)
