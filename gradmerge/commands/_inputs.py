"""MODEL, DATA and OUT of the commands that read models and data (``curvature``, ``gradient``,
``evaluate``, ``tune``).

The flags (:func:`add_source_arguments`), their checks before any work (:func:`check_sources`;
OUT and what the run reads are declared to the output guard, :func:`source_writes`),
loading through :mod:`gradmerge.io.sources` (:func:`load`), the ``source.*`` metadata
(:func:`provenance`) and the progress bar over batches (:func:`progress`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradmerge.commands._flags import ADAPTER_BASE, DEVICE, NO_PROGRESS, OVERWRITE, setting_flag
from gradmerge.commands._writes import Writes, file_output, reading_inputs
from gradmerge.errors import ArgumentError
from gradmerge.estimate.options import EstimateOptions  # its declarations: no torch
from gradmerge.io.forms import BATCH_SIZE
from gradmerge.io.forms import FORMS as FORMS
from gradmerge.io.text_records import TextOptions  # its declarations: no torch

if TYPE_CHECKING:  # imported where used: building the parser and printing help needs no torch
    import torch
    from torch import nn

MODEL_HELP = (
    "Hugging Face folder (or LoRA adapter folder) or module:function (an entry point RUNS that "
    "code)"
)
DATA_HELP = (
    "text (.jsonl/.csv/.tsv/.txt, datasets folder), tensors (.safetensors/.pt) or module:function "
    "(an entry point RUNS that code)"
)


class Renamed(argparse.Action):
    """A flag that was renamed: refused, whatever it holds, with one argparse line naming the new
    flag (exit 2), e.g. ``gradmerge tune: error: --alphas was renamed --scales (...)``. Hidden
    from ``--help``; its value, if any, is swallowed so the error is about the name.

    Example:
        >>> p = argparse.ArgumentParser(prog="tune")
        >>> _ = p.add_argument("--alphas", action=Renamed, new="--scales", example="0.5,1")
        >>> p.parse_args(["--alphas", "0.5,1"])  # doctest: +SKIP
        usage: tune [-h]
        tune: error: --alphas was renamed --scales: give --scales 0.5,1
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, new: str, example: str, **kw: Any
    ) -> None:
        self.new, self.example = new, example
        kw.update(nargs="?", help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"{option_string} was renamed {self.new}: give {self.new} {values or self.example}"
        )


def add_source_arguments(p: argparse.ArgumentParser, out_help: str) -> None:
    """MODEL, DATA, OUT and the flags that say how to read them (:func:`add_reading_arguments`)."""
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("data", metavar="DATA", help=DATA_HELP)
    p.add_argument("out", metavar="OUT", help=out_help)
    add_reading_arguments(p)
    p.set_defaults(writes=source_writes)


