"""Each configured method as a call of the pure merge core on one unit's parameter dicts.

No formula lives here: every rule calls one function of :mod:`gradmerge.merge` with the unit's
tensors and the unit's restriction of each curvature, so a streamed merge computes, unit by
unit, exactly what the in-memory call computes on whole state dicts (the curvature structures
never couple two units). A merge rule takes a :class:`MergeUnit`, a removal rule a
:class:`RemoveUnit`; which method calls which rule is recorded in :mod:`gradmerge.jobs.methods`.
Each unit carries the job's solver settings (``solver``, a :class:`gradmerge.KroneckerCG` from
its ``solver:`` block), passed to the solve; each rule returns the unit's tensors with the
report of its solve (``None`` where nothing is solved).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge import merge, spectral
from gradmerge.curvature import KFAC, Blocks, Curvature, Diagonal, ScaledIdentity
from gradmerge.elementwise.matching import Kernel
from gradmerge.errors import ArgumentError, StructureError
from gradmerge.params import Params
from gradmerge.solvers.kronecker import eye_like
from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import KroneckerCG

Precision = Curvature | float

Solved = tuple[dict[str, Tensor], Solution | None]
"""A rule's result: the unit's tensors, and the report of its solve (``None``: none ran)."""


def precision(delta: float, scale: float, curvature: Curvature | None) -> Precision:
    """δ·I + scale·C (a prior H_0 or a remaining curvature H̄_\\t); δ alone without a curvature.

    A diagonal C gives :meth:`Diagonal.shifted` (the same values, formed only where used: the
    diagonal merge forms them inside its loop)."""
    if curvature is None:
        return delta
    if isinstance(curvature, Diagonal):
        return curvature.shifted(scale, delta)
    return curvature.scaled(scale) + delta


@dataclass(frozen=True)
class MergeUnit:
    """One unit of a merge, as the engine reads it: θ_LLM, the θ_t and their H_t on the unit's
    tensors, the α_t, the prior H_0, the merge's ``damping``, ``kernel``, the fast elementwise
    evaluator the engine chose (:func:`gradmerge.kernels.select`) for the diagonal merges,
    RegMean's ``off_diagonal`` factor and ``embeddings`` choice (``average``, or ``gram``: solve
    the embeddings from their Grams too), the models' ``scale`` (``curvature_scales``, the
    factor on each H_t; RegMean: on each Gram), the job's ``solver`` settings, and for the
    spectral merges Iso-CTS's ``common_space_fraction`` and the names of the matrices to
    ``average``."""

    base: Params
    finetuned: Sequence[Params]
    curvatures: Sequence[Curvature | None]
    alphas: Sequence[float]
    prior: Precision | None = None
    damping: float = 0.0
    kernel: Kernel | None = None
    off_diagonal: float = merge.REGMEAN_OFF_DIAGONAL
    curvature_scales: Sequence[float] | None = None
    solver: KroneckerCG | None = None
    embeddings: str = "average"
    common_space_fraction: float = spectral.ISO_CTS_COMMON_SPACE_FRACTION
    average: frozenset[str] = frozenset()

    def averaged(self) -> list[str]:
        """The unit's tensors among those to ``average`` (the job's names: every unit's)."""
        return [k for k in self.base if k in self.average]

    def scales(self) -> list[float]:
        """Each model's ``scale``, the factor on its H_t (1 when none is given)."""
        return list(self.curvature_scales or [1.0] * len(self.curvatures))

    def hs(self) -> list[Curvature]:
        """The H_t, every one required, each times its model's ``scale``."""
        return [
            h if s == 1.0 else h.scaled(s)
            for h, s in zip(
                (_required(c, t) for t, c in enumerate(self.curvatures)), self.scales(), strict=True
            )
        ]


@dataclass(frozen=True)
class RemoveUnit:
    """One unit of a removal: θ_LLM, H̄_\\t (``remaining``), α and, as the method needs them, θ_t,
    H_t, the prior H_0 and the gradient ∇ℓ̄_t(θ_LLM)."""

    base: Params
    remaining: Precision
    alpha: float
    finetuned: Params | None = None
    curvature: Curvature | None = None
    prior: Precision | None = None
    gradient: Params | None = None
    solver: KroneckerCG | None = None


def task_arithmetic(u: MergeUnit) -> Solved:
    """:func:`gm.task_arithmetic` on the unit (curvatures, prior and damping unused)."""
    return merge.task_arithmetic(u.base, u.finetuned, alphas=list(u.alphas), kernel=u.kernel), None


def fisher_average(u: MergeUnit) -> Solved:
    """:func:`gm.fisher_average` on the unit with H_t + damping·I (base and prior unused)."""
    damped = [h + u.damping if u.damping else h for h in u.hs()]
    return merge.fisher_average(u.finetuned, damped, alphas=list(u.alphas), kernel=u.kernel), None


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


def tsv_merge(u: MergeUnit) -> Solved:
    """:func:`gm.tsv_merge` (TSV-M) on the unit (curvatures, prior and damping unused)."""
    return spectral.tsv_merge(
        u.base, u.finetuned, alphas=list(u.alphas), average=u.averaged()
    ), None


def iso_c(u: MergeUnit) -> Solved:
    """:func:`gm.iso_c` on the unit (curvatures, prior and damping unused)."""
    return spectral.iso_c(u.base, u.finetuned, alphas=list(u.alphas), average=u.averaged()), None


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


def remove(u: RemoveUnit) -> Solved:
    """:func:`gm.remove` (Eq. 13) on the unit (gradient unused)."""
    if u.finetuned is None or u.prior is None:
        raise ArgumentError("removal by Eq. 13 needs the fine-tuned model θ_t and the prior H_0")
    h_t = _required(u.curvature, 0)
    removed = merge.with_solution(
        merge.remove,
        u.base,
        u.finetuned,
        h_t,
        remaining=u.remaining,
        prior=u.prior,
        alpha=u.alpha,
        solver=u.solver,
    )
    return removed.params, removed.solution


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


MergeRule = Callable[[MergeUnit], Solved]
"""The signature of the merge rules above."""

RemoveRule = Callable[[RemoveUnit], Solved]
"""The signature of the removal rules above."""


def _required(curvature: Curvature | None, t: int) -> Curvature:
    if curvature is None:  # the plan checks coverage; this guards direct callers
        raise StructureError(f"no curvature for model {t} on these parameters")
    return curvature


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
