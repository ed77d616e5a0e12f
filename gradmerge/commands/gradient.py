"""``gradmerge gradient MODEL DATA OUT``: the SUM of the per-example loss gradients, saved.

What it computes is :data:`DESCRIPTION`, the command's ``--help`` (a string, not this docstring,
so that the help survives ``python -OO``): :func:`gradmerge.gradient_fn` at MODEL's weights on
DATA, written under the parameters' names for ``gradmerge remove``'s ``influence_remove``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradmerge.commands._inputs import (
    add_source_arguments,
    check_sources,
    load,
    progress,
    provenance,
)

if TYPE_CHECKING:  # imported where used: the parser and --help need no torch
    from torch import Tensor

FORMAT = "gradmerge-gradient/1"
DESCRIPTION = """\
g = ∇ℓ̄(θ) = Σ_i ∇ℓ_i(θ), a SUM over the examples of DATA (the convention of every curvature:
a sequence's loss sums its tokens, ignored positions count for nothing) at the weights θ of MODEL,
computed by gradmerge.gradient_fn and written as a safetensors file under the parameters'
names — the `gradient:` of a Koh & Liang removal (`method: influence_remove` in
gradmerge remove), where MODEL is θ_LLM and DATA the data D_t to remove. Divide by the
num_examples of the file's metadata for the mean gradient.

MODEL and DATA are read as by gradmerge curvature (text, tensor files, entry points; see its
--help). The model is put in evaluation mode (no dropout).
"""
EXAMPLES = """\
examples:
  # the gradient of the data to remove, at the model to remove it from (θ_LLM)
  gradmerge gradient runs/base data/task_b.jsonl grad_b.safetensors
  # then, in remove.yaml:  method: influence_remove, base_model: runs/base,
  #   gradient: grad_b.safetensors, remaining: {delta: ..., curvature: [...]}
  gradmerge remove remove.yaml unlearned/
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge gradient``."""
    p = sub.add_parser(
        "gradient",
        help="the SUM of per-example loss gradients of a model on data (for Koh & Liang removal)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    add_source_arguments(p, "gradient file to write (.safetensors)")
    p.set_defaults(run=run, check=check)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage)."""
    check_sources(parser, args)


def run(args: argparse.Namespace) -> int:
    """``gradmerge gradient``: 0 on success, 1 on bad input (one line of stderr)."""
    from gradmerge.errors import GradmergeError

    try:
        return execute(args)
    except (GradmergeError, OSError) as err:
        print(f"gradmerge gradient: error: {err}", file=sys.stderr)
        return 1


def execute(args: argparse.Namespace) -> int:
    """Load, differentiate, save atomically; print one summary line."""
    import torch

    import gradmerge as gm
    from gradmerge.errors import NonFiniteError
    from gradmerge.foundation.devices import resolve_device

    start = time.perf_counter()
    device = resolve_device(args.device)
    model, data = load(args, device, announce=True)
    counted = _Counted(data if args.no_progress else progress(data, "gradient"))
    theta = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    gradient = gm.gradient_fn(model, counted, loss=args.loss, ignore_index=args.ignore_index)(theta)
    bad = [k for k, v in gradient.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise NonFiniteError(
            f"the gradient of {bad[:3]} holds NaN/Inf values: check the model's weights and "
            "the data (labels in range, no NaN inputs)"
        )
    meta = {
        "format": FORMAT,
        "reduction": "sum",
        "num_examples": str(counted.examples),
        "loss": args.loss,
        **provenance(args, device, data),
    }
    path = save_gradient(gradient, Path(args.out), meta)
    print(
        f"wrote {path}: the gradient of {sum(v.numel() for v in gradient.values()):,} parameters, "
        f"a sum over {counted.examples} examples ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def save_gradient(gradient: dict[str, Tensor], out: Path, meta: dict[str, str]) -> Path:
    """Write the tensors and metadata to ``out`` atomically (a temporary file, then renamed;
    :class:`~gradmerge.errors.OutputWriteError` and nothing left when it cannot be written)."""
    from safetensors.torch import save_file

    from gradmerge.foundation.guard import staged_file

    with staged_file(out, "OUT") as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in gradient.items()}, tmp, meta)
    return out


class _Counted:
    """Re-iterable batches that count their examples (rows) on each pass."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data, self.examples = data, 0

    def __iter__(self) -> Iterator[Any]:
        from gradmerge.estimate._data import split_batch

        self.examples = 0
        for index, batch in enumerate(self.data):
            _, targets = split_batch(batch, index)
            self.examples += int(targets.shape[0]) if targets.ndim else 1
            yield batch
