"""Iso-CTS (Marczak et al., ICML 2025): Iso-C's common subspace (the top
``common_space_fraction`` of each matrix's directions of Σ_t α_t τ_t) plus each task's own
directions outside it, whitened, at a flat spectrum.

Other tensors and the matrices named in ``average`` get the mean of the α_t τ_t; no curvature
(:func:`gm.iso_cts`, :mod:`gradmerge.merge.spectral`). The method's own YAML key,
``common_space_fraction``, is declared here (:data:`COMMON_SPACE_FRACTION`).

Example:
    >>> METHOD.coverage, sorted(METHOD.uses)
    ('none', ['average', 'base_model', 'common_space_fraction'])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradmerge.errors import ArgumentError, ConfigError
from gradmerge.foundation.settings import setting
from gradmerge.merge import spectral
from gradmerge.merge.spectral import ISO_CTS_COMMON_SPACE_FRACTION, iso_cts_split
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved

COMMON_SPACE_FRACTION = setting(
    ISO_CTS_COMMON_SPACE_FRACTION,
    "f, the share of each matrix's r directions kept from the sum of the task matrices "
    "(the common subspace). A fraction so small that some matrix's task-specific "
    "directions would outnumber its rank (seen only below 0.5: none for 0.5 ≤ f ≤ 1, "
    "r ≤ 2048, T ≤ 64) is refused before any tensor is read, naming the matrix.",
    minimum=0.0,
    maximum=1.0,
    what="the share of each matrix's directions Iso-CTS keeps from the sum of the task matrices",
    per_method=True,
    source="Marczak et al. (2025): their code's `config/method/iso_cts.yaml` and "
    "fusion-bench's; `gm.merge.ISO_CTS_COMMON_SPACE_FRACTION`",
)
"""The declaration of the YAML key ``common_space_fraction`` (a field of
:class:`gradmerge.jobs.config.MergeConfig`)."""


def iso_cts(u: MergeUnit) -> Solved:
    """:func:`gm.iso_cts` on the unit with its ``common_space_fraction``."""
    merged = spectral.iso_cts(
        u.base,
        u.finetuned,
        alphas=list(u.alphas),
        common_space_fraction=u.common_space_fraction,
        average=u.averaged(),
    )
    return merged, None


def check_split(config: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a ``common_space_fraction`` that some merged matrix cannot be split by
    (:func:`gradmerge.merge.spectral.iso_cts_split`: its task-specific directions would
    outnumber its rank r), naming it, before a tensor is read.

    Raises:
        ConfigError: the first matrix (of ``shapes``, the merged tensors not averaged) that
            ``config.common_space_fraction`` with ``len(config.models)`` tasks cannot split.
    """
    for k, shape in shapes.items():
        if len(shape) == 2:
            try:
                iso_cts_split(min(shape), len(config.models), config.common_space_fraction)
            except ArgumentError as err:
                raise ConfigError(f"{err} ({k!r}, {shape[0]}×{shape[1]})") from err


METHOD = MergeMethod(
    "iso_cts",
    "merge",
    "Iso-CTS (Marczak et al.): Iso-C's common subspace (`common_space_fraction`,\n"
    f"default {ISO_CTS_COMMON_SPACE_FRACTION:g}, of the directions) plus each task's own directions outside it,\n"
    "whitened, flat spectrum; other tensors and `average`: the mean",
    {"base_model": "required", "common_space_fraction": "optional", "average": "optional"},
    iso_cts,
    docs="Iso-CTS (same paper), Iso-C's common subspace plus each task's own directions "
    "outside it, no curvature "
    "([below](#data-free-merges-in-the-singular-basis-tsv_merge-iso_c-iso_cts)).",
    coverage="none",
    precheck=check_split,
)