AUTOCAST = ("bfloat16", "float16")
"""``--autocast`` of the commands that score models (evaluate, tune): names of torch dtypes."""


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of ``--autocast NAME`` (``None``: no autocast)."""
    import torch

    return getattr(torch, name) if name else None


def add_autocast_argument(p: argparse.ArgumentParser) -> None:
    """``--autocast {bfloat16,float16}``: the forward passes that score models run under
    ``torch.autocast`` (:func:`gradmerge.evaluation.evaluate`)."""
    p.add_argument(
        "--autocast",
        choices=AUTOCAST,
        default=None,
        help="score with the forward pass under torch.autocast in this dtype (weights unchanged, "
        "logits scored in float32): 3-4x faster on CPUs with AMX and on GPUs; default: the "
        "model's own dtype",
    )


def add_reading_arguments(
    p: argparse.ArgumentParser, max_length: dict[str, Any] | None = None
) -> None:
    """The flags that say how to read MODEL and DATA (``--batch-size``, the text flags,
    ``--max-examples``, ``--model-arg``/``--data-arg``, ``--device``, ``--loss``,
    ``--ignore-index``, ``--shift-labels``, ``--allow-new-weights``, ``--overwrite``,
    ``--no-progress``).

    ``max_length``: the ``type``, ``metavar`` and ``help`` of ``--max-length`` where a command
    reads it otherwise (``tune``: one per DATA); default: one whole number."""
    setting_flag(p, EstimateOptions, "loss")
    p.add_argument(
        "--batch-size", type=int, default=None, help=f"examples per batch of a file ({BATCH_SIZE})"
    )
    text = p.add_argument_group("text DATA (.jsonl, .csv, .tsv, .txt, a datasets folder)")
    text.add_argument(
        "--text-field",
        default=TextOptions.text_field,
        help=f"field of the text (default: {TextOptions.text_field})",
    )
    text.add_argument(
        "--text-pair-field", default=None, help="field of a second text (sentence pairs)"
    )
    text.add_argument(
        "--label-field",
        default=TextOptions.label_field,
        help="field of the label, a name of the config's label2id or an id (classification; "
        f"default: {TextOptions.label_field})",
    )
    text.add_argument(
        "--max-length",
        default=None,
        **(
            max_length
            or {
                "type": int,
                "help": "truncate longer sequences to this many tokens (default: none; longer "
                "than the model's positions is an error)",
            }
        ),
    )
    text.add_argument(
        "--tokenizer", default=None, metavar="FOLDER", help="tokenizer folder (default: MODEL)"
    )
    p.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help="use the first N examples of DATA (an entry point: default at most "
        "10,000,000, beyond which it stops with an error)",
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of a MODEL entry point (repeatable; VALUE read as JSON if it "
        "is); the entry point is imported and called: it runs code, like a Python import",
    )
    p.add_argument(
        "--data-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of a DATA entry point, e.g. task=sentiment (repeatable); the "
        "entry point is imported and called: it runs code, like a Python import",
    )
    DEVICE.add(p)
    setting_flag(p, EstimateOptions, "ignore_index")
    p.add_argument(
        "--shift-labels",
        action="store_true",
        help="labels follow Hugging Face's causal-LM convention (labels = input_ids): shift "
        "them left by one and ignore the last position",
    )
    ADAPTER_BASE.add(
        p,
        which="MODEL is a LoRA adapter: ",
        refused=", and refused when it names another model relative to the current directory",
    )
    p.add_argument(
        "--allow-new-weights",
        action="store_true",
        help="MODEL folder: accept parameters its weights lack (randomly initialised, e.g. a "
        "new head) and stored tensors it does not use; by default they are an error",
    )
    OVERWRITE.add(p, what="an existing OUT")
    NO_PROGRESS.add(p)


def check_sources(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors (exit 2) for unusable MODEL, DATA or source flags (OUT: the output guard,
    :func:`source_writes`)."""
    check_reading(parser, args, [args.model])


def source_writes(args: argparse.Namespace) -> Writes:
    """The output guard's declaration of ``curvature`` and ``gradient``: the file OUT, MODEL
    (with a LoRA adapter's base), DATA and the reading flags' folders."""
    return Writes(file_output("OUT", args.out), reading_inputs(args, [args.model], [args.data]))


