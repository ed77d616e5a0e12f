"""``gradmerge curvature MODEL DATA OUT``: estimate a task's curvature H_t and save it.

What it computes is :data:`DESCRIPTION`, followed in ``--help`` by the forms of MODEL and DATA
(:data:`gradmerge.io.sources.FORMS`): strings, not docstrings, so that the help survives
``python -OO``. The estimate is :func:`gradmerge.estimate_curvature`'s, written with ``C.save``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from gradmerge.commands._flags import TIMEOUT, setting_flag
from gradmerge.commands._inputs import (
    FORMS,
    add_source_arguments,
    check_sources,
    load,
    progress,
    provenance,
)
from gradmerge.errors import ArgumentError
from gradmerge.estimate.options import EstimateOptions  # its declarations: no torch
from gradmerge.foundation.settings import declared, default_of

if TYPE_CHECKING:  # imported where used: the parser and --help need no torch
    import torch

OPTIONS = declared(EstimateOptions)
"""The estimator's options, declared once (:class:`gradmerge.EstimateOptions`): the flags below
take their defaults, choices and help from these declarations
(:func:`gradmerge.commands._flags.setting_flag`)."""


def _choices(name: str) -> tuple[str, ...]:
    return tuple(str(choice) for choice in OPTIONS[name].choices)


STRUCTURES = _choices("structure")
FISHERS = _choices("fisher")
KFAC_APPROXES = _choices("kfac_approx")
MAX_FACTOR_SIDE = default_of(EstimateOptions, "kfac_max_factor_side")

DESCRIPTION = """\
H_t = Σ_i ∇²ℓ_i (or its Fisher/GGN), a SUM over the examples of DATA, at the weights of MODEL
(θ_t for a fine-tuned model's H_t, θ_LLM for a prior or for removal): a call of
gradmerge.estimate_curvature written with C.save(OUT) (atomic), so that gradmerge merge /
gm.load_curvature can read it. Where MODEL and DATA came from is kept in the file's metadata
(C.meta["source.*"] after loading).

MODEL and DATA are read by gradmerge.io.sources (its forms are listed below). A tensor file is
cut into batches of --batch-size rows; its labels are the targets of each position's logits;
--shift-labels turns Hugging Face's causal-LM convention (labels = input_ids) into that.
Positions whose attention_mask is 0 are ignored.

The model is put in evaluation mode (no dropout), so the estimate is that of the weights given.

A LoRA adapter MODEL (a PEFT folder) is estimated at its materialised weights W + s·B·A, over
the parameters the adapter changes only: its target modules (weight and bias: K-FAC couples
them in one layer) and its modules_to_save. Everywhere else its task vector is zero and no
curvature can change a merge (gradmerge merge copies the base there), so nothing is spent on
it; the file records restricted = adapter. --whole-model estimates over every parameter.
"""

EXAMPLES = """\
examples:
  # a Hugging Face classifier and a JSONL file ({"text": ..., "label": "positive"} per line),
  # tokenised with the folder's own tokenizer; labels are names of config.json's label2id or ids
  gradmerge curvature runs/ft-sentiment data/sentiment.jsonl sentiment.curvature.safetensors \\
      --structure kfac --max-length 128
  # a causal LM and plain text, one example per line (targets: the next tokens)
  gradmerge curvature runs/ft-lm data/corpus.txt lm.curvature.safetensors --max-examples 1000
  # CSV with other column names, sentence pairs; a datasets folder (save_to_disk) works the same
  gradmerge curvature runs/ft-nli data/nli.csv nli.curvature.safetensors \\
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
      --structure kfac --kfac-max-factor-side 8192 --shift-labels
"""


PASSES = {
    "kfac": (
        "pass 1 of up to 2: the Kronecker factors",
        "pass 2 of 2: a diagonal block for the parameters K-FAC leaves out",
    )
}
"""The passes over DATA an estimate makes, by structure (announced up front; one otherwise)."""


def max_side(text: str) -> int | None:
    """``--kfac-max-factor-side``: a positive int, or ``none`` for no limit."""
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
        description=_help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES + "\n" + DISTRIBUTED_EPILOG,
    )
    add_source_arguments(p, "curvature file to write (.safetensors)")
    for name in ("structure", "fisher", "mc_samples", "seed", "kfac_approx"):
        setting_flag(p, EstimateOptions, name)
    setting_flag(
        p,
        EstimateOptions,
        "kfac_max_factor_side",
        aliases=("--kfac-max-side",),  # the flag's first name: an alias, still accepted
        type=max_side,
        metavar="N",
    )
    setting_flag(p, EstimateOptions, "max_params")
    p.add_argument(
        "--whole-model",
        action="store_true",
        help="a LoRA adapter MODEL: estimate over every parameter of the materialised model; "
        "default: only over the parameters the adapter changes (its target modules and "
        "modules_to_save), which is all a merge needs",
    )
    add_distributed_options(p)  # --distributed, --timeout, --expected-examples, --backend
    p.set_defaults(run=run, check=check)


def estimate_options(args: argparse.Namespace) -> EstimateOptions:
    """The estimator's options from the command-line flags (also under --distributed).

    Raises:
        ArgumentError: flags the options refuse (:class:`gradmerge.EstimateOptions`).
    """
    from gradmerge.estimate.options import EstimateOptions

    return EstimateOptions(
        structure=args.structure,
        fisher=args.fisher,
        loss=args.loss,
        mc_samples=args.mc_samples,
        seed=args.seed,
        ignore_index=args.ignore_index,
        kfac_approx=args.kfac_approx,
        max_params=args.max_params,
        kfac_max_factor_side=args.kfac_max_factor_side,
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage); the
    estimator's options are checked by :class:`gradmerge.EstimateOptions`, whose message names
    the option as Python does (``mc_samples``), said here as the flag (``--mc-samples``)."""
    try:
        estimate_options(args)
    except ArgumentError as err:
        parser.error(as_flags(str(err)))
    check_distributed(parser, args)
    check_sources(parser, args)
    if args.whole_model and not _is_adapter(args.model):
        parser.error("--whole-model applies to a LoRA adapter MODEL; MODEL is not one")


def _is_adapter(spec: str) -> bool:
    """Whether MODEL ``spec`` is a PEFT LoRA adapter folder."""
    from gradmerge.io.lora import is_adapter

    return is_adapter(spec) and not (":" in spec and not os.path.isdir(spec))


RESTRICTED = "adapter"
"""``C.meta["restricted"]`` of a curvature estimated over the parameters an adapter changes."""


def restrict_to_adapter(args: argparse.Namespace, model: torch.nn.Module) -> list[str] | None:
    """For a LoRA adapter MODEL (and not ``--whole-model``): freeze every parameter but those the
    adapter changes (:func:`gradmerge.io.lora.adapted_parameters`), so that every estimator
    covers those only (each covers the trainable parameters); their names, else ``None``.

    The estimate over them equals the whole model's restricted to them: a diagonal entry is a
    sum over examples of a squared gradient component, a K-FAC layer's A and G are its inputs'
    and output gradients' statistics, and none depends on which other parameters are trainable.
    """
    if getattr(args, "whole_model", False) or not _is_adapter(args.model):
        return None
    from pathlib import Path

    from gradmerge.io.lora import adapted_parameters

    names = adapted_parameters(Path(args.model), [n for n, _ in model.named_parameters()])
    keep = set(names)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in keep)
    return names


