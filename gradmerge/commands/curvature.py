"""``gradmerge curvature MODEL DATA OUT``: estimate a task's curvature H_t and save it.

H_t = Σ_i ∇²ℓ_i (or its Fisher/GGN), a SUM over the examples of DATA, at the weights of MODEL
(θ_t for a fine-tuned model's H_t, θ_LLM for a prior or for removal): a call of
:func:`gradmerge.estimate_curvature` written with ``C.save(OUT)`` (atomic), so that
``gradmerge merge`` / ``gm.load_curvature`` can read it. Where MODEL and DATA came from is kept in
the file's metadata (``C.meta["source.*"]`` after loading).

MODEL and DATA are read by :mod:`gradmerge.sources` (its forms are listed below). A tensor file is
cut into batches of ``--batch-size`` rows; its ``labels`` are the targets of each position's logits;
``--shift-labels`` turns Hugging Face's causal-LM convention (labels = input_ids) into that.
Positions whose ``attention_mask`` is 0 are ignored.

The model is put in evaluation mode (no dropout), so the estimate is that of the weights given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradmerge import sources
from gradmerge.distributed.errors import DistributedError
from gradmerge.distributed.estimate import DEFAULT_TIMEOUT
from gradmerge.distributed.estimate import estimate_curvature as distributed_estimate
from gradmerge.distributed.launch import init_from_env, rank_device, save_on_rank0
from gradmerge.distributed.shard import shard
from gradmerge.errors import ArgumentError
from gradmerge.estimate.kfac import MAX_FACTOR_SIDE
from gradmerge.text_data import TextBatches, TextOptions

EXAMPLES = """\
examples:
  # a Hugging Face classifier and a JSONL file ({"text": ..., "label": "positive"} per line),
  # tokenised with the folder's own tokenizer; labels are names of config.json's label2id or ids
  gradmerge curvature runs/ft-sentiment data/sentiment.jsonl sentiment.curvature.safetensors \
      --structure kfac --max-length 128
  # a causal LM and plain text, one example per line (targets: the next tokens)
  gradmerge curvature runs/ft-lm data/corpus.txt lm.curvature.safetensors --max-examples 1000
  # CSV with other column names, sentence pairs; a datasets folder (save_to_disk) works the same
  gradmerge curvature runs/ft-nli data/nli.csv nli.curvature.safetensors \
      --text-field premise --text-pair-field hypothesis --label-field gold
  # one data function for several tasks: keyword arguments of entry points
  gradmerge curvature runs/ft-a ./data.py:batches a.curvature.safetensors --data-arg task=a
  # a Hugging Face folder and a token file (input_ids, labels[, attention_mask])
  gradmerge curvature runs/ft-task-a data/task_a.safetensors task_a.curvature.safetensors \\
      --structure kfac --fisher empirical --batch-size 8 --shift-labels
  # your own model and data loader, as Python entry points
  gradmerge curvature mypkg.models:finetuned_a mypkg.data:task_a_batches a.curvature.safetensors
  gradmerge curvature ./build.py:model ./build.py:batches a.curvature.safetensors --structure full \\
      --fisher hessian --loss mse
  # a prior H_0 = Fisher of the base model on pre-training-like data, with sampled labels
  gradmerge curvature gpt2-base text.pt base.curvature.safetensors --fisher mc --mc-samples 4
  # K-FAC of a LLaMA-style model whose untied lm_head (vocab × hidden) would need a vocab² G:
  # layers with a factor side above 8192 get a diagonal block instead (none: no limit)
  gradmerge curvature runs/ft-llama data/task_a.safetensors a.curvature.safetensors \\
      --structure kfac --kfac-max-side 8192 --shift-labels
"""


def max_side(text: str) -> int | None:
    """``--kfac-max-side``: a positive int, or ``none`` for no limit."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer (the largest side of a K-FAC factor) or 'none', "
            f"got {text!r}"
        )
    return value


