"""The merge and removal methods of the YAML jobs, one module each.

Each module holds one method: its streamed rule (a call of the in-memory rule of
:mod:`gradmerge.merge` on one unit), the declarations of the YAML keys only it reads, and its
record ``METHOD`` (:class:`~gradmerge.methods.base.MergeMethod`: keys, coverage, rule, dry-run
system, hint, help and docs lines). :mod:`~gradmerge.methods.registry` lists them;
:mod:`~gradmerge.methods.base` holds what they share (the record, a unit's inputs, the helpers
several rules use).

========================  =============================================================
module                    method
========================  =============================================================
``task_arithmetic``       θ_LLM + Σ_t α_t (θ_t − θ_LLM)
``fisher_average``        (Σ_t α_t H_t)⁻¹ Σ_t α_t H_t θ_t
``gradient_matching``     Eq. 6
``regmean``               RegMean (Jin et al.), from K-FAC input factors
``tsv_merge``             TSV-M (Gargiulo et al.)
``iso_c``, ``iso_cts``    Iso-C, Iso-CTS (Marczak et al.)
``remove``                Eq. 13
``influence_remove``      Koh & Liang's influence step
``remerge``               a merge run again without some of its models
========================  =============================================================

The package imports nothing on import: ``from gradmerge.methods import registry``.
"""
