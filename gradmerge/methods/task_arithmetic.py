"""Task arithmetic: θ = θ_LLM + Σ_t α_t (θ_t − θ_LLM), Eq. 6 with H_t = 0 (no curvature, no prior).

The streamed rule calls :func:`gm.task_arithmetic` on each unit; the method needs only
``base_model`` and merges row blocks of a large tensor apart (``rowwise``).

Example:
    >>> METHOD.name, METHOD.coverage, METHOD.need("base_model"), METHOD.need("prior")
    ('task_arithmetic', 'none', 'required', 'forbidden')
"""

from __future__ import annotations

from gradmerge import merge
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved


def task_arithmetic(u: MergeUnit) -> Solved:
    """:func:`gm.task_arithmetic` on the unit (curvatures, prior and damping unused)."""
    return merge.task_arithmetic(u.base, u.finetuned, alphas=list(u.alphas), kernel=u.kernel), None


METHOD = MergeMethod(
    "task_arithmetic",
    "merge",
    "θ_LLM + Σ α_t (θ_t − θ_LLM); no curvature, no prior",
    {"base_model": "required"},
    task_arithmetic,
    docs="θ_LLM + Σ α_t (θ_t − θ_LLM), no curvature.",
    coverage="none",
    rowwise=True,
)
