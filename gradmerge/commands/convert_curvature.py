"""``gradmerge convert-curvature SRC OUT.safetensors``: a Fisher of the paper's official code.

What SRC and OUT are is :data:`DESCRIPTION`, the command's ``--help`` (a string, not this
docstring, so that the help survives ``python -OO``); the conversion is
:mod:`gradmerge.io.official`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from gradmerge.commands._flags import OVERWRITE
from gradmerge.commands._writes import Writes, file_output
from gradmerge.foundation.guard import Input

DESCRIPTION = """\
SRC is a curvature as the official code (UKPLab/iclr2024-model-merging) writes it: a Hugging Face
model folder (<run>/hessian/) whose weights are per-parameter diagonal Fisher values —
model.safetensors, sharded safetensors with an index, or pytorch_model.bin read with
torch.load(weights_only=True) — or one state-dict file of such values. OUT is a gradmerge
diagonal curvature file holding S × those values.
"""

EPILOG = """\
reproducing the official merge (uncertainty_based_gradient_matching.py with --scaling_factor λ,
--scaling_factors_ft κ_1,κ_2, --scaling_factor_pt s, --delta_0 δ):

  gradmerge convert-curvature runs/task1-fisher/hessian F1.safetensors --scale κ_1
  gradmerge convert-curvature runs/task2-fisher/hessian F2.safetensors --scale κ_2
  gradmerge convert-curvature runs/base-fisher/hessian F0.safetensors --scale s
  gradmerge merge merge.yaml merged/

  # merge.yaml
  method: gradient_matching
  base_model: runs/base
  models:
    - {model: runs/task1, curvature: F1.safetensors, alpha: λ}
    - {model: runs/task2, curvature: F2.safetensors, alpha: λ}
  prior: {delta: δ, curvature: F0.safetensors}

  H̄ = λΣκ_tF_t + sF_0 + δ and θ = θ_0 + λΣ_t H̄⁻¹(κ_tF_t + δ + sF_0)(θ_t − θ_0): Eq. 6 with
  α_t = λ, H_t = κ_tF_t, H_0 = δ + sF_0. The official values are means over batches; gradmerge's
  own curvatures are sums over examples (--num-examples N records N; it does not rescale).

Float tensors are converted, except names holding position_ids or masked_bias (buffers the official
script leaves out). Negative, NaN or infinite values are errors.
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge convert-curvature``."""
    p = sub.add_parser(
        "convert-curvature",
        help="convert a diagonal Fisher of the paper's official code to a curvature file",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument("src", metavar="SRC", help="the official code's hessian/ folder or a file")
    p.add_argument("out", metavar="OUT.safetensors", help="the curvature file to write")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        metavar="S",
        help="multiply every value by S (%(default)s)",
    )
    p.add_argument(
        "--num-examples",
        type=int,
        default=None,
        metavar="N",
        help="record N as the curvature's number of examples",
    )
    OVERWRITE.add(p, what="an existing OUT")
    p.set_defaults(run=run, check=check, writes=writes)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments before any work (argparse error: exit 2 with usage)."""
    if not (math.isfinite(args.scale) and args.scale > 0):
        parser.error(f"--scale must be a positive finite number, got {args.scale}")
    if args.num_examples is not None and args.num_examples < 1:
        parser.error(f"--num-examples must be at least 1, got {args.num_examples}")
    out = Path(args.out)
    if out.suffix != ".safetensors" and not out.is_dir():
        parser.error(f"OUT {out} must be a .safetensors file name")


def writes(args: argparse.Namespace) -> Writes:
    """The output guard's declaration: the file OUT, and SRC (a file or a folder)."""
    return Writes(file_output("OUT", args.out), [Input("SRC", Path(args.src))])


def run(args: argparse.Namespace) -> int:
    """Convert; 0 on success, 1 on bad input (one line on stderr; OUT is not written)."""
    from gradmerge.errors import GradmergeError
    from gradmerge.io.official import convert_curvature

    try:
        curvature = convert_curvature(
            args.src, args.out, scale=args.scale, num_examples=args.num_examples
        )
    except (GradmergeError, OSError) as err:
        print(f"gradmerge convert-curvature: error: {err}", file=sys.stderr)
        return 1
    covered = sum(v.numel() for v in curvature.values.values())
    print(
        f"wrote {args.out}: diagonal curvature of {len(curvature.values)} tensors "
        f"({covered:,} parameters) from {args.src}, scaled by {args.scale:g}"
    )
    return 0
