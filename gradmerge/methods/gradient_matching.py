"""Gradient matching (Eq. 6): θ = θ_LLM + H̄⁻¹ Σ_t α_t (H_0 + H_t)(θ_t − θ_LLM),
H̄ = H_0 + Σ_t α_t H_t.

The prior H_0 (``prior:``, required) damps H̄; the dry run checks H̄ (:func:`system`).

Example:
    >>> import gradmerge as gm
    >>> from gradmerge.methods.base import SystemInputs
    >>> x = SystemInputs(models=(gm.ScaledIdentity(2.0),), alphas=(1.0,),
    ...                  prior=gm.ScaledIdentity(0.5))
    >>> system(x).min_eigenvalue()
    2.5
"""

from __future__ import annotations

from gradmerge import merge
from gradmerge.curvature import Curvature
from gradmerge.errors import ArgumentError
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved, SystemInputs, total


def gradient_matching(u: MergeUnit) -> Solved:
    """:func:`gm.gradient_matching` (Eq. 6) on the unit with ``prior`` H_0 (damping unused)."""
    hs = u.hs()
    if u.prior is None:
        raise ArgumentError("gradient matching needs a prior H_0")
    merged = merge.with_solution(
        merge.gradient_matching,
        u.base,
        u.finetuned,
        hs,
        prior=u.prior,
        alphas=list(u.alphas),
        kernel=u.kernel,
        solver=u.solver,
    )
    return merged.params, merged.solution


def system(x: SystemInputs) -> Curvature | None:
    """H̄ = H_0 + Σ_t α_t H_t."""
    return total([*x.models, x.prior])


METHOD = MergeMethod(
    "gradient_matching",
    "merge",
    "Eq. 6: θ_LLM + H̄⁻¹ Σ α_t (H_0 + H_t)(θ_t − θ_LLM), H̄ = H_0 + Σ α_t H_t;\n`prior` required",
    {"base_model": "required", "curvature": "required", "prior": "required"},
    gradient_matching,
    docs="Eq. 6.",
    system=system,
    damping_at=("prior", "delta"),
    hint="raise `prior: {{delta: ...}}` ({example}) so that H̄ is positive definite",
    rowwise=True,
)
