"""Removal by Eq. 13: θ_\\t = θ_LLM − α H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM).

The data D_t of one task is removed from θ_LLM with the model θ_t fine-tuned on it, its
curvature H_t, the prior H_0 and the remaining curvature H̄_\\t (``remaining:``, the system the
dry run checks). Its default ``max_relative_step`` is 100 (× ‖θ_t − θ_LLM‖).

Example:
    >>> METHOD.command, METHOD.max_relative_step, METHOD.damping_key
    ('remove', 100.0, 'remaining: {delta: ...}')
"""

from __future__ import annotations

from gradmerge import merge
from gradmerge.errors import ArgumentError
from gradmerge.methods.base import RemoveUnit, Solved, removal, required


def remove(u: RemoveUnit) -> Solved:
    """:func:`gm.remove` (Eq. 13) on the unit (gradient unused)."""
    if u.finetuned is None or u.prior is None:
        raise ArgumentError("removal by Eq. 13 needs the fine-tuned model θ_t and the prior H_0")
    h_t = required(u.curvature, 0)
    removed = merge.with_solution(
        merge.remove,
        u.base,
        u.finetuned,
        h_t,
        remaining=u.remaining,
        prior=u.prior,
        alpha=u.alpha,
        solver=u.solver,
    )
    return removed.params, removed.solution


METHOD = removal(
    "remove",
    "Eq. 13: θ_LLM − α H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM)",
    {"model": "required", "curvature": "required", "prior": "required"},
    remove,
    step=100.0,
    bounds_rounding=True,
    docs="Eq. 13, θ_\\t = θ_LLM − α H̄_\\t⁻¹ (H_0 + H_t)(θ_t − θ_LLM), with the model θ_t "
    "fine-tuned on D_t, its curvature H_t and the prior H_0.",
)
