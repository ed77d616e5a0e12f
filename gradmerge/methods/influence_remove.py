"""Removal by the influence function (Koh & Liang, 2017): θ_\\t = θ_LLM + α H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM).

It needs only the gradient ∇ℓ̄_t(θ_LLM) of the data to remove (``gradient:``, a SUM over D_t)
and the remaining curvature H̄_\\t; its default ``max_relative_step`` is 1 (× ‖θ_LLM‖).

Example:
    >>> METHOD.command, METHOD.max_relative_step, sorted(METHOD.uses)
    ('remove', 1.0, ['gradient'])
"""

from __future__ import annotations

from gradmerge import merge
from gradmerge.errors import ArgumentError
from gradmerge.methods.base import RemoveUnit, Solved, removal


def influence_remove(u: RemoveUnit) -> Solved:
    """:func:`gm.influence_remove` (Koh & Liang) on the unit (model, curvature, prior unused)."""
    if u.gradient is None:
        raise ArgumentError("the influence-function removal needs the gradient ∇ℓ̄_t(θ_LLM)")
    removed = merge.with_solution(
        merge.influence_remove,
        u.base,
        u.gradient,
        remaining=u.remaining,
        alpha=u.alpha,
        solver=u.solver,
    )
    return removed.params, removed.solution


METHOD = removal(
    "influence_remove",
    "Koh & Liang (2017): θ_LLM + α H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM)",
    {"gradient": "required"},
    influence_remove,
    step=1.0,
    docs="Koh & Liang (2017), θ_\\t = θ_LLM + α H̄_\\t⁻¹ ∇ℓ̄_t(θ_LLM), with the gradient of D_t "
    "at θ_LLM (`gradmerge gradient`).",
)