# ----- command line ---------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    """Register ``gradmerge curvature``."""
    p = sub.add_parser(
        "curvature",
        help="estimate a model's curvature on data (a SUM over examples) and save it",
        description=_plain(_help_text()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES + "\n" + DISTRIBUTED_EPILOG,
    )
    p.add_argument("model", metavar="MODEL", help="Hugging Face folder or module:function")
    p.add_argument(
        "data",
        metavar="DATA",
        help="text (.jsonl/.csv/.tsv/.txt, datasets folder), tensors (.safetensors/.pt) or "
        "module:function",
    )
    p.add_argument("out", metavar="OUT", help="curvature file to write (.safetensors)")
    p.add_argument("--structure", choices=["diag", "kfac", "full"], default="diag")
    p.add_argument(
        "--fisher",
        choices=["empirical", "mc", "ggn", "hessian"],
        default="empirical",
        help="empirical (observed labels), mc (sampled labels), ggn (exact GGN), "
        "hessian (--structure full only); default: empirical",
    )
    p.add_argument("--loss", choices=["cross_entropy", "mse"], default="cross_entropy")
    p.add_argument("--mc-samples", type=int, default=1, help="labels drawn per example (mc)")
    p.add_argument("--seed", type=int, default=0, help="seed of the Monte-Carlo draws")
    p.add_argument("--batch-size", type=int, default=None, help="examples per batch of a file (16)")
    text = p.add_argument_group("text DATA (.jsonl, .csv, .tsv, .txt, a datasets folder)")
    text.add_argument("--text-field", default="text", help="field of the text (default: text)")
    text.add_argument(
        "--text-pair-field", default=None, help="field of a second text (sentence pairs)"
    )
    text.add_argument(
        "--label-field",
        default="label",
        help="field of the label, a name of the config's label2id or an id (classification; "
        "default: label)",
    )
    text.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="truncate longer sequences to this many tokens (default: none; longer than the "
        "model's positions is an error)",
    )
    text.add_argument(
        "--tokenizer", default=None, metavar="FOLDER", help="tokenizer folder (default: MODEL)"
    )
    p.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help="use the first N examples of a text or tensor file",
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of a MODEL entry point (repeatable; VALUE read as JSON if it is)",
    )
    p.add_argument(
        "--data-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of a DATA entry point, e.g. task=sentiment (repeatable)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--kfac-approx", choices=["expand", "reduce"], default="expand")
    p.add_argument(
        "--kfac-max-side",
        type=max_side,
        default=MAX_FACTOR_SIDE,
        metavar="N",
        help="--structure kfac: a layer whose A or G factor would have a side above N (N² × 4 "
        "bytes in float32) gets a diagonal block instead, e.g. an untied vocabulary head; "
        f"'none': no limit; default: {MAX_FACTOR_SIDE}",
    )
    p.add_argument("--ignore-index", type=int, default=-100, help="label of ignored positions")
    p.add_argument(
        "--shift-labels",
        action="store_true",
        help="labels follow Hugging Face's causal-LM convention (labels = input_ids): shift "
        "them left by one and ignore the last position",
    )
    p.add_argument(
        "--max-params", type=int, default=20_000, help="largest model --structure full takes"
    )
    p.add_argument(
        "--allow-new-weights",
        action="store_true",
        help="MODEL folder: accept parameters its weights lack (randomly initialised, e.g. a "
        "new head) and stored tensors it does not use; by default they are an error",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_distributed_options(p)  # --distributed, --timeout, --expected-examples, --backend
    p.set_defaults(run=run, check=check)


def estimate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The estimator's keywords from the command-line options (also under --distributed)."""
    return {
        "structure": args.structure,
        "fisher": args.fisher,
        "loss": args.loss,
        "mc_samples": args.mc_samples,
        "seed": args.seed,
        "ignore_index": args.ignore_index,
        "kfac_approx": args.kfac_approx,
        "max_params": args.max_params,
        "kfac_max_factor_side": args.kfac_max_side,
    }


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage)."""
    if args.fisher == "hessian" and args.structure != "full":
        parser.error(
            "--fisher hessian needs --structure full (diag and kfac estimate a Fisher/GGN)"
        )
    check_distributed(parser, args)
    if args.mc_samples < 1:
        parser.error(f"--mc-samples must be at least 1, got {args.mc_samples}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available; use --device cpu")
    try:
        model_kind = sources.model_kind(args.model)
        data_kind = sources.data_kind(args.data)
    except ArgumentError as err:
        parser.error(str(err))
    if data_kind == "entry point":
        for flag, value in (
            ("--batch-size", args.batch_size),
            ("--max-examples", args.max_examples),
        ):
            if value is not None:
                parser.error(f"{flag} applies to files; an entry point yields its own batches")
    if data_kind != "tensor file" and args.shift_labels:
        parser.error(
            "--shift-labels applies to tensor files (text is shifted already; an entry point "
            "shifts in your data code)"
        )
    if data_kind not in ("text file", "dataset folder"):
        used = [flag for flag, value, default in _text_flags(args) if value != default]
        if used:
            parser.error(f"{', '.join(used)} apply to text DATA; {args.data} is a {data_kind}")
    for flag, value in (("--max-length", args.max_length), ("--max-examples", args.max_examples)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    try:
        for flag, values, kind in (
            ("--model-arg", args.model_arg, model_kind),
            ("--data-arg", args.data_arg, data_kind),
        ):
            if values and kind != "entry point":
                parser.error(f"{flag} applies to entry points; {flag[2:6].upper()} is a {kind}")
            for value in values:
                sources.parse_argument(value)
    except ArgumentError as err:
        parser.error(str(err))
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"OUT {out} is a folder; give a file name such as task.curvature.safetensors")
    for flag, path in _inputs(args, model_kind, data_kind):
        inside = path.resolve()
        if out.resolve() == inside or inside in out.resolve().parents:
            parser.error(
                f"OUT {out} is, or is inside, {flag} ({path}): writing it would replace or add to "
                "an input; write the curvature elsewhere"
            )
    if out.exists() and not args.overwrite:
        parser.error(f"OUT {out} exists; pass --overwrite to replace it")
    problem = _not_writable(out)
    if problem:
        parser.error(f"OUT {out} cannot be written ({problem}): choose another path")


def _inputs(args: argparse.Namespace, model_kind: str, data_kind: str) -> list[tuple[str, Path]]:
    """The files and folders the run reads: OUT must be none of them nor inside one."""
    inputs = []
    for flag, spec, kind in (("MODEL", args.model, model_kind), ("DATA", args.data, data_kind)):
        if kind == "entry point":
            module = spec.rpartition(":")[0]
            if module.endswith(".py") or "/" in module:
                inputs.append((flag, Path(module)))
        else:
            inputs.append((flag, Path(spec)))
    if args.tokenizer:
        inputs.append(("--tokenizer", Path(args.tokenizer)))
    return inputs


def _not_writable(out: Path) -> str | None:
    """Why no file can be created in OUT's folder (probed with a temporary file in its nearest
    existing ancestor: the folders below it are made when OUT is written), or ``None``."""
    folder = out.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".gradmerge-probe-", dir=folder)
    except OSError as err:
        return f"{folder}: {err.strerror or err}"
    os.close(fd)
    os.unlink(probe)
    return None


def run(args: argparse.Namespace) -> int:
    """``gradmerge curvature``: 0 on success, 1 on bad input (a typed error of
    :mod:`gradmerge.errors` or an I/O error, reported on one line of stderr as ``gradmerge merge``
    does); other exceptions, e.g. from the user's own entry points, keep their traceback."""
    from gradmerge.errors import GradmergeError

    try:
        return execute(args)
    except (GradmergeError, OSError) as err:
        print(f"gradmerge curvature: error: {err}", file=sys.stderr)
        return 1