def check_reading(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    models: Sequence[str],
    data: str | None = None,
) -> tuple[list[tuple[str, str]], str]:
    """argparse errors (exit 2) for unusable MODELs, DATA or reading flags; each MODEL with its
    kind, and DATA's kind (:func:`gradmerge.io.sources.model_kind`, ``data_kind``).

    ``data``: the DATA to check instead of ``args.data`` (commands taking several)."""
    from gradmerge.io import sources
    from gradmerge.io.lora import is_adapter

    data = args.data if data is None else data
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.device == "cuda" and not _cuda():
        parser.error("--device cuda, but no CUDA device is available; use --device cpu")
    try:
        model_kinds = [(model, sources.model_kind(model)) for model in models]
        data_kind = sources.data_kind(data)
    except ArgumentError as err:
        parser.error(str(err))
    if data_kind == "entry point" and args.batch_size is not None:
        parser.error("--batch-size applies to files; an entry point yields its own batches")
    if data_kind != "tensor file" and args.shift_labels:
        parser.error(
            "--shift-labels applies to tensor files (text is shifted already; an entry point "
            "shifts in your data code)"
        )
    if data_kind not in ("text file", "dataset folder"):
        used = [flag for flag, value, default in _text_flags(args) if value != default]
        if used:
            parser.error(f"{', '.join(used)} apply to text DATA; {data} is a {data_kind}")
    for flag, value in (("--max-length", args.max_length), ("--max-examples", args.max_examples)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    try:
        others = [kind for _, kind in model_kinds if kind != "entry point"]
        for flag, values, kind in (
            ("--model-arg", args.model_arg, others[0] if others else "entry point"),
            ("--data-arg", args.data_arg, data_kind),
        ):
            if values and kind != "entry point":
                parser.error(f"{flag} applies to entry points; {flag[2:6].upper()} is a {kind}")
            for value in values:
                sources.parse_argument(value)
    except ArgumentError as err:
        parser.error(str(err))
    if args.adapter_base is not None and not any(
        kind == "hugging face folder" and is_adapter(spec) for spec, kind in model_kinds
    ):
        parser.error("--adapter-base applies to a LoRA adapter MODEL; none is given")
    return model_kinds, data_kind


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load(
    args: argparse.Namespace, device: torch.device, *, announce: bool
) -> tuple[nn.Module, Iterable[Any]]:
    """MODEL (on ``device``, in evaluation mode) and DATA's batches (:func:`load_model`,
    :func:`load_data`)."""
    model = load_model(args, device, args.model)
    return model, load_data(args, model, args.model, args.data, announce=announce)


def load_model(args: argparse.Namespace, device: torch.device, spec: str) -> nn.Module:
    """MODEL ``spec`` on ``device``, in evaluation mode, read as the flags say."""
    from gradmerge.io import sources

    model_arguments = dict(map(sources.parse_argument, args.model_arg))
    model = sources.load_model(
        spec,
        model_arguments,
        allow_new_weights=args.allow_new_weights,
        base=_adapter_base(args, spec),
    )
    return model.to(device).eval()


def load_data(
    args: argparse.Namespace, model: nn.Module, spec: str, data_spec: str, *, announce: bool
) -> Iterable[Any]:
    """DATA ``data_spec``'s batches for ``model`` (MODEL ``spec``: text is tokenised with its
    tokenizer); with ``announce``, what was read (text: examples, tokens, truncation) and a
    warning about unshifted labels, on stderr."""
    from gradmerge.io import sources
    from gradmerge.io.text_data import TextBatches, TextOptions

    base = _adapter_base(args, spec)
    data = sources.load_data(
        data_spec,
        batch_size=args.batch_size or BATCH_SIZE,
        shift_labels=args.shift_labels,
        ignore_index=args.ignore_index,
        arguments=dict(map(sources.parse_argument, args.data_arg)),
        max_examples=args.max_examples,
        model=model,
        tokenizer=args.tokenizer or sources.tokenizer_folder(spec, base),
        text=TextOptions(**{key: value for key, _, value in _text_options(args)}),
    )
    if announce:
        if isinstance(data, TextBatches):
            print(f"{data_spec}: {data.summary()}", file=sys.stderr)
        sources.warn_unshifted(model, data, shift_labels=args.shift_labels)
    return data


def _adapter_base(args: argparse.Namespace, spec: str) -> str | None:
    """``--adapter-base`` for MODEL ``spec`` when it is a LoRA adapter folder, else ``None``."""
    if args.adapter_base is None or (":" in spec and not Path(spec).is_dir()):
        return None
    from gradmerge.io.lora import is_adapter

    return str(args.adapter_base) if is_adapter(spec) else None


def _text_options(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """(TextOptions field, flag, value) of the text-only flags."""
    return [
        ("text_field", "--text-field", args.text_field),
        ("text_pair_field", "--text-pair-field", args.text_pair_field),
        ("label_field", "--label-field", args.label_field),
        ("max_length", "--max-length", args.max_length),
    ]


def _text_flags(args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(flag, value, default) of the flags that apply to text DATA only."""
    from gradmerge.io.text_data import TextOptions

    defaults = TextOptions()
    flags = [(flag, value, getattr(defaults, key)) for key, flag, value in _text_options(args)]
    return [*flags, ("--tokenizer", args.tokenizer, None)]


def provenance(
    args: argparse.Namespace,
    device: torch.device,
    data: Iterable[Any] | None = None,
    *,
    model_spec: str | None = None,
    data_spec: str | None = None,
) -> dict[str, str]:
    """What the file's metadata records about how it was made
    (:func:`gradmerge.io.sources.provenance`, and for text the examples, tokens and truncation of
    :meth:`TextBatches.metadata`).

    ``model_spec``, ``data_spec``: the MODEL and DATA instead of ``args.model`` and ``args.data``
    (commands taking several)."""
    from gradmerge.io import sources
    from gradmerge.io.text_data import TextBatches

    spec = args.model if model_spec is None else model_spec
    meta = sources.provenance(
        spec,
        args.data if data_spec is None else data_spec,
        device=device,
        ignore_index=args.ignore_index,
        batch_size=args.batch_size or BATCH_SIZE,
        shift_labels=args.shift_labels,
        model_arguments=dict(map(sources.parse_argument, args.model_arg)),
        data_arguments=dict(map(sources.parse_argument, args.data_arg)),
        max_examples=args.max_examples,
        seed=getattr(args, "seed", None),  # gradmerge curvature's Monte-Carlo options
        mc_samples=getattr(args, "mc_samples", None),
        base=_adapter_base(args, spec),
    )
    if isinstance(data, TextBatches):
        meta.update(data.metadata())
        options = {key: value for key, _, value in _text_options(args) if value is not None}
        meta["source.text_options"] = json.dumps(options, sort_keys=True)
        tokenizer = args.tokenizer or sources.tokenizer_folder(spec, _adapter_base(args, spec))
        meta["source.tokenizer"] = str(Path(tokenizer).resolve())
    return meta


def progress(data: Iterable[Any], label: str, passes: Sequence[str] = ()) -> Iterable[Any]:
    """``data`` reporting each pass over it (:class:`gradmerge.jobs.progress.Progress`: a bar on a
    terminal, timed log lines with examples/s and ETA elsewhere). ``passes`` names the passes
    an estimator is known to make, shown in each pass's label.

    A one-shot iterator stays one, so that estimators needing two passes can refuse it.
    """
    if isinstance(data, Iterator):
        return _counted(data, label, _examples(data))
    return _Passes(data, label, passes)


class _Passes:
    def __init__(self, data: Iterable[Any], label: str, passes: Sequence[str]) -> None:
        self.data, self.label, self.names, self.passes = data, label, passes, 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        if self.passes <= len(self.names):
            label = f"{self.label} ({self.names[self.passes - 1]})"
        else:
            label = self.label if self.passes == 1 else f"{self.label} (pass {self.passes})"
        return _counted(self.data, label, _examples(self.data))


def _examples(data: Iterable[Any]) -> int | None:
    """How many examples ``data`` holds, when it knows (tensor and text files; an entry point's
    ``--max-examples``, at most)."""
    from gradmerge.io.text_data import TextBatches

    if isinstance(data, TextBatches):
        return data.examples
    rows = getattr(data, "rows", None)
    return rows if isinstance(rows, int) else None


def _counted(data: Iterable[Any], label: str, total: int | None) -> Iterator[Any]:
    from gradmerge.estimate._data import split_batch
    from gradmerge.jobs.progress import Progress

    bar = Progress(label, total, unit="examples")
    try:
        for index, batch in enumerate(data):
            yield batch
            _, targets = split_batch(batch, index)
            bar.update(int(targets.shape[0]) if targets.ndim else 1)
    finally:
        bar.close()
