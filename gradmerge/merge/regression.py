"""RegMean (Jin et al., 2023): each linear layer merged by least squares on the tasks' inputs.

:func:`regmean` is the K-FAC special case of Eq. 6 with G = I and H_0 = 0, one layer's system
Σ_t α_t G̃_t at a time in float64 (:func:`~gradmerge.merge.matching.fisher_average` with
curvatures G_t ⊗ I); :func:`regmean_systems` judges every layer's system against the rounding of
the Grams as given, without merging (``gradmerge merge --dry-run``), and :func:`raise_unresolved`
names every layer it cannot solve with the damping that would lift them.

Example:
    >>> import torch
    >>> from gradmerge.merge.regression import regmean
    >>> fts = [{"fc.weight": torch.tensor([[1.0, 0.0]])}, {"fc.weight": torch.tensor([[0.0, 1.0]])}]
    >>> regmean(fts, [{"fc": torch.eye(2)}, {"fc": torch.eye(2)}])["fc.weight"]
    tensor([[0.5000, 0.5000]])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradmerge import params as P
from gradmerge.curvature import KFAC, ScaledIdentity
from gradmerge.curvature.base import coarsest_dtype
from gradmerge.errors import ArgumentError, NotPositiveDefiniteError, StructureError
from gradmerge.merge.inputs import checked_alphas
from gradmerge.merge.matching import fisher_average
from gradmerge.params import Params

REGMEAN_OFF_DIAGONAL = 0.1
"""Jin et al.'s off-diagonal factor r (their α; ``reduce_non_diag`` in their code), the one default
of :func:`regmean`, :func:`regmean_systems` and the YAML key ``off_diagonal``: the value of the
reference implementation's RegMean experiments (``regmean_reduce_nondiag: 0.1`` in its RoBERTa,
DeBERTa and T5 configurations; 0.9 in one DeBERTa NER configuration) and of FusionBench's RegMean
(``reduce_non_diagonal_ratio: 0.1``, version 0.2.33). r = 1 is the plain closed form."""


def regmean(
    finetuned: Sequence[Params],
    grams: Sequence[Mapping[str, Tensor]],
    *,
    alphas: float | Sequence[float] = 1.0,
    bias: Sequence[str] = (),
    transposed: Sequence[str] = (),
    off_diagonal: float = REGMEAN_OFF_DIAGONAL,
) -> dict[str, Tensor]:
    r"""RegMean (Jin et al., 2023): the K-FAC special case of the merge rule with G = I, H_0 = 0.

    For every linear layer m with input Gram matrices G_t = X_tᵀX_t (one per task; with the bias
    as the last input column for the layers in ``bias``)

    .. math::

        [W \mid b]^\star = \Big(\sum_t \alpha_t [W_t \mid b_t]\, G_t\Big)
            \Big(\sum_t \alpha_t G_t\Big)^{-1},

    and every other parameter is the α-weighted average Σ_t α_t θ_t / Σ_t α_t. Jin et al. scale
    the off-diagonal entries of every Gram by a factor r ∈ [0, 1] (their α; ``off_diagonal``;
    the reference code's ``reduce_non_diag``), i.e. each G_t is replaced by

    .. math::

        \tilde G_t = r\, G_t + (1 - r)\, \mathrm{diag}(G_t),

    which leaves the diagonal and shrinks the merge towards the per-input-weighted average:
    r = 1 is the plain closed form, r = 0 uses diag(G_t) only; the default is
    :data:`REGMEAN_OFF_DIAGONAL` (0.1, as the reference implementation's experiments). For r < 1,
    Σ_t α_t G̃_t ⪰ (1 − r) Σ_t α_t diag(G_t) is positive definite whenever every input has a
    nonzero mean square in some task (α_t > 0), so no damping is needed. Jin et al.'s code and
    FusionBench solve for the weights only and average the biases (and every parameter of a
    module that is not linear: embeddings, LayerNorms): leave ``bias`` empty for that; a module
    in ``bias`` solves [W | b] jointly, its Gram including the constant input column.
    Implemented as :func:`fisher_average` (Eq. 6 with H_0 = 0) with curvatures
    ``KFAC({m: (G_t, I)})`` per layer, so the sum Σ_t α_t G_t ⊗ I is formed exactly and solved
    in one eigendecomposition, and with H_t = I on the other parameters.

    Precision. Each layer's system is formed and solved in float64 whatever the dtype of the
    inputs (Grams are in × in: small), one layer at a time, and the result is returned in the
    dtype of ``finetuned``. What the Grams can resolve is judged at the precision they were
    GIVEN in: rounding each entry to a dtype of machine epsilon ε moves G_t by E_t with
    ‖E_t‖₂ ≤ ‖E_t‖_F ≤ (ε/2)‖G_t‖_F, so by Weyl's inequality every eigenvalue of
    S = Σ_t α_t G_t is known only up to τ = (ε/2) Σ_t |α_t| ‖G_t‖_F. If λ_min(S) > τ the system
    the Grams were rounded from is certainly positive definite and the solve goes ahead
    (relative error about κ(S)·ε in the result); otherwise :class:`NotPositiveDefiniteError`
    names EVERY layer where it fails, each with λ_min and τ, and suggests the damping δ (added
    to every G_t) that lifts the worst of them: S + δ·Σα_t·I must clear τ + (ε/2)·Σ|α_t|·δ·√n
    (the damped Grams' own rounding), so δ = 2·(τ − λ_min)/(Σα_t − (ε/2)·Σ|α_t|·√n), above
    every threshold printed (:func:`regmean_systems` gives these numbers without merging).

    Args:
        finetuned: θ_1, …, θ_T.
        grams: per task, module name → Gram matrix of that layer's inputs (the same modules for
            every task).
        alphas: α_t.
        bias: modules whose weight has a bias (their Grams include the constant input column).
        transposed: modules whose weight is stored (in, out) (GPT-2 ``Conv1D``).
        off_diagonal: r, the factor on the Grams' off-diagonal entries (default
            :data:`REGMEAN_OFF_DIAGONAL`, as ``gradmerge merge``; 1: the plain closed form).

    Raises:
        NotPositiveDefiniteError: Σ_t α_t G̃_t of some layers is singular at the Grams'
            precision (all of them named).
        StructureError: Grams for modules the models lack, or for different modules per task.
        ArgumentError: a wrong number of Gram sets or alphas.

    Example:
        >>> import torch, gradmerge as gm
        >>> fts = [{"fc.weight": torch.tensor([[1.0, 0.0]])}, {"fc.weight": torch.tensor([[0.0, 1.0]])}]
        >>> grams = [{"fc": torch.diag(torch.tensor([3.0, 1.0]))}, {"fc": torch.diag(torch.tensor([1.0, 3.0]))}]
        >>> gm.regmean(fts, grams)["fc.weight"]  # diagonal Grams: r does not matter
        tensor([[0.7500, 0.7500]])
    """
    if len(grams) != len(finetuned):
        raise ArgumentError(f"got {len(finetuned)} fine-tuned models but {len(grams)} Gram sets")
    if not finetuned:
        raise ArgumentError("regmean needs at least one fine-tuned model, got none")
    weights = checked_alphas(alphas, len(finetuned))
    for t, ft in enumerate(finetuned):
        P.check_params(ft, name=f"finetuned[{t}]")
        P.check_compatible(finetuned[0], ft, ref_name="finetuned[0]", name=f"finetuned[{t}]")
    layers = _regmean_layers(finetuned, grams)
    raise_unresolved(regmean_systems(grams, weights, off_diagonal=off_diagonal))
    merged: dict[str, Tensor] = {}
    for name in layers:  # one layer at a time: float64 copies of one layer's weights only
        layer = [_off_diagonal_scaled(g[name], off_diagonal) for g in grams]
        curvatures = [
            _regmean_curvature(name, g, ft, bias=bias, transposed=transposed)
            for g, ft in zip(layer, finetuned, strict=True)
        ]
        keys = [k for k, _ in curvatures[0].layout]
        missing = [k for k in keys if k not in finetuned[0]]
        if missing:
            raise StructureError(
                f"grams name {name!r} with a bias, but the models have no {missing[0]!r}: "
                f"leave {name!r} out of `bias`, or pass models with that parameter"
            )
        wide = [{k: ft[k].to(torch.float64) for k in keys} for ft in finetuned]
        solved = fisher_average(wide, curvatures, alphas=weights)
        merged.update({k: solved[k].to(finetuned[0][k].dtype) for k in keys})
    rest = [{k: v for k, v in ft.items() if k not in merged} for ft in finetuned]
    if rest[0]:  # H_t = I: the α-weighted average
        merged.update(fisher_average(rest, [ScaledIdentity(1.0)] * len(rest), alphas=weights))
    return {k: merged[k] for k in finetuned[0]}


def _regmean_layers(
    finetuned: Sequence[Params], grams: Sequence[Mapping[str, Tensor]]
) -> list[str]:
    """The modules RegMean solves for: those of ``grams[0]``, which every task must share."""
    layers = list(grams[0])
    for t, gram in enumerate(grams):
        for name, g in gram.items():
            if f"{name}.weight" not in finetuned[t]:
                raise StructureError(
                    f"grams[{t}] names {name!r}, but finetuned[{t}] has no {name}.weight"
                )
            if not isinstance(g, Tensor) or g.ndim != 2 or g.shape[0] != g.shape[1]:
                got = tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__
                raise StructureError(
                    f"grams[{t}][{name!r}] must be a square Gram matrix (inputs × inputs), "
                    f"got {got}"
                )
        if set(gram) != set(layers):
            raise StructureError(
                f"grams[{t}] covers modules {sorted(gram)} but grams[0] covers {sorted(layers)}: "
                "pass a Gram for the same modules for every task"
            )
    return layers


def _regmean_curvature(
    name: str, gram: Tensor, ft: Params, *, bias: Sequence[str], transposed: Sequence[str]
) -> KFAC:
    """G_t ⊗ I for layer ``name`` in float64, built in the Gram's own dtype first so that the
    curvature remembers it (:attr:`Curvature.coarsest_dtype`: a float32 Gram's round-off
    eigenvalues are then judged at float32's precision by the PSD check)."""
    weight = ft[f"{name}.weight"]
    out = weight.shape[1] if name in transposed else weight.shape[0]
    eye = torch.eye(out, dtype=gram.dtype, device=gram.device)
    kfac = KFAC(
        {name: (gram, eye)},
        bias=[name] if name in bias else [],
        transposed=[name] if name in transposed else [],
    )
    return kfac.to(dtype=torch.float64)


@dataclass(frozen=True)
class RegmeanSystem:
    """One layer's RegMean system S = Σ_t α_t G̃_t, judged as :func:`regmean` judges it.

    Attributes:
        name: the module.
        min_eigenvalue: λ_min(S), computed in float64.
        threshold: τ = (ε/2)·Σ_t |α_t|·‖G_t‖_F, the uncertainty of S's eigenvalues from the
            rounding of Grams given in a dtype of machine epsilon ε (``dtype``).
        damping: 0 when λ_min > τ; else the δ (added to every G_t) that lifts λ_min clear of
            the damped threshold with a factor 2 to spare, or ``inf`` when Σ α_t ≤ 0.
        dtype: the coarsest dtype the Grams were given in.
    """

    name: str
    min_eigenvalue: float
    threshold: float
    damping: float
    dtype: torch.dtype

    @property
    def ok(self) -> bool:
        """Whether :func:`regmean` solves this layer."""
        return self.damping == 0.0

    def describe(self) -> str:
        """One line: the layer, λ_min, τ and the damping it needs."""
        need = "" if self.ok else f"; needs damping ≥ {self.damping:.2e}"
        return (
            f"{self.name!r}: λ_min = {self.min_eigenvalue:.3e}, threshold {self.threshold:.3e}"
            f"{need}"
        )


def regmean_systems(
    grams: Sequence[Mapping[str, Tensor]],
    alphas: Sequence[float],
    *,
    off_diagonal: float = REGMEAN_OFF_DIAGONAL,
) -> list[RegmeanSystem]:
    r"""Every layer's RegMean system, judged without merging (the check :func:`regmean` runs).

    Refuses S = Σ_t α_t G̃_t unless λ_min(S) > τ = (ε/2) Σ_t |α_t| ‖G_t‖_F (see
    :func:`regmean`): ε is the machine epsilon of the coarsest dtype the Grams were given in;
    G̃_t's rounding error r·E + (1 − r)·diag(E) has ‖·‖_F ≤ ‖E‖_F, so τ bounds it too. S and its
    spectrum are computed in float64, where their own round-off (≈ n ε₆₄ ‖S‖) is far below τ
    for Grams given in float32 or coarser.

    Example:
        >>> import torch
        >>> g = {"fc": torch.tensor([[1.0, 1.0], [1.0, 1.0]])}  # rank 1: singular
        >>> [s.ok for s in regmean_systems([g], [1.0], off_diagonal=1.0)], [s.ok for s in regmean_systems([g], [1.0])]
        ([False], [True])
    """
    if not 0.0 <= off_diagonal <= 1.0 or isinstance(off_diagonal, bool):
        raise ArgumentError(
            f"off_diagonal (Jin et al.'s factor on the Grams' off-diagonal entries) must be in "
            f"[0, 1], got {off_diagonal!r}"
        )
    out = []
    for name in grams[0]:
        layer = [g[name] for g in grams]
        given = coarsest_dtype(*(g.dtype for g in layer))
        eps = torch.finfo(given if given is not None else torch.float64).eps
        wide = [g.to(torch.float64) for g in layer]
        scaled = [_off_diagonal_scaled(g, off_diagonal) for g in wide]
        total = sum((a * g for a, g in zip(alphas, scaled, strict=True)), torch.zeros_like(wide[0]))
        lam = float(torch.linalg.eigvalsh((total + total.T) / 2)[0])
        frobenius = [float(torch.linalg.matrix_norm(g)) for g in wide]
        tau = eps / 2 * sum(abs(a) * f for a, f in zip(alphas, frobenius, strict=True))
        damping = 0.0
        if not lam > tau:
            lift = sum(alphas) - eps / 2 * sum(abs(a) for a in alphas) * math.sqrt(total.shape[0])
            damping = 2 * (tau - lam) / lift if lift > 0 else math.inf
            damping = max(damping, math.ulp(tau) if tau > 0 else torch.finfo(torch.float64).tiny)
        out.append(RegmeanSystem(name, lam, tau, damping, given or torch.float64))
    return out


def raise_unresolved(systems: Sequence[RegmeanSystem]) -> None:
    """Raise one :class:`NotPositiveDefiniteError` naming every layer of ``systems`` that
    :func:`regmean` cannot solve, with the damping that lifts them all (its
    ``suggested_delta``); nothing when all are fine."""
    bad = [s for s in systems if not s.ok]
    if not bad:
        return
    needed = max(s.damping for s in bad)
    given = str(bad[0].dtype).removeprefix("torch.")
    fix = (
        f"damp the Grams, G_t + δ·I with δ ≥ {needed:.2e} (above every threshold listed), or "
        "scale their off-diagonal entries (off_diagonal < 1, Jin et al.)"
        if math.isfinite(needed)
        else "the α_t sum to ≤ 0, so no damping lifts them: use positive alphas"
    )
    err = NotPositiveDefiniteError(
        f"RegMean system Σ_t α_t G_t is singular in {len(bad)} of {len(systems)} layers ("
        + "; ".join(s.describe() for s in bad)
        + f") at the precision of the Grams, given in {given}: λ_min is not above the "
        f"threshold, the uncertainty of the eigenvalues. Fix: {fix}."
    )
    err.suggested_delta = needed if math.isfinite(needed) else None
    raise err


def _off_diagonal_scaled(gram: Tensor, r: float) -> Tensor:
    """r·G + (1 − r)·diag(G): Jin et al.'s reduced off-diagonal Gram (G itself for r = 1)."""
    if r == 1.0:
        return gram
    scaled = r * gram  # one rounding of each off-diagonal entry; the diagonal is copied exactly
    scaled.diagonal().copy_(gram.diagonal())
    return scaled
