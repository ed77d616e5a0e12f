"""TSV-M (Gargiulo et al., CVPR 2025): per weight matrix, each task's top ⌊r/T⌋ singular
directions, the concatenated bases whitened (U ↦ P Qᵀ), θ_LLM + polar(U) S polar(V)ᵀ.

Other tensors and the matrices named in ``average`` get the mean of the α_t τ_t; no curvature
(:func:`gm.tsv_merge`, :mod:`gradmerge.merge.spectral`).

Example:
    >>> METHOD.coverage, sorted(METHOD.uses)
    ('none', ['average', 'base_model'])
"""

from __future__ import annotations

from gradmerge.merge import spectral
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved


def tsv_merge(u: MergeUnit) -> Solved:
    """:func:`gm.tsv_merge` (TSV-M) on the unit (curvatures, prior and damping unused)."""
    return spectral.tsv_merge(
        u.base, u.finetuned, alphas=list(u.alphas), average=u.averaged()
    ), None


METHOD = MergeMethod(
    "tsv_merge",
    "merge",
    "TSV-M (Gargiulo et al., CVPR 2025): per matrix, each task's top ⌊r/T⌋\n"
    "singular directions, whitened (U ↦ PQᵀ), θ_LLM + polar(U) S polar(V)ᵀ;\n"
    "other tensors and `average`: the mean of the α_t τ_t; no curvature",
    {"base_model": "required", "average": "optional"},
    tsv_merge,
    docs="TSV-M (Gargiulo et al., CVPR 2025), a data-free merge of each weight matrix's "
    "α-weighted task vectors in its singular basis, no curvature "
    "([below](#data-free-merges-in-the-singular-basis-tsv_merge-iso_c-iso_cts)).",
    coverage="none",
)
