"""Merge and removal rules, each written once against the :class:`Curvature` interface.

Notation (Daheim et al., ICLR 2024, appendix) → arguments:

==============================  ==================  =============================================
paper                           code                meaning
==============================  ==================  =============================================
θ_LLM                           ``base``            pretrained parameters
θ_t                             ``finetuned[t]``    parameters fine-tuned on task t
H_0                             ``prior``           prior precision around ``base`` (float δ: δ·I)
H_t                             ``curvatures[t]``   task t's curvature, a SUM over its examples
α_t                             ``alphas[t]``       task weights
H̄ = H_0 + Σ_t α_t H_t                               merged precision
H̄_\\t = δI + ∇²ℓ̄_\\t(θ_LLM)      ``remaining``       curvature of the data that stays (removal)
∇ℓ̄_t(θ_LLM)                     ``gradient``        gradient of the data to remove, at the base
==============================  ==================  =============================================

Task arithmetic (H_t = 0) and Fisher averaging (H_0 = 0) are the merge rule of Eq. 6 with those
inputs; they are implemented as exactly that, so every method shares one code path.

The functions are pure: parameter dicts and curvatures in, a new parameter dict out; no I/O, no
device moves. Inputs are validated (keys, shapes, dtypes, devices, finiteness, PSD curvatures);
errors are typed (:mod:`gradmerge.errors`).

The rules that solve a system (:func:`gradient_matching`, :func:`remove`,
:func:`influence_remove`) take the solver object explicitly (``solver=``, a
:class:`gradmerge.KroneckerCG` or :class:`gradmerge.CG`, passed to the call that solves) and, like
every rule, return the parameters; called through :func:`with_solution` they return a
:class:`Merged`, the parameters with the solve's report (method, iterations, certified residual per
block): the report travels with the result, not through any global state or a flag that changes the
return type.

One module per rule family:

- :mod:`~gradmerge.merge.matching`: Eq. 6 (:func:`gradient_matching`), :func:`task_arithmetic`,
  :func:`fisher_average`, and :class:`Merged`;
- :mod:`~gradmerge.merge.regression`: RegMean (:func:`regmean`, :func:`regmean_systems`);
- :mod:`~gradmerge.merge.spectral`: the data-free merges in each weight matrix's singular basis,
  TSV-M (:func:`tsv_merge`), Iso-C (:func:`iso_c`) and Iso-CTS (:func:`iso_cts`);
- :mod:`~gradmerge.merge.removal`: Eq. 13 (:func:`remove`) and :func:`influence_remove`;
- :mod:`~gradmerge.merge.report`: :func:`with_solution`;
- :mod:`~gradmerge.merge.refinement`: :func:`refine` (Sec. 1.5);
- :mod:`~gradmerge.merge.inputs`: the checks of the inputs every rule shares.

This package's names are those modules' public ones (``gm.*`` re-exports the rules).
"""

from gradmerge.merge.inputs import CurvatureLike
from gradmerge.merge.matching import Merged, fisher_average, gradient_matching, task_arithmetic
from gradmerge.merge.refinement import refine
from gradmerge.merge.regression import (
    REGMEAN_OFF_DIAGONAL,
    RegmeanSystem,
    raise_unresolved,
    regmean,
    regmean_systems,
)
from gradmerge.merge.removal import influence_remove, remove
from gradmerge.merge.report import with_solution
from gradmerge.merge.spectral import ISO_CTS_COMMON_SPACE_FRACTION, iso_c, iso_cts, tsv_merge

__all__ = [
    "ISO_CTS_COMMON_SPACE_FRACTION",
    "REGMEAN_OFF_DIAGONAL",
    "CurvatureLike",
    "Merged",
    "RegmeanSystem",
    "fisher_average",
    "gradient_matching",
    "influence_remove",
    "iso_c",
    "iso_cts",
    "raise_unresolved",
    "refine",
    "regmean",
    "regmean_systems",
    "remove",
    "task_arithmetic",
    "tsv_merge",
    "with_solution",
]