def _restricted_meta(names: list[str] | None) -> dict[str, str]:
    """What the file records about a restriction to an adapter's parameters."""
    if names is None:
        return {}
    return {"restricted": RESTRICTED, "restricted_parameters": str(len(names))}


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
    :mod:`gradmerge.errors` on bad input (see :mod:`gradmerge.io.sources`)."""
    if getattr(args, "distributed", False):  # under torchrun: gradmerge.distributed's path
        return run_distributed(args)
    import torch

    from gradmerge.estimate import estimate_with
    from gradmerge.foundation.devices import resolve_device

    start = time.perf_counter()
    device = resolve_device(args.device)
    model, data = load(args, device, announce=True)
    restricted = restrict_to_adapter(args, model)
    if restricted is not None:
        total = sum(p.numel() for _, p in model.named_parameters())
        kept = sum(p.numel() for _, p in model.named_parameters() if p.requires_grad)
        print(
            f"{args.model}: a LoRA adapter: over the {len(restricted)} tensors it changes "
            f"({kept:,} of {total:,} parameters; --whole-model for all)",
            file=sys.stderr,
        )
    passes = PASSES.get(args.structure, ())
    if len(passes) > 1:
        print(
            f"{args.structure}: up to {len(passes)} passes over DATA ({'; '.join(passes)})",
            file=sys.stderr,
        )
    label = f"curvature {args.structure} {args.fisher}"
    batches = data if args.no_progress else progress(data, label, passes)
    curvature = estimate_with(model, batches, estimate_options(args))
    curvature.meta.update(provenance(args, device, data))
    curvature.meta.update(_restricted_meta(restricted))
    path = curvature.save(args.out)
    covered = sum(
        int(torch.Size(shape).numel()) for _, shape in curvature.layout or ()
    )  # parameters covered
    print(
        f"wrote {path}: {args.structure} {args.fisher} curvature of {covered:,} parameters, "
        f"a sum over {curvature.meta['num_examples']} examples ({time.perf_counter() - start:.1f} s)"
    )
    return 0


OPTION_FLAGS = tuple(name for name, option in OPTIONS.items() if option.flag)
"""The estimator's options that are flags of ``gradmerge curvature`` (``--mc-samples``, ...):
those whose declaration names a flag (``Setting.flag``)."""


def as_flags(message: str) -> str:
    """An :class:`~gradmerge.EstimateOptions` message in the command line's words: an option's
    name becomes its flag, ``name='value'`` the flag and its value, an int an integer.

    Example:
        >>> as_flags("mc_samples=2 only applies to fisher='mc'; leave it at 1")
        '--mc-samples 2 only applies to --fisher mc; leave it at 1'
    """
    import re

    names = "|".join(OPTION_FLAGS)

    def flag(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        text = str(OPTIONS[name].flag)
        return f"{text} {value.strip(chr(39) + chr(34))}" if value else text

    message = re.sub(rf"\b({names})\b(?:=('[^']*'|\"[^\"]*\"|[\w.+-]+))?", flag, message)
    message = re.sub(r"\bpositive int\b", "positive integer", message)
    return message.replace("None for", "none for")


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
    TIMEOUT.add(p, when="; --distributed")
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
        help="collective backend of the sums (--distributed): gloo, nccl, or auto (default): gloo on "
        "CPU, NCCL on CUDA",
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
    import torch.distributed as dist

    if not dist.is_initialized() and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        parser.error(
            "--distributed runs under torchrun (RANK/WORLD_SIZE are not set), e.g. "
            "torchrun --nproc-per-node 2 --no-python gradmerge curvature MODEL DATA OUT "
            "--distributed"
        )


def run_distributed(args: argparse.Namespace) -> int:
    """Estimate on this rank's shard, sum over the ranks, write OUT on rank 0. 0 on success.

    What ``gradmerge curvature --distributed`` and ``-m gradmerge.commands.distributed curvature``
    run; ``args`` are that parser's (:func:`add_distributed_options` included).
    """
    import torch.distributed as dist

    from gradmerge.distributed.errors import DistributedError
    from gradmerge.distributed.estimate import DEFAULT_TIMEOUT
    from gradmerge.distributed.estimate import estimate_with as distributed_estimate
    from gradmerge.distributed.launch import init_from_env, rank_device, save_on_rank0
    from gradmerge.distributed.shard import shard

    start = time.perf_counter()
    if getattr(args, "timeout", None) is None:
        args.timeout = DEFAULT_TIMEOUT.total_seconds()
    device = rank_device(args.device)
    created = init_from_env(args.backend, device, args.timeout)  # check(): under torchrun
    rank = dist.get_rank()
    try:
        model, loaded = load(args, device, announce=rank == 0)
        restricted = restrict_to_adapter(args, model)
        data: Any = shard(loaded)
        if rank == 0 and not args.no_progress:
            label = f"curvature {args.structure} {args.fisher} (rank 0)"
            data = progress(data, label, PASSES.get(args.structure, ()))
        curvature = distributed_estimate(
            model,
            data,
            estimate_options(args),
            timeout=args.timeout,
            expected_examples=args.expected_examples,
        )
        curvature.meta.update(provenance(args, device, loaded))
        curvature.meta.update(_restricted_meta(restricted))
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
def _help_text() -> str:
    """The command's description, then the forms of MODEL and DATA."""
    return DESCRIPTION + "\n" + FORMS
