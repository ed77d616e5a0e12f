"""``gradmerge remove CONFIG.yaml OUT_DIR``: remove data from a model (Eq. 13 or Koh & Liang)."""

from __future__ import annotations

import argparse
from typing import Any

from gradmerge.commands.merge import add_common_arguments, config_writes, run_command

EPILOG = """\
configuration (YAML; relative paths are relative to the YAML file):

  # Eq. 13: θ_\\t = θ_LLM − α H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM)
  method: remove
  base_model: path/to/base           # θ_LLM, trained on all data including D_t
  model: path/to/finetuned_on_Dt     # θ_t, fine-tuned from θ_LLM on the data D_t to remove
  curvature: Dt.curvature.safetensors   # H_t, the curvature of D_t
  prior: {delta: 1.0e-6}             # H_0 used when fine-tuning θ_t (+ curvature, scale)
  remaining: {delta: 1.0e-6, curvature: rest.curvature.safetensors, scale: 1.0}
                                     # H̄_\\t = δI + s·C: curvature at θ_LLM of the data that
                                     # stays, with the base model's own regulariser δ
                                     # C may be a list of files, summed (per-task curvatures)
  alpha: 1.0                         # α_t, the weight D_t had in θ_LLM's training loss

  # Koh & Liang (2017): θ_\\t = θ_LLM + α H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM)
  method: influence_remove
  base_model: path/to/base
  gradient: grad_Dt.safetensors      # ∇ℓ̄_t(θ_LLM) = Σ_i ∇ℓ_i, a SUM over D_t's examples:
                                     # gradmerge gradient BASE D_t.jsonl grad_Dt.safetensors
                                     # or, under the parameters' names,
                                     # safetensors.torch.save_file({n: p.grad for n, p in
                                     #   model.named_parameters()}, "grad_Dt.safetensors")
  remaining: {delta: 1.0e-6, curvature: rest.curvature.safetensors}
  alpha: 1.0

{options}

The step's size ‖θ_\\t − θ_LLM‖ is printed against the task vector ‖θ_t − θ_LLM‖ (remove) or the
weights ‖θ_LLM‖ (influence_remove); above `max_relative_step` (default 100 and 1) — a direction
where H̄_\\t is near zero exploded — `step_check: refuse` (default) writes nothing, `warn` writes
with a warning, `ignore` neither.

H̄_\\t must be positive definite: a removal that fails with "not positive definite" needs
`remaining: {delta: ...}` (the base model's prior precision). OUT_DIR appears only when the
removal succeeded, with the base's config/tokenizer files and gradmerge_remove.json.

remove a task from a merge, exactly: merge the tasks that stay again (Eq. 6 without task t)
  method: remerge
  merge: merge.yaml                  # the merge that included the task
  without: [1]                       # its models to leave out: indices (0-based) or paths
  Writes what `gradmerge merge` writes for that merge without them (gradmerge_merge.json).

remove a task from a merge by Eq. 13 (tasks a, b, c merged by gradient_matching into merged/):
  method: remove
  base_model: merged/
  model: ft_b/
  curvature: b.curvature.safetensors
  prior: {delta: δ}
  remaining: {delta: δ, curvature: [a.curvature.safetensors, c.curvature.safetensors]}
  This is Eq. 13 from the merged weights; it differs from merging a and c again by
  H̄_\\b⁻¹ H_0 (θ_merged − θ_base of the merge), small when δ is small next to the curvatures,
  and it multiplies the rounding of the stored merge by (H_0 + H_b)/H̄_\\b: where only b
  trained (H̄_\\b ≈ δ) that exceeds the step, and the removal is refused (`rounding_check`,
  `max_rounding`, default 1e-2 × ‖θ_b − θ_merged‖; --dry-run computes the same bound). Use
  `method: remerge` then.

examples:
  gradmerge remove remove.yaml unlearned/
  gradmerge remove remove.yaml unlearned/ --overwrite
  gradmerge remove remove.yaml unlearned/ --dry-run
"""


def epilog() -> str:
    """The help's text, the shared options' keys from their declarations
    (:mod:`gradmerge.commands._job_help` holds them: no torch)."""
    import textwrap

    from gradmerge.commands._job_help import TEXTS

    return EPILOG.replace(
        "{options}",
        textwrap.fill(
            f"Both also take the options of merges ({TEXTS['remove_options']}); every key "
            "is described once, with examples, in docs/config.md of the gradmerge repository.",
            width=96,
            initial_indent="  ",
            subsequent_indent="  ",
        ),
    )


def add_parser(sub: Any) -> None:
    """Register ``gradmerge remove``."""
    p = sub.add_parser(
        "remove",
        help="remove data or a task from a model (Eq. 13, Koh & Liang), streaming",
        description="Remove the data D_t from a model by gradient matching (Eq. 13, from a model "
        "fine-tuned on D_t) or by the influence-function step of Koh & Liang (from the gradient "
        "of D_t's loss at the model), reading and writing safetensors group by group.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=epilog(),
    )
    add_common_arguments(p)
    p.set_defaults(run=run, writes=lambda args: config_writes(args, load(args.config)))


def run(args: argparse.Namespace) -> int:
    """Run ``gradmerge remove``; 0 on success, 1 on bad input (the message goes to stderr)."""
    from gradmerge.jobs import plan_merge, plan_remove, run_merge, run_remove
    from gradmerge.jobs.config import MergeConfig

    def plan(config: Any) -> Any:
        return plan_merge(config) if isinstance(config, MergeConfig) else plan_remove(config)

    def execute(config: Any, *a: Any, **k: Any) -> Any:
        return (run_merge if isinstance(config, MergeConfig) else run_remove)(config, *a, **k)

    return run_command(args, "remove", load, plan, execute)


def load(path: str) -> Any:
    """The configuration at ``path``: a :class:`RemoveConfig`, or for a method that runs as a
    merge (``remerge``) the :class:`MergeConfig` it runs (:func:`gradmerge.jobs.config.load`)."""
    from gradmerge.jobs.config import load as load_config

    return load_config(path, "remove")
