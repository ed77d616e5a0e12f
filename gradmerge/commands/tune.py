"""``gradmerge tune CONFIG DATA [DATA ...] --scales GRID``: choose the scale (and δ) without test
labels.

What it does is :data:`DESCRIPTION`, the command's ``--help`` (a string, not this docstring,
so that the help survives ``python -OO``); the grid and the criteria are :mod:`gradmerge.jobs.tune`.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradmerge.commands._inputs import (
    DATA_HELP,
    Renamed,
    add_autocast_argument,
    add_reading_arguments,
    autocast_dtype,
    check_reading,
)
from gradmerge.commands._writes import Writes, file_output, reading_inputs
from gradmerge.io.forms import BATCH_SIZE

if TYPE_CHECKING:  # imported where used: the parser and --help need no torch
    import torch

CRITERIA = ("loss", "mismatch")
"""gradmerge.jobs.tune.CRITERIA, written out so that the parser imports no torch (a test checks
they are the same)."""

FORMAT = "gradmerge-tune/1"
DESCRIPTION = """\
Runs the merge of CONFIG (a gradmerge merge YAML file, any method) once per point of the grid
--scales × --deltas × --prior-scales and scores each merged model on the tasks' own
TRAINING data — DATA, one file per model of CONFIG, in the order of its models: — read as
gradmerge curvature reads data (the same flags). No test or validation label is read; the
training data's labels are. --base-data DATA adds the base model's own training data (the task
base_model was trained on) as one more task, scored like the others and reported separately. The
criterion is a sum of one term per task, each task weighted alike; the grid point of least
criterion is chosen (gradmerge.jobs.tune):

- --criterion loss (default, recommended): Σ_t L̄_t(θ), each task's mean training loss (per
  example for a classifier, per token for a causal LM), the base task's included;
- --criterion mismatch (a diagnostic, warns): Σ_t ‖∇ℓ̄_t(θ) − ∇ℓ̄_t(θ_t)‖₂ / N_t, Eq. 2's
  gradient mismatch of the mean gradients, ∇ℓ̄_t(θ_t) taken at the fine-tuned model θ_t of CONFIG
  (at base_model for the base task; one more backward pass per task and point). It measures how
  far the merge is from each fine-tune, so it prefers the point nearest to them (scale = 1/T
  for tasks alike) whatever the data say: docs/guide.md, "Choosing the scale without labels".

--scales sets CONFIG's scale (every model's α_t becomes scale·α_t); --deltas and
--prior-scales set gradient matching's prior: {delta, scale}. A table goes to stdout (per point
the criterion and each task's term); --out FILE writes the JSON (the chosen setting, whether it
is at the grid's edge, and per point the criterion and every task's term, training loss and
accuracy); --out-dir DIR keeps the chosen merged model (with its gradmerge_merge.json). Points
whose merge fails (e.g. δ too small to solve) are listed with their error and skipped. A choice
at the lowest or highest value of a grid warns: the best setting may lie beyond it.

Tasks with their own heads over one merged body (--task-heads 'classifier.*'): task t is
scored with the parameters matching the globs taken from CONFIG's t-th model (the base task:
from base_model), the rest from the merged model (give CONFIG passthrough: [classifier.*] so the
heads are not merged).
"""
EXAMPLES = """\
examples:
  # task arithmetic: the scale from a grid, by the training loss of the tasks and of the base's own task
  gradmerge tune ta.yaml train_a.jsonl train_b.jsonl --base-data train_base.jsonl \\
      --scales 0.2,0.4,0.6,0.8,1.0,1.5 --max-examples 500 --out ta_tune.json --out-dir merged-ta-tuned
  # gradient matching: scale × δ
  gradmerge tune gm.yaml train_a.jsonl train_b.jsonl --base-data train_base.jsonl \\
      --scales 0.5,1 --deltas 1e-4,1e-2,1 --out gm_tune.json
  # tasks with their own classifier heads over one merged encoder
  gradmerge tune ta.yaml train_a.jsonl train_b.jsonl --scales 0.3,0.6,1 --task-heads 'classifier.*'
