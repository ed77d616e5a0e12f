"""``gradmerge refine CONFIG.yaml OUT_DIR``: refine a merged checkpoint on the tasks' data."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gradmerge.commands._flags import OVERWRITE

EPILOG = """\
configuration (YAML; relative paths are relative to the YAML file):

  start: merged/                  # θ^0: the merge to refine (Hugging Face folder or module:function)
  base_model: path/to/base        # θ_LLM
  models:
    - model: path/to/finetuned_a  # θ_t (for the gradient mismatch of Eq. 2)
      data: task_a.safetensors    # D_t: tensor file or module:function, as `gradmerge curvature`
      alpha: 1.0                  # α_t (default 1.0)
    - {model: path/to/finetuned_b, data: mypkg.data:task_b}
  prior: {delta: 1.0e-3}          # H_0 = δI (+ scale · curvature file), the fine-tunes' prior
  steps: 2                        # 1 ≤ k ≤ 100 refinement steps
  structure: kfac                 # curvature re-estimated at every iterate: diag | kfac | full
  fisher: empirical               # empirical | mc | ggn | hessian (structure full only)
  loss: cross_entropy             # cross_entropy | mse
  batch_size: 16                  # rows per batch of a tensor file
  shift_labels: false             # labels = input_ids (causal LM): shift them left by one
  ignore_index: -100
  seed: 0                         # Monte-Carlo labels (fisher: mc)
  device: auto                    # auto | cpu | cuda | cuda:N
  text: {text_field: text, label_field: label, max_length: 128}   # how text DATA is read

Every key is described once, with examples, in docs/config.md of the gradmerge repository.

Each step is θ ← θ − (H_0 + Σ α_t H_t(θ))⁻¹ [H_0(θ − θ_LLM) + Σ α_t ∇ℓ̄_t(θ)] (gm.refine, with
backtracking on the norm of the bracket, R), H_t and ∇ℓ̄_t SUMS over D_t at the current θ. Not
streamed: θ, θ_LLM and every θ_t are held in memory. OUT_DIR appears only when the run
succeeded: the refined model saved as the start was, and gradmerge_refine.json with the
gradient mismatch Σ_t ‖∇ℓ̄_t(θ^k) − ∇ℓ̄_t(θ_t)‖ (per task and summed) and ‖R(θ^k)‖ of every step.

An entry point (module:function, path/to/file.py:function) is imported and called: it RUNS CODE,
with your permissions. A YAML file naming one is refused unless --allow-entry-points (or
GRADMERGE_ALLOW_ENTRY_POINTS=1) says to trust it as you would a script (docs/trust.md).

examples:
  gradmerge merge merge.yaml merged/ && gradmerge refine refine.yaml refined/
  gradmerge refine refine.yaml refined/ --overwrite
"""


def add_parser(sub: Any) -> None:
    """Register ``gradmerge refine``."""
    p = sub.add_parser(
        "refine",
        help="refine a merge towards the multi-task model with Newton-like steps on the data",
        description="Refine a merged checkpoint (Sec. 1.5, gm.refine): k steps towards the "
        "multi-task MAP, each with the tasks' gradients and curvatures re-estimated at the "
        "current weights; records each step's gradient mismatch.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument("config", metavar="CONFIG.yaml", help="the configuration (see below)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output folder (must not exist)")
    OVERWRITE.add(p, what="OUT_DIR if it exists")
    p.add_argument(
        "--allow-entry-points",
        action="store_true",
        help="let CONFIG name Python entry points (module:function), which RUN CODE: only for "
        "a file you trust as a script (also: GRADMERGE_ALLOW_ENTRY_POINTS=1)",
    )
    p.set_defaults(run=run, writes=writes)


def writes(args: argparse.Namespace) -> Any:
    """The output guard's declaration: OUT_DIR, and CONFIG with every path it names."""
    from gradmerge.commands.merge import config_writes
    from gradmerge.jobs.refine import RefineConfig

    config = RefineConfig.from_yaml(args.config, allow_entry_points=args.allow_entry_points or None)
    return config_writes(args, config)


def run(args: argparse.Namespace) -> int:
    """Run ``gradmerge refine``; 0 on success, 1 on bad input (one line on stderr)."""
    from gradmerge.errors import GradmergeError
    from gradmerge.jobs.refine import RefineConfig, run_refine

    try:
        config = RefineConfig.from_yaml(
            args.config, allow_entry_points=args.allow_entry_points or None
        )
        report = run_refine(config, args.out_dir, overwrite=args.overwrite, log=print)
    except (GradmergeError, OSError) as err:
        print(f"gradmerge refine: error: {err}", file=sys.stderr)
        return 1
    first, last = report.steps[0], report.steps[-1]
    print(
        f"refine: {len(report.steps) - 1} steps, mismatch {first['mismatch_total']:.6g} -> "
        f"{last['mismatch_total']:.6g}, ‖R‖ {first['residual']:.6g} -> {last['residual']:.6g}; "
        f"wrote {report.out_dir} in {report.seconds:.2f} s on {report.device}"
    )
    return 0