def execute(args: argparse.Namespace) -> int:
    """Load, estimate, save; print one summary line. Raises the typed errors of
    :mod:`gradmerge.errors` on bad input (see :mod:`gradmerge.sources`)."""
    import gradmerge as gm

    if getattr(args, "distributed", False):  # under torchrun: gradmerge.distributed's path
        return run_distributed(args)

    start = time.perf_counter()
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    model, data = load(args, device, announce=True)
    batches = data if args.no_progress else progress(data, f"{args.structure} {args.fisher}")
    curvature = gm.estimate_curvature(model, batches, **estimate_options(args))
    curvature.meta.update(provenance(args, device, data))
    path = curvature.save(args.out)
    covered = sum(
        int(torch.Size(shape).numel()) for _, shape in curvature.layout or ()
    )  # parameters covered
    print(
        f"wrote {path}: {args.structure} {args.fisher} curvature of {covered:,} parameters, "
        f"a sum over {curvature.meta['num_examples']} examples ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def load(
    args: argparse.Namespace, device: torch.device, *, announce: bool
) -> tuple[nn.Module, Iterable[Any]]:
    """MODEL (on ``device``, in evaluation mode) and DATA's batches; with ``announce``, what was
    read (text: examples, tokens, truncation) and a warning about unshifted labels, on stderr."""
    model_arguments = dict(map(sources.parse_argument, args.model_arg))
    model = sources.load_model(
        args.model, model_arguments, allow_new_weights=args.allow_new_weights
    )
    model = model.to(device).eval()
    data = sources.load_data(
        args.data,
        batch_size=args.batch_size or 16,
        shift_labels=args.shift_labels,
        ignore_index=args.ignore_index,
        arguments=dict(map(sources.parse_argument, args.data_arg)),
        max_examples=args.max_examples,
        model=model,
        tokenizer=args.tokenizer or args.model,
        text=TextOptions(**{key: value for key, _, value in _text_options(args)}),
    )
    if announce:
        if isinstance(data, TextBatches):
            print(f"{args.data}: {data.summary()}", file=sys.stderr)
        sources.warn_unshifted(model, data, shift_labels=args.shift_labels)
    return model, data


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
    defaults = TextOptions()
    flags = [(flag, value, getattr(defaults, key)) for key, flag, value in _text_options(args)]
    return [*flags, ("--tokenizer", args.tokenizer, None)]