"""


def grid(text: str) -> list[float]:
    """A comma-separated list of finite numbers ≥ 0 (``0.2,0.5,1``; ``1e-3`` notation allowed),
    the values every grid of tune takes (the scale, δ, the prior's scale); else an argparse
    error (exit 2), as for text that is no number.

    Example:
        >>> grid("0.5, 1e-3")
        [0.5, 0.001]
        >>> grid("-1")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected comma-separated finite numbers >= 0, e.g. 0.2,0.5,1.0; got '-1'
    """
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated finite numbers >= 0, e.g. 0.2,0.5,1.0; got {text!r}"
        )
    return values


def lengths(text: str) -> list[int]:
    """``--max-length``: one whole number ≥ 1 for every DATA, or a comma-separated list of them,
    one per task (:func:`task_lengths`).

    Example:
        >>> lengths("64"), lengths("64,64,128")
        ([64], [64, 64, 128])
    """
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            "expected a whole number >= 1 for every DATA, or one per DATA separated by commas "
            f"(then the base task's), e.g. 64 or 64,64,128; got {text!r}"
        )
    return values


LENGTH_HELP = (
    "truncate longer sequences to N tokens (default: none; longer than the model's positions is "
    "an error): one N for every DATA, or one per task separated by commas, N_1,...,N_T in the "
    "order of DATA and then the base task's when --base-data or --base-validation is given, "
    "e.g. 64,64,128 for two tasks trained at 64 tokens and a base trained at 128; each "
    "--validation file is cut as its task's DATA"
)


def task_lengths(args: argparse.Namespace) -> list[int | None]:
    """The ``--max-length`` of each task: CONFIG's T tasks in the order of DATA, then the base
    task's when ``--base-data`` or ``--base-validation`` is given (``None``: no truncation).

    Raises:
        ArgumentError: neither one value nor one per task.

    Example:
        >>> from argparse import Namespace
        >>> task_lengths(Namespace(max_length=[64, 64, 128], datas=["a", "b"],
        ...                        base_data="base", base_validation=None))
        [64, 64, 128]
        >>> task_lengths(Namespace(max_length=[64], datas=["a", "b"], base_data=None,
        ...                        base_validation=None))
        [64, 64]
    """
    from gradmerge.errors import ArgumentError

    base = args.base_data is not None or args.base_validation is not None
    count = len(args.datas) + base
    given: list[int] | None = args.max_length
    if given is None:
        return [None] * count
    if len(given) == 1:
        return [given[0]] * count
    if len(given) != count:
        tasks = f"{len(args.datas)} DATA" + (" and the base task" if base else "")
        order = "one per DATA in order" + (", then the base task's" if base else "")
        raise ArgumentError(
            f"--max-length gives {len(given)} values for {tasks}: give one for all, or {count} "
            f"({order}), e.g. --max-length {','.join(['64'] * count)}"
        )
    return list(given)


def add_parser(sub: Any) -> None:
    """Register ``gradmerge tune``."""
    p = sub.add_parser(
        "tune",
        help="choose the scale (and δ) of a merge on the tasks' training data, without test labels",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    p.add_argument("config", metavar="CONFIG.yaml", help="the merge configuration")
    p.add_argument(
        "datas",
        metavar="DATA",
        nargs="+",
        help=f"each model's training data, in CONFIG's order: {DATA_HELP}",
    )
    p.add_argument(
        "--scales",
        type=grid,
        required=True,
        metavar="GRID",
        help="values of CONFIG's scale (every model's α_t is multiplied by it), e.g. 0.2,0.5,1",
    )
    p.add_argument("--alphas", action=Renamed, new="--scales", example="0.2,0.5,1")
    p.add_argument(
        "--deltas", type=grid, default=None, metavar="GRID", help="values of prior.delta"
    )
    p.add_argument(
        "--prior-scales",
        type=grid,
        default=None,
        metavar="GRID",
        help="values of prior.scale (the prior curvature's factor)",
    )
    p.add_argument(
        "--base-data",
        default=None,
        metavar="DATA",
        help="the base model's own training data (the task base_model was trained on): scored "
        "as one more task, its term weighted like the others and reported separately",
    )
    p.add_argument(
        "--criterion",
        choices=CRITERIA,
        default=CRITERIA[0],
        help="loss (default): the mean training losses; mismatch: Eq. 2's gradient mismatch, a "
        "diagnostic that prefers the point nearest to the fine-tunes (it warns)",
    )
    p.add_argument(
        "--task-heads",
        action="append",
        default=None,
        metavar="GLOB",
        help="task-specific heads: parameters matching GLOB (fnmatch, e.g. 'classifier.*'; "
        "repeatable) are, for task t, those of CONFIG's t-th model, not the merged ones (merge "
        "them with passthrough in CONFIG); the rest is the merged body",
    )
    p.add_argument(
        "--validation",
        action="append",
        default=[],
        metavar="DATA",
        help="held-out labelled data, one per model in CONFIG's order (repeat the flag): scored "
        "at every point and REPORTED beside the choice (best setting on it, and how the chosen "
        "one does there); never used to choose. --max-examples does not cut it",
    )
    p.add_argument(
        "--base-validation",
        default=None,
        metavar="DATA",
        help="held-out labelled data of the base model's own task, reported like --validation",
    )
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON report to FILE")
    p.add_argument(
        "--out-dir", default=None, metavar="DIR", help="write the chosen merged model to DIR"
    )
    add_reading_arguments(
        p, max_length={"type": lengths, "metavar": "N[,N...]", "help": LENGTH_HELP}
    )
    add_autocast_argument(p)
    p.set_defaults(run=run, check=check, writes=writes)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage): the
    reading flags for each DATA (with its own ``--max-length``), and, once CONFIG reads, the
    counts of DATA and ``--validation`` and the grid (:func:`validate`). A CONFIG that does not
    read is left to the run, which names the key (exit 1)."""
    from gradmerge.errors import ArgumentError, GradmergeError
    from gradmerge.jobs.config import MergeConfig

    if args.validation and len(args.validation) != len(args.datas):
        parser.error(
            f"{len(args.validation)} --validation DATA were given for {len(args.datas)} DATA: "
            "give one per DATA (CONFIG's models), in order"
        )
    try:
        per_task = task_lengths(args)
    except ArgumentError as err:
        parser.error(str(err))
    for spec, length in _inputs_and_lengths(args, per_task):
        check_reading(parser, argparse.Namespace(**{**vars(args), "max_length": length}), [], spec)
    if args.model_arg:
        parser.error("--model-arg does not apply: tune's models are CONFIG's merged folders")
    if not Path(args.config).is_file():
        parser.error(f"CONFIG {args.config} is not a file")
    try:
        with warnings.catch_warnings():  # the run reads CONFIG again, and warns then
            warnings.simplefilter("ignore")
            config = MergeConfig.from_yaml(args.config)
    except GradmergeError:
        return
    try:
        validate(args, config)
    except ArgumentError as err:
        parser.error(str(err))


def validate(args: argparse.Namespace, config: Any) -> list[Any]:
    """The grid's settings (:func:`gradmerge.jobs.tune.settings`), once the arguments fit CONFIG:
    one DATA per model, one ``--validation`` per model (or none), a ``--max-length`` per task
    or one for all.

    Raises:
        ArgumentError: a count that does not fit, or a grid that does not
            (:func:`~gradmerge.jobs.tune.settings`: a value for a prior the method lacks, a
            zero prior).
    """
    from gradmerge.errors import ArgumentError
    from gradmerge.jobs.tune import settings

    if len(args.datas) != len(config.models):
        raise ArgumentError(
            f"CONFIG {args.config} merges {len(config.models)} models but {len(args.datas)} DATA "
            "were given: give each model's training data, in the order of `models:`"
        )
    if args.validation and len(args.validation) != len(config.models):
        raise ArgumentError(
            f"CONFIG {args.config} merges {len(config.models)} models but "
            f"{len(args.validation)} --validation DATA were given: one per model, in order"
        )
    task_lengths(args)
    return settings(config, scales=args.scales, deltas=args.deltas, prior_scales=args.prior_scales)


def writes(args: argparse.Namespace) -> Writes:
    """The output guard's declaration: ``--out`` FILE and ``--out-dir`` DIR against CONFIG
    with every path it names, each DATA (the tasks', ``--base-data``) and held-out file
    (``--validation``, ``--base-validation``) and the reading flags'
    folders."""
    from gradmerge.foundation.guard import Output
    from gradmerge.jobs.config import MergeConfig

    outputs = file_output("--out", args.out)
    if args.out_dir is not None:
        outputs.append(Output("--out-dir", Path(args.out_dir), "folder"))
    inputs = MergeConfig.from_yaml(args.config).inputs()
    return Writes(outputs, inputs + reading_inputs(args, [], _inputs(args)))


def _inputs(args: argparse.Namespace) -> list[str]:
    """Every DATA the command reads: the tasks', the base's, the held-out ones."""
    extra = [spec for spec in (args.base_data, args.base_validation) if spec is not None]
    return [*args.datas, *args.validation, *extra]


def _inputs_and_lengths(
    args: argparse.Namespace, per_task: list[int | None]
) -> list[tuple[str, int | None]]:
    """Every DATA of :func:`_inputs` with its ``--max-length`` (its task's)."""
    base = per_task[-1]
    found = list(zip(args.datas, per_task, strict=False))
    found += list(zip(args.validation, per_task, strict=False))
    return found + [(spec, base) for spec in (args.base_data, args.base_validation) if spec]


def run(args: argparse.Namespace) -> int:
    """``gradmerge tune``: 0 when a setting was chosen, 1 on bad input or when every point
    failed (one line of stderr each)."""
    from gradmerge.errors import GradmergeError

    try:
        return execute(args)
    except (GradmergeError, OSError) as err:
        print(f"gradmerge tune: error: {err}", file=sys.stderr)
        return 1


def execute(args: argparse.Namespace) -> int:
    """Load CONFIG, build the grid, run :func:`gradmerge.jobs.tune.tune`, report."""
    from gradmerge.errors import ArgumentError, SelectionWarning
    from gradmerge.foundation.devices import resolve_device
    from gradmerge.foundation.guard import write_json
    from gradmerge.jobs.config import MergeConfig
    from gradmerge.jobs.tune import DIAGNOSTIC_ONLY, Point, tune

    config = MergeConfig.from_yaml(args.config)
    points = validate(args, config)  # checked before any work by check(); here for library use
    if not (Path(config.base_model) / "config.json").is_file():
        raise ArgumentError(
            f"base_model {config.base_model} is not a Hugging Face folder (no config.json): tune "
            "scores each merged model as a Hugging Face model, and a merge's folder takes its "
            "config and tokenizer from the base; give the base as such a folder"
        )
    if args.criterion in DIAGNOSTIC_ONLY:
        warnings.warn(DIAGNOSTIC_ONLY[args.criterion], SelectionWarning, stacklevel=1)
    scorer = Scorer(args, config, resolve_device(args.device))
    scorer.read(Path(config.base_model))  # DATA errors (no labels, ...) before the first merge
    base = "" if args.base_data is None else " and the base model's"
    print(
        f"{config.method}: {len(points)} settings, criterion {args.criterion} on "
        f"{len(args.datas)} tasks'{base} training data",
        file=sys.stderr,
    )

    def report(index: int, point: Point) -> None:
        value = "failed" if point.criterion is None else f"{point.criterion:.6g}"
        print(
            f"  [{index + 1}/{len(points)}] {_setting(point.setting.describe(config))}: {value}"
            f"{'' if point.error is None else ' (' + point.error + ')'}",
            file=sys.stderr,
        )

    result = tune(
        config,
        points,
        scorer,
        keep=None if args.out_dir is None else Path(args.out_dir),
        overwrite=args.overwrite,
        report=None if args.no_progress else report,
    )
    body = {
        "format": FORMAT,
        "config": str(Path(args.config).resolve()),
        "method": config.method,
        "criterion": args.criterion,
        "data": [_resolved(d) for d in args.datas],
        "base_data": None if args.base_data is None else _resolved(args.base_data),
        "max_length": None if args.max_length is None else task_lengths(args),
        **result.to_dict(config),
    }
    if args.validation or args.base_validation is not None:
        body["validation"] = validation_summary(body)
    print(_table(body))
    if args.out is not None:
        write_json(body, args.out, "--out")
        print(f"wrote {args.out}")
    if result.chosen is None:
        print(
            "gradmerge tune: error: every setting failed (each one's error is in the table)",
            file=sys.stderr,
        )
        return 1
    if result.kept is not None:
        print(f"wrote the chosen merge to {result.kept}")
    return 0


class Scorer:
    """A merged folder ↦ (criterion, figures) on the tasks' training data (and, reported only,
    on ``--validation`` data).

    Task t < T is CONFIG's t-th model with the t-th DATA; with ``--base-data``, task T is the
    base task: base_model with that DATA (its head is base_model's under ``--task-heads``, its
    mismatch reference ∇ℓ̄_0(θ_LLM)). The data are read once, with base_model before the first
    merge (:meth:`read`; every merged folder has the base's config and tokenizer, so the
    tokenised batches are the same for all); for ``mismatch`` the reference gradients ∇ℓ̄_t(θ_t) are
    computed once per task.
    """

    def __init__(self, args: argparse.Namespace, config: Any, device: torch.device) -> None:
        self.args, self.config, self.device = args, config, device
        self.sources = [str(m.model) for m in config.models]  # task t's own model
        self.training = list(args.datas)
        self.held_out: list[tuple[int, str]] = list(enumerate(args.validation))
        if args.base_data is not None:
            self.training.append(args.base_data)
        if args.base_data is not None or args.base_validation is not None:
            self.sources.append(str(config.base_model))
        if args.base_validation is not None:
            self.held_out.append((len(config.models), args.base_validation))
        self.lengths = task_lengths(args)  # task t's --max-length (its --validation's too)
        self.data: list[Iterable[Any]] | None = None
        self.validation: list[Iterable[Any]] = []
        self.references: dict[int, dict[str, torch.Tensor]] = {}
        self.heads: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, folder: Path) -> tuple[float, dict[str, Any]]:
        from gradmerge.estimate import gradient_fn
        from gradmerge.io import sources
        from gradmerge.jobs.tune import term

        args = self.args
        model = sources.load_model(str(folder), allow_new_weights=args.allow_new_weights)
        model = model.to(self.device).eval()
        if self.data is None:
            self.read(folder, model)
        assert self.data is not None
        tasks: list[dict[str, Any]] = []
        for t, (spec, data) in enumerate(zip(self.training, self.data, strict=True)):
            if args.task_heads:
                self._use_head(t, model)
            result = self._evaluate(model, data)
            entry: dict[str, Any] = {
                "data": spec,
                "examples": result.examples,
                "mean_loss": result.mean_loss,
                "accuracy": result.accuracy,
            }
            gradient = reference = None
            if args.criterion == "mismatch":
                grad = gradient_fn(model, data, loss=args.loss, ignore_index=args.ignore_index)
                theta = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
                gradient, reference = grad(theta), self._reference(t, grad, theta)
            entry["term"] = term(
                args.criterion,
                mean_loss=result.mean_loss,
                examples=result.examples,
                gradient=gradient,
                reference=reference,
            )
            tasks.append(entry)
        total = sum(entry["term"] for entry in tasks)
        figures: dict[str, Any] = {"tasks": tasks[: len(args.datas)]}
        if args.base_data is not None:
            figures["base"] = tasks[-1]
        held_out = []  # reported only: the criterion above never reads these labels
        for (t, spec), data in zip(self.held_out, self.validation, strict=True):
            if args.task_heads:
                self._use_head(t, model)
            result = self._evaluate(model, data)
            held_out.append(
                {
                    "data": spec,
                    "examples": result.examples,
                    "mean_loss": result.mean_loss,
                    "accuracy": result.accuracy,
                }
            )
        if args.validation:
            figures["validation"] = held_out[: len(args.validation)]
        if args.base_validation is not None:
            figures["base_validation"] = held_out[-1]
        return total, figures

    def _evaluate(self, model: Any, data: Any) -> Any:
        """The model's accuracy and mean loss on ``data`` (:func:`gradmerge.evaluation.evaluate`
        with the command's loss, ignore index, device and ``--autocast``)."""
        from gradmerge.evaluation import evaluate

        args = self.args
        return evaluate(
            model,
            data,
            loss=args.loss,
            ignore_index=args.ignore_index,
            device=self.device,
            autocast=autocast_dtype(args.autocast),
        )

    def read(self, folder: Path, model: torch.nn.Module | None = None) -> None:
        """Read DATA, ``--base-data`` and the held-out files for the model of ``folder`` (the
        base, before any merge: every merged folder has its config and tokenizer, so the
        batches are the same).

        Raises:
            GradmergeError: unusable DATA (records without labels, ...), before any merge runs.
        """
        from gradmerge.io import sources

        args = self.args
        if model is None:
            model = sources.load_model(str(folder), allow_new_weights=args.allow_new_weights)
        self.data = [
            self._load(model, folder, s, args.max_examples, self.lengths[t])
            for t, s in enumerate(self.training)
        ]
        self.validation = [
            self._load(model, folder, s, None, self.lengths[t]) for t, s in self.held_out
        ]

    def _use_head(self, t: int, model: torch.nn.Module) -> None:
        """Copy task t's head (the parameters matching ``--task-heads``, read from task t's own
        model: CONFIG's t-th, or base_model for the base task) into the merged ``model``."""
        from fnmatch import fnmatchcase

        from gradmerge.errors import StructureError

        if t not in self.heads:
            like = {
                name: p.detach()
                for name, p in model.named_parameters()
                if any(fnmatchcase(name, glob) for glob in self.args.task_heads)
            }
            if not like:
                raise StructureError(
                    f"--task-heads {' '.join(self.args.task_heads)} matches no parameter of the "
                    "merged model; give globs of its head's names, e.g. 'classifier.*'"
                )
            self.heads[t] = fine_tuned_weights(self.sources[t], like, self.args.allow_new_weights)
        import torch

        with torch.no_grad():
            for name, value in self.heads[t].items():
                model.get_parameter(name).copy_(value)

    def _load(
        self,
        model: torch.nn.Module,
        folder: Path,
        spec: str,
        max_examples: int | None,
        max_length: int | None,
    ) -> Iterable[Any]:
        from gradmerge.io import sources
        from gradmerge.io.text_data import TextBatches, TextOptions

        args = self.args
        data = sources.load_data(
            spec,
            batch_size=args.batch_size or BATCH_SIZE,
            shift_labels=args.shift_labels,
            ignore_index=args.ignore_index,
            arguments=dict(map(sources.parse_argument, args.data_arg)),
            max_examples=max_examples,
            model=model,
            tokenizer=args.tokenizer or str(folder),
            text=TextOptions(
                text_field=args.text_field,
                text_pair_field=args.text_pair_field,
                label_field=args.label_field,
                max_length=max_length,
            ),
        )
        if isinstance(data, TextBatches):
            if not args.no_progress:
                print(f"{spec}: {data.summary()}", file=sys.stderr)
            return data.by_length()[0]  # sums and means do not depend on the order: less padding
        return data

    def _reference(
        self, t: int, gradient: Any, theta: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """∇ℓ̄_t(θ_t), θ_t read from task t's own model (CONFIG's t-th, or base_model for the
        base task) under θ's names, dtypes and device."""
        if t not in self.references:
            weights = fine_tuned_weights(self.sources[t], theta, self.args.allow_new_weights)
            self.references[t] = gradient(weights)
        return self.references[t]


def fine_tuned_weights(
    spec: str, like: dict[str, torch.Tensor], allow_new_weights: bool = False
) -> dict[str, torch.Tensor]:
    """The parameters ``like`` names, read from a fine-tuned model: a Hugging Face or LoRA
    adapter folder (loaded as a model, so an adapter is applied to its base) or a safetensors
    checkpoint; each in ``like``'s dtype and device.

    Raises:
        StructureError: a parameter the checkpoint lacks, or of another shape.
    """
    from gradmerge.errors import StructureError
    from gradmerge.io import open_checkpoint, sources
    from gradmerge.io.lora import is_adapter

    if (Path(spec) / "config.json").is_file() or is_adapter(spec):
        model = sources.load_model(spec, allow_new_weights=allow_new_weights)
        found = dict(model.named_parameters())
        get = found.__getitem__
        names = set(found)
    else:
        checkpoint = open_checkpoint(spec)
        names = set(checkpoint.keys())
        get = checkpoint.get  # type: ignore[assignment]
    out = {}
    for name, ref in like.items():
        if name not in names:
            raise StructureError(
                f"{spec} has no parameter {name!r}, which the merged model has; the models of "
                "CONFIG must share the base's architecture"
            )
        value = get(name).detach()
        if tuple(value.shape) != tuple(ref.shape):
            raise StructureError(
                f"{spec}: {name} has shape {tuple(value.shape)}, the merged model "
                f"{tuple(ref.shape)}"
            )
        out[name] = value.to(device=ref.device, dtype=ref.dtype)
    return out


def validation_summary(body: dict[str, Any]) -> dict[str, Any]:
    """How the chosen setting does on the held-out data against the best setting there.

    A point's held-out score is its mean accuracy over the ``--validation`` tasks and the
    ``--base-validation`` one (each task weighted alike), or minus their mean loss when there is
    no accuracy (``--loss mse``); the best point has the highest score (the first on ties).
    Returns ``best_index``, ``best`` (its setting), ``best_score``, ``chosen_score`` and
    ``regret`` = best − chosen (≥ 0)."""
    scores: list[float | None] = []
    for point in body["points"]:
        held_out = point.get("validation", []) + (
            [point["base_validation"]] if "base_validation" in point else []
        )
        if point["criterion"] is None or not held_out:
            scores.append(None)
        elif all(task["accuracy"] is not None for task in held_out):
            scores.append(sum(task["accuracy"] for task in held_out) / len(held_out))
        else:
            scores.append(-sum(task["mean_loss"] for task in held_out) / len(held_out))
    best: int | None = None
    for index, value in enumerate(scores):
        if value is not None and (best is None or value > scores[best]):  # type: ignore[operator]
            best = index
    chosen = body["chosen_index"]
    best_score = None if best is None else scores[best]
    chosen_score = None if chosen is None else scores[chosen]
    if best is None or best_score is None or chosen_score is None:
        return {"best_index": None}
    keys = ("scale", "alphas", "delta", "prior_scale")
    return {
        "score": "mean accuracy over the tasks (or minus the mean loss without accuracy)",
        "best_index": best,
        "best": {k: body["points"][best][k] for k in keys if k in body["points"][best]},
        "best_score": best_score,
        "chosen_score": chosen_score,
        "regret": best_score - chosen_score,
    }


def _resolved(spec: str) -> str:
    """A DATA as the JSON records it: the absolute path of a file or folder, else as given."""
    return str(Path(spec).resolve()) if Path(spec).exists() else spec


def _setting(values: dict[str, Any]) -> str:
    parts = [f"scale={values['scale']:g}"]
    if "delta" in values:
        parts.append(f"delta={values['delta']:g}")
    if "prior_scale" in values:
        parts.append(f"prior_scale={values['prior_scale']:g}")
    return " ".join(parts)


def _table(body: dict[str, Any]) -> str:
    """One line per point: the setting, the criterion, each task's term of it (the base task's
    first, then CONFIG's order); the choice, whether it is at the grid's edge, the validation."""
    base = body["base_data"] is not None
    order = "base | CONFIG's order" if base else "CONFIG's order"
    lines = [f"{'setting':<40} {body['criterion']:>12}  term per task ({order})"]
    for index, point in enumerate(body["points"]):
        mark = " <- chosen" if index == body["chosen_index"] else ""
        if point["criterion"] is None:  # the reason, whether progress lines were printed or not
            value, terms = "failed", f"({point['error']})"
        else:
            value = f"{point['criterion']:.6g}"
            terms = " ".join(f"{task['term']:.4g}" for task in point["tasks"])
            if base:
                terms = f"{point['base']['term']:.4g} | {terms}"
        lines.append(f"{_setting(point):<40} {value:>12}  {terms}{mark}")
    if body["chosen"] is not None:
        edges = ", ".join(f"the {e['side']} {e['axis']}" for e in body["grid_edges"])
        lines.append(
            f"chosen: {_setting(body['chosen'])} (alphas {body['chosen']['alphas']})"
            + (f", at {edges} of the grid" if edges else "")
        )
    held_out = body.get("validation")
    if held_out and held_out.get("best_index") is not None:
        lines.append(
            f"validation (reported, not used to choose): chosen {held_out['chosen_score']:.4f}, "
            f"best {held_out['best_score']:.4f} at {_setting(held_out['best'])}"
        )
    return "\n".join(lines)
