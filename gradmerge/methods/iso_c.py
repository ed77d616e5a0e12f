"""Iso-C (Marczak et al., ICML 2025): per weight matrix, Σ_t α_t τ_t = U S Vᵀ with its spectrum
made flat, θ_LLM + mean(S)·U Vᵀ.

Other tensors and the matrices named in ``average`` get the mean of the α_t τ_t; no curvature
(:func:`gm.iso_c`, :mod:`gradmerge.merge.spectral`).

Example:
    >>> METHOD.coverage, sorted(METHOD.uses)
    ('none', ['average', 'base_model'])
"""

from __future__ import annotations

from gradmerge.merge import spectral
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved


def iso_c(u: MergeUnit) -> Solved:
    """:func:`gm.iso_c` on the unit (curvatures, prior and damping unused)."""
    return spectral.iso_c(u.base, u.finetuned, alphas=list(u.alphas), average=u.averaged()), None


METHOD = MergeMethod(
    "iso_c",
    "merge",
    "Iso-C (Marczak et al., ICML 2025): per matrix, Σ α_t τ_t = U S Vᵀ with a flat\n"
    "spectrum, θ_LLM + mean(S)·U Vᵀ; other tensors and `average`: the mean",
    {"base_model": "required", "average": "optional"},
    iso_c,
    docs="Iso-C (Marczak et al., ICML 2025), the task-arithmetic sum of each weight matrix "
    "with its spectrum made flat, no curvature "
    "([below](#data-free-merges-in-the-singular-basis-tsv_merge-iso_c-iso_cts)).",
    coverage="none",
)