def provenance(
    args: argparse.Namespace, device: torch.device, data: Iterable[Any] | None = None
) -> dict[str, str]:
    """What the file's metadata records about how it was made (:func:`gradmerge.sources.provenance`,
    and for text the examples, tokens and truncation of :meth:`TextBatches.metadata`)."""
    meta = sources.provenance(
        args.model,
        args.data,
        device=device,
        seed=args.seed,
        mc_samples=args.mc_samples,
        ignore_index=args.ignore_index,
        batch_size=args.batch_size or 16,
        shift_labels=args.shift_labels,
        model_arguments=dict(map(sources.parse_argument, args.model_arg)),
        data_arguments=dict(map(sources.parse_argument, args.data_arg)),
        max_examples=args.max_examples,
    )
    if isinstance(data, TextBatches):
        meta.update(data.metadata())
        options = {key: value for key, _, value in _text_options(args) if value is not None}
        meta["source.text_options"] = json.dumps(options, sort_keys=True)
        meta["source.tokenizer"] = str(Path(args.tokenizer or args.model).resolve())
    return meta


# ----- --distributed (under torchrun) -------------------------------------------------------
DISTRIBUTED_EPILOG = """\
distributed (data-parallel) estimation, launched by torchrun:
  torchrun --nproc-per-node 4 --no-python gradmerge curvature runs/ft-task-a \\
      data/task_a.safetensors task_a.curvature.safetensors --structure kfac --distributed
  Every rank loads MODEL and DATA, keeps its contiguous part of the batches, estimates on it; the
  sums are all-reduced, so OUT equals the single-process estimate on all of DATA (to rounding;
  with --fisher mc each rank draws with its own seed). Rank 0 writes OUT, only when every rank
  succeeded; on any failure every rank prints the same error and exits 1, within --timeout.
  --device auto uses cuda:LOCAL_RANK (NCCL sums) when CUDA is available, else the CPU (gloo).
"""


