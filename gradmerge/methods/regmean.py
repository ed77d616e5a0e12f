"""RegMean (Jin et al., ICLR 2023) as their code and FusionBench run it.

Each linear layer's weight W is solved from its inputs' Gram matrices
Gram_t = s_t·M_t·A_t (+ damping·I) = Σ x xᵀ, the input factor A_t of each model's K-FAC
curvature without its bias column (a mean over M_t rows), off-diagonal entries times
``off_diagonal`` r: W = (Σ α_t G̃_t)⁻¹ Σ α_t G̃_t W_t with G̃ = r·G + (1 − r)·diag(G)
(:func:`gm.regmean`). Biases, embeddings (unless ``embeddings: gram``) and every tensor without
K-FAC factors are α-averaged. This module holds the streamed rule, the Grams it forms (shared
with the dry run, :func:`regmean_grams`) and the method's own YAML keys, ``off_diagonal`` and
``embeddings`` (their declarations: :data:`OFF_DIAGONAL`, :data:`EMBEDDINGS`).

Example:
    >>> METHOD.coverage, sorted(METHOD.uses)
    ('kfac', ['base_model', 'curvature', 'damping', 'embeddings', 'off_diagonal'])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from gradmerge import merge
from gradmerge.curvature import KFAC, Blocks, Curvature, ScaledIdentity
from gradmerge.curvature.io import CurvatureFile
from gradmerge.errors import ArgumentError, StructureError
from gradmerge.foundation.settings import setting
from gradmerge.merge import REGMEAN_OFF_DIAGONAL
from gradmerge.methods.base import MergeMethod, MergeUnit, Solved, SystemReading
from gradmerge.solvers.kronecker import eye_like

OFF_DIAGONAL = setting(
    REGMEAN_OFF_DIAGONAL,
    "Jin et al.'s factor r on the Gram matrices' off-diagonal entries (their α), "
    "G̃ = r·G + (1 − r)·diag(G); 1 is the plain closed form. With r < 1 the Grams are "
    "non-singular wherever every input was seen, so a BERT or a GPT-2 merges without "
    "`damping`.",
    minimum=0.0,
    maximum=1.0,
    what="Jin et al.'s factor on the Grams' off-diagonal entries",
    per_method=True,
    source="Jin et al. (2023)'s reference implementation (`regmean_reduce_nondiag: 0.1` in "
    "its RoBERTa, DeBERTa and T5 configurations) and FusionBench "
    "(`reduce_non_diagonal_ratio: 0.1`); `gm.merge.REGMEAN_OFF_DIAGONAL`",
)
"""The declaration of the YAML key ``off_diagonal`` (a field of
:class:`gradmerge.jobs.config.MergeConfig`)."""

EMBEDDINGS = setting(
    "average",
    "`average` or `gram`: solve the embeddings in K-FAC curvatures (layers with one-hot "
    "inputs: diagonal A, weight stored (vocab, hidden)) from their Grams too, i.e. each row "
    "weighted by how often each task looked it up. A row no task looked up makes that Gram "
    "singular: `gram` then needs `damping` (the dry run names it).",
    kind="choice",
    choices=("average", "gram"),
    what="whether RegMean averages the embeddings or solves them",
    per_method=True,
    source="Jin et al.'s code and FusionBench (both average the embeddings)",
)
"""The declaration of the YAML key ``embeddings`` (a field of
:class:`gradmerge.jobs.config.MergeConfig`)."""


def regmean(u: MergeUnit) -> Solved:
    """:func:`gm.regmean` as Jin et al.'s code runs it: each linear layer's weight W from
    Gram_t = s_t·M_t·A_t (+ damping·I) = Σ x xᵀ, the input factor A_t of each model's K-FAC
    curvature without its bias column (a mean over M_t rows: kept positions, or examples, the
    curvature's ``KFAC.counts``; s_t the model's ``scale``), off-diagonal entries times
    ``off_diagonal`` (their α); every other tensor of the unit — the layer's bias, an
    embedding (unless ``embeddings: gram``), a tensor without K-FAC factors — is α-averaged
    through :func:`gm.fisher_average` with identity curvatures (base and prior unused)."""
    found = regmean_grams(
        u.curvatures,
        u.damping,
        keys=sorted(u.finetuned[0]),
        scales=u.scales(),
        embeddings=u.embeddings == "gram",
    )
    if found is None:
        ones = [ScaledIdentity(1.0)] * len(u.finetuned)  # RegMean averages non-linear parameters
        merged = merge.fisher_average(u.finetuned, ones, alphas=list(u.alphas), kernel=u.kernel)
        return merged, None
    grams, transposed = found
    merged = merge.regmean(
        u.finetuned,
        grams,
        alphas=list(u.alphas),
        transposed=transposed,
        off_diagonal=u.off_diagonal,
    )
    return merged, None


def regmean_grams(
    curvatures: Sequence[Curvature | None],
    damping: float,
    *,
    keys: Sequence[str] = (),
    scales: Sequence[float] | None = None,
    embeddings: bool = False,
) -> tuple[list[dict[str, Tensor]], list[str]] | None:
    """RegMean's Gram matrices of one unit, per model: s_t·M_t·A_t (+ damping·I) from each
    curvature's K-FAC input factor without its bias row and column (in the factor's own dtype),
    and the layers among them stored transposed; None when the unit solves nothing (no K-FAC
    factors here, or only an embedding and ``embeddings`` is False: the unit is α-averaged).
    An embedding is a layer whose inputs are one-hot (:func:`is_embedding`). Shared by the
    merge and its ``--dry-run`` check. ``keys`` name the unit in errors."""
    layers = [_kfac_of(c) for c in curvatures]
    if all(k is None for k in layers):
        return None
    first = next(k for k in layers if k is not None)  # decides which layers are embeddings
    skipped = set() if embeddings else {n for n in first.terms if is_embedding(first, n)}
    grams: list[dict[str, Tensor]] = []
    transposed: set[str] = set()
    factors = list(scales or [1.0] * len(curvatures))
    for t, (k, c) in enumerate(zip(layers, curvatures, strict=True)):
        if k is None or c is None:
            raise StructureError(
                f"model {t} has no K-FAC factors for {list(keys)[:2]}, the others have"
            )
        if k.weight_shapes:
            raise ArgumentError(
                f"regmean merges linear layers; {sorted(k.weight_shapes)} have weights of another "
                "shape (convolutions): use fisher_average or gradient_matching for them"
            )
        gram = {}
        for name, terms in k.terms.items():
            if len(terms) != 1:
                raise ArgumentError(
                    f"regmean needs one Kronecker term per layer; {name!r} has {len(terms)}"
                )
            if name in skipped:
                continue
            a = terms[0][0][:-1, :-1] if name in k.bias else terms[0][0]  # the weight's inputs
            a = _rows(k, name, t, len(curvatures)) * factors[t] * a  # s·M·A = s·Σ x xᵀ
            damped = a + damping * eye_like(a) if damping else a
            # in the precision the factor was estimated in: regmean judges its round-off by it
            gram[name] = damped.to(k.coarsest_dtype or damped.dtype)
            if name in k.transposed:
                transposed.add(name)
        grams.append(gram)
    if not grams[0]:
        return None
    return grams, sorted(transposed)


def is_embedding(kfac: KFAC, name: str) -> bool:
    """Whether K-FAC layer ``name`` is an embedding lookup: inputs one-hot, so its input factor A
    (token counts / M) is diagonal, its weight stored (in, out) and without bias — as
    ``nn.Embedding``'s factors are estimated (a linear layer's A has off-diagonal entries)."""
    if name not in kfac.transposed or name in kfac.bias:
        return False
    a = kfac.terms[name][0][0]
    return bool(torch.count_nonzero(a - torch.diag_embed(a.diagonal())) == 0)


def _rows(kfac: KFAC, name: str, t: int, tasks: int) -> float:
    """M, the number of rows (kept positions, or examples) layer ``name``'s A is a mean over.

    Curvature files from before the counts were saved have none. Then only a one-model merge
    is provably unaffected (RegMean's result does not change when every Gram of a layer is
    scaled alike); any other is refused: N·A (examples × mean) is the Gram only when every
    example has exactly one kept position, which the file cannot show.
    """
    if name in kfac.counts:
        return float(kfac.counts[name])
    if tasks == 1:
        return 1.0
    raise ArgumentError(
        f"regmean needs the number of rows M (kept positions, or examples) that the K-FAC input "
        f"factor A of {name!r} is a mean over, to form the Gram M·A; models[{t}].curvature does "
        "not record it (written before gradmerge saved K-FAC counts). Estimate it again with "
        "`gradmerge curvature` (or gm.estimate_curvature(...).save(path))"
    )


def _kfac_of(curvature: Curvature | None) -> KFAC | None:
    if isinstance(curvature, KFAC):
        return curvature
    if isinstance(curvature, Blocks):
        found = [b for b in curvature.blocks if isinstance(b, KFAC)]
        return found[0] if found else None
    return None


def dry_run(
    config: Any, files: Mapping[str, CurvatureFile], units: Sequence[tuple[str, ...]]
) -> list[SystemReading]:
    """RegMean's systems for ``--dry-run``, judged by :func:`gradmerge.merge.regmean_systems`
    on the Grams the merge forms (:func:`regmean_grams`, in the compute dtype
    ``config.math_dtype``): λ_min of Σ_t α_t G̃_t against the rounding threshold of the Grams'
    dtype, the very check :func:`gm.regmean` runs, so the verdicts agree. A unit without K-FAC
    factors is α-averaged and solves nothing (no reading)."""
    out = []
    for keys in units:
        hs = [
            f.restrict(keys, dtype=config.math_dtype)
            if (f := files.get(f"models[{t}].curvature")) is not None
            else None
            for t in range(len(config.models))
        ]
        found = regmean_grams(
            hs,
            config.damping,
            keys=keys,
            scales=config.curvature_scales,
            embeddings=config.embeddings == "gram",
        )
        if found is None:
            continue
        systems = merge.regmean_systems(found[0], config.alphas, off_diagonal=config.off_diagonal)
        worst = min(systems, key=lambda s: s.min_eigenvalue - s.threshold)
        needed = max(s.damping for s in systems)
        out.append(SystemReading(keys, worst.min_eigenvalue, worst.threshold, needed))
    return out


METHOD = MergeMethod(
    "regmean",
    "merge",
    "RegMean (Jin et al.): each linear layer's weight from Gram_t = M_t·A_t = Σ x xᵀ\n"
    "(A_t: each curvature's K-FAC input factor, a mean over M_t rows), off-diagonal\n"
    f"entries times `off_diagonal: r` (Jin et al.'s α, in [0, 1], default "
    f"{REGMEAN_OFF_DIAGONAL:g}; 1: the\n"
    "plain closed form); biases, embeddings (`embeddings: gram` solves them too) and\n"
    "other tensors are averaged; optional `damping`",
    {
        "base_model": "optional",
        "curvature": "required",
        "damping": "optional",
        "off_diagonal": "optional",
        "embeddings": "optional",
    },
    regmean,
    docs="RegMean (Jin et al.) as their code and FusionBench run it: each linear layer's weight "
    "(`nn.Linear`, GPT-2's `Conv1D`) solved from its inputs' Gram matrices G_t = M_t·A_t (each "
    "curvature's K-FAC input factor times its count M_t, the bias column left out), "
    "W = (Σ α_t G̃_t)⁻¹ Σ α_t G̃_t W_t; the biases, embeddings, LayerNorms and every tensor "
    "without a K-FAC factor α-averaged.",
    coverage="kfac",
    damping_at=("damping",),
    systems=dry_run,
    hint="set `damping:` ({example}) so that the summed Gram matrices are invertible",
)
