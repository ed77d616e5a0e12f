"""Fisher averaging: θ = (Σ_t α_t H_t)⁻¹ Σ_t α_t H_t θ_t, Eq. 6 with H_0 → 0.

An optional ``damping: δ`` adds δ·I to each H_t; ``base_model`` is optional (default: the
first model). The dry run checks Σ_t α_t (H_t + δ·I) (:func:`system`).

Example:
    >>> import gradmerge as gm
    >>> from gradmerge.methods.base import SystemInputs
    >>> x = SystemInputs(models=(gm.ScaledIdentity(2.0),), alphas=(0.5,), damping=1.0)
    >>> system(x).min_eigenvalue()
    2.5
"""

from __future__ import annotations

from gradmerge import merge
from gradmerge.curvature import Curvature
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved, SystemInputs, total


def fisher_average(u: MergeUnit) -> Solved:
    """:func:`gm.fisher_average` on the unit with H_t + damping·I (base and prior unused)."""
    damped = [h + u.damping if u.damping else h for h in u.hs()]
    return merge.fisher_average(u.finetuned, damped, alphas=list(u.alphas), kernel=u.kernel), None


def system(x: SystemInputs) -> Curvature | None:
    """Σ_t α_t (H_t + damping·I)."""
    summed = total(x.models)
    damping = x.damping * sum(x.alphas)
    return summed + damping if summed is not None and damping else summed


METHOD = MergeMethod(
    "fisher_average",
    "merge",
    "(Σ α_t H_t)⁻¹ Σ α_t H_t θ_t; optional `damping: δ` adds δI to each H_t;\n"
    "base_model optional (default: the first model)",
    {"base_model": "optional", "curvature": "required", "damping": "optional"},
    fisher_average,
    docs="(Σ α_t H_t)⁻¹ Σ α_t H_t θ_t.",
    system=system,
    damping_at=("damping",),
    hint="set `damping:` ({example}) so that Σ α_t H_t is positive definite",
    rowwise=True,
)