def add_distributed_options(p: argparse.ArgumentParser) -> None:
    """``--distributed`` and its options (``--timeout``, ``--expected-examples``, ``--backend``).

    Used by ``gradmerge curvature`` (:mod:`gradmerge.commands.curvature`) and by this module's
    ``curvature`` command, where ``--distributed`` is implied.
    """
    p.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel estimation over the ranks of torchrun (see below)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a rank waits for the others before failing (default 1800; --distributed)",
    )
    p.add_argument(
        "--expected-examples",
        type=int,
        default=None,
        help="fail unless the ranks saw this many examples in all (--distributed)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="collective backend of the sums (--distributed; default: gloo on CPU, NCCL on CUDA)",
    )


def check_distributed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors for the distributed options: used without --distributed, or not torchrun."""
    if not args.distributed:
        used = [
            name
            for name, value, default in (
                ("--timeout", args.timeout, None),
                ("--expected-examples", args.expected_examples, None),
                ("--backend", args.backend, "auto"),
            )
            if value != default
        ]
        if used:
            parser.error(f"{', '.join(used)} apply only with --distributed")
        return
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not dist.is_initialized() and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        parser.error(
            "--distributed runs under torchrun (RANK/WORLD_SIZE are not set), e.g. "
            "torchrun --nproc-per-node 2 --no-python gradmerge curvature MODEL DATA OUT "
            "--distributed"
        )


def run_distributed(args: argparse.Namespace) -> int:
    """Estimate on this rank's shard, sum over the ranks, write OUT on rank 0. 0 on success.

    What ``gradmerge curvature --distributed`` and ``-m gradmerge.distributed curvature`` run;
    ``args`` are that parser's (:func:`add_distributed_options` included).
    """
    start = time.perf_counter()
    if getattr(args, "timeout", None) is None:
        args.timeout = DEFAULT_TIMEOUT.total_seconds()
    device = rank_device(args.device)
    created = init_from_env(args.backend, device, args.timeout)  # check(): under torchrun
    rank = dist.get_rank()
    try:
        model, loaded = load(args, device, announce=rank == 0)
        data: Any = shard(loaded)
        if rank == 0 and not args.no_progress:
            data = progress(data, f"{args.structure} {args.fisher} (rank 0)")
        curvature = distributed_estimate(
            model,
            data,
            timeout=args.timeout,
            expected_examples=args.expected_examples,
            **estimate_options(args),
        )
        curvature.meta.update(provenance(args, device, loaded))
        save_on_rank0(curvature, args.out, args.timeout)
    except DistributedError as err:
        print(f"gradmerge.distributed: rank {rank}: error: {err}", file=sys.stderr)
        return 1
    finally:
        if created:
            dist.destroy_process_group()
    if rank == 0:
        print(
            f"wrote {args.out}: {args.structure} {args.fisher} curvature, a sum over "
            f"{curvature.meta['num_examples']} examples on {curvature.meta['ranks']} ranks "
            f"({time.perf_counter() - start:.1f} s)"
        )
    return 0


# ----- helpers --------------------------------------------------------------------------------
def progress(data: Iterable[Any], label: str) -> Iterable[Any]:
    """``data`` with a progress bar (tqdm, on stderr) over each pass.

    A one-shot iterator stays one, so that estimators needing two passes can refuse it.
    """
    if isinstance(data, Iterator):
        return _bar(data, label, None)
    return _Passes(data, label)


class _Passes:
    def __init__(self, data: Iterable[Any], label: str) -> None:
        self.data, self.label, self.passes = data, label, 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        label = self.label if self.passes == 1 else f"{self.label} (pass {self.passes})"
        total = len(self.data) if isinstance(self.data, Sized) else None
        return _bar(self.data, label, total)


def _bar(data: Iterable[Any], label: str, total: int | None) -> Iterator[Any]:
    from tqdm import tqdm

    with tqdm(data, desc=label, total=total, unit="batch", file=sys.stderr) as bar:
        yield from bar


def _help_text() -> str:
    """This module's docstring after its title, then the forms of MODEL and DATA."""
    forms = (sources.__doc__ or "").split("MODEL is either", 1)[1].split("\n\nExample", 1)[0]
    return (__doc__ or "").split("\n\n", 1)[1] + "\nMODEL is either" + forms


def _plain(text: str) -> str:
    """Docstring text without reST markup, for --help."""
    return re.sub(r":\w+:`([^`]*)`", r"\1", text).replace("``", "")
