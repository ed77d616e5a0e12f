r"""The merge and removal methods the demo compares, each one call into gradmerge.

Merging T fine-tunes θ_t of θ_LLM (paper notation → code: docs/architecture.md), with H_0 = δI the
prior every fine-tune was trained with and H_t the GGN of task t at θ_t (a SUM over D_t; for softmax
cross-entropy the GGN is the Fisher) in three structures:

=====================  =========================================================================
method                 rule
=====================  =========================================================================
``task_arithmetic``    θ_LLM + Σ_t α_t (θ_t − θ_LLM)  (Eq. 6 with H_t = 0)
``fisher_average``     (Σ_t α_t F_t)⁻¹ Σ_t α_t F_t θ_t, F_t = diagonal H_t + εI (Eq. 6, H_0 = 0)
``regmean``            per layer (Σ_t α_t V_t G_t)(Σ_t α_t G_t)⁻¹, V_t = [W_t | b_t],
                       G_t = X̃_tᵀX̃_t + εI (the layer's inputs under θ_t on D_t, with the bias
                       column; Jin et al., 2023)
``gm_diag``            Eq. 6, H_t diagonal
``gm_kfac``            Eq. 6, H_t K-FAC (type-2, one Kronecker term per layer)
``gm_full``            Eq. 6, H_t the full GGN (dense)
``gm_refine``          ``gm_full``, then k steps of ``gm.refine`` (Sec. 1.5) towards θ_{1:T}, each
                       with the gradients and the full GGN re-estimated at the iterate
=====================  =========================================================================

Removing task r from θ_all (the model trained on every task, the role of θ_LLM in Sec. 1.3):

- Eq. 13: θ_all − H̄_\r⁻¹ (H_0 + H_r)(θ'_r − θ_all), θ'_r fine-tuned on D_r from θ_all (Eq. 15)
  and H_r its curvature at θ'_r;
- Koh & Liang: θ_all + H̄_\r⁻¹ ∇ℓ̄_r(θ_all);

with H̄_\r = δI + (curvature of the remaining tasks' data at θ_all), in the same three structures.

Example:
    >>> import gradmerge as gm
    >>> from gradmerge.demo.data import make_splits
    >>> from gradmerge.demo.mlp import MLP
    >>> from gradmerge.demo.methods import estimate, gram_matrices, merge
    >>> splits = make_splits(("rotated", "mirrored"), n_base=40, n_train=30, n_test=20, seed=0)
    >>> mlp = MLP(hidden=4)
    >>> base = mlp.params(mlp.init(seed=0))
    >>> fts = [mlp.params(mlp.init(seed=1)), mlp.params(mlp.init(seed=2))]
    >>> curv = {s: [estimate(mlp, ft, t.train, s) for ft, t in zip(fts, splits.tasks)]
    ...         for s in ("diag", "kfac", "full")}
    >>> grams = [gram_matrices(ft, t.train) for ft, t in zip(fts, splits.tasks)]
    >>> merged = merge(base, fts, curv, grams, delta=1.0, alphas=0.5)
    >>> list(merged)
    ['task_arithmetic', 'fisher_average', 'regmean', 'gm_diag', 'gm_kfac', 'gm_full']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

import gradmerge as gm
from gradmerge import params as P
from gradmerge.demo.data import Split
from gradmerge.demo.mlp import MLP
from gradmerge.params import Params
from gradmerge.solvers.kronecker import eye_like

Structure = Literal["diag", "kfac", "full"]

STRUCTURES: tuple[Structure, ...] = ("diag", "kfac", "full")
"""Curvature structures, in the order of the table."""

MERGE_METHODS = (
    "task_arithmetic",
    "fisher_average",
    "regmean",
    "gm_diag",
    "gm_kfac",
    "gm_full",
)
"""Merge methods of :func:`merge`, in the order of the table."""

REFINED = "gm_refine"
"""The refined merge (:func:`refine`), listed after :data:`MERGE_METHODS` in the table."""

EPS = 1e-8
"""ε added to each diagonal Fisher in ``fisher_average`` and to each Gram matrix in ``regmean``
(εI). Without it both rules are 0/0 on the weights of pixels that are zero in every image of
every task (F = 0 and a zero row of X̃ᵀX̃); with it those weights get the α-weighted average of
the θ_t, and the other entries move by a relative O(ε/F)."""

BATCH = 128
"""Batch size for the curvature estimators (the result does not depend on it)."""


def estimate(mlp: MLP, params: Params, data: Split, structure: Structure) -> gm.Curvature:
    """The GGN (= Fisher) of Σ_{i ∈ data} ℓ_i at ``params``, a SUM over examples.

    ``structure`` is ``"diag"``, ``"kfac"`` or ``"full"``, estimated by ``gm.estimate_curvature``.
    """
    module = mlp.module(dtype=data.x.dtype, device=data.x.device)
    with torch.no_grad():
        for name, value in module.named_parameters():
            value.copy_(params[name])
    return gm.estimate_curvature(module, data.batches(BATCH), structure=structure, fisher="ggn")


def gram_matrices(params: Params, data: Split) -> dict[str, Tensor]:
    """RegMean's Gram matrices X̃ᵀX̃ of each linear layer's inputs (bias column last), under θ."""
    ones = torch.ones(len(data), 1, dtype=data.x.dtype, device=data.x.device)
    hidden = torch.tanh(torch.addmm(params["0.bias"], data.x, params["0.weight"].T))
    grams = {}
    for name, inputs in (("0", data.x), ("2", hidden)):
        augmented = torch.cat([inputs, ones], dim=1)
        grams[name] = augmented.T @ augmented
    return grams


def merge(
    base: Params,
    finetuned: Sequence[Params],
    curvatures: Mapping[Structure, Sequence[gm.Curvature]],
    grams: Sequence[Mapping[str, Tensor]],
    *,
    delta: float,
    alphas: float | Sequence[float],
) -> dict[str, dict[str, Tensor]]:
    """Every method of :data:`MERGE_METHODS` at ``alphas``, in that order.

    Args:
        base: θ_LLM.
        finetuned: θ_1, …, θ_T.
        curvatures: structure → H_1, …, H_T.
        grams: per task, RegMean's Gram matrices (:func:`gram_matrices`).
        delta: δ, H_0 = δI.
        alphas: α_t.
    """
    ridged = [{k: g + EPS * eye_like(g) for k, g in gram.items()} for gram in grams]
    out = {
        "task_arithmetic": gm.task_arithmetic(base, finetuned, alphas=alphas),
        "fisher_average": gm.fisher_average(
            finetuned, [c + EPS for c in curvatures["diag"]], alphas=alphas
        ),
        "regmean": gm.regmean(finetuned, ridged, alphas=alphas, bias=["0", "2"], off_diagonal=1.0),
    }
    for structure in STRUCTURES:
        out[f"gm_{structure}"] = gm.gradient_matching(
            base, finetuned, curvatures[structure], prior=delta, alphas=alphas
        )
    return out


def refine(
    mlp: MLP,
    start: Params,
    base: Params,
    data: Sequence[Split],
    gradients: Sequence[Callable[[Params], dict[str, Tensor]]],
    *,
    delta: float,
    alphas: float | Sequence[float],
    steps: int,
) -> list[dict[str, Tensor]]:
    """``steps`` iterates of ``gm.refine`` from ``start`` towards θ_{1:T}.

    θ^{k+1} = θ^k − (δI + Σ_t α_t G_t(θ^k))⁻¹ [δ(θ^k − θ_LLM) + Σ_t α_t ∇ℓ̄_t(θ^k)], G_t(θ^k) the
    full GGN of task t's data re-estimated at every iterate (a Gauss-Newton step on the
    multi-task objective; ``gm.refine`` backtracks on the norm of the bracket).

    Args:
        mlp: the architecture.
        start: θ^0 (the demo's ``gm_full`` merge).
        base: θ_LLM.
        data: each task's training split D_t.
        gradients: θ ↦ ∇ℓ̄_t(θ) on D_t.
        delta: δ, H_0 = δI.
        alphas: α_t.
        steps: k ≥ 1.
    """

    def curvature_at(split: Split) -> Callable[[Params], gm.Curvature]:
        return lambda theta: estimate(mlp, theta, split, "full")

    return gm.refine(
        start,
        base,
        gradients,
        [curvature_at(split) for split in data],
        prior=delta,
        alphas=alphas,
        steps=steps,
    )


def remove(
    everything: Params,
    refinetuned: Params,
    task_curvature: gm.Curvature,
    remaining_curvature: gm.Curvature,
    task_gradient: Params,
    *,
    delta: float,
) -> dict[str, dict[str, Tensor]]:
    """Eq. 13 and Koh & Liang's step for one structure.

    Args:
        everything: θ_all, trained on every task.
        refinetuned: θ'_r, fine-tuned on D_r from θ_all with prior δI (Eq. 15).
        task_curvature: H_r at θ'_r.
        remaining_curvature: curvature of the remaining tasks' data at θ_all (δI is added here).
        task_gradient: ∇ℓ̄_r(θ_all).
        delta: δ.
    """
    remaining = remaining_curvature + delta  # H̄_\r = δI + ∇²ℓ̄_\r(θ_all)
    return {
        "eq13": gm.remove(
            everything, refinetuned, task_curvature, remaining=remaining, prior=delta, alpha=1.0
        ),
        "koh_liang": gm.influence_remove(everything, task_gradient, remaining=remaining),
    }


def relative_distance(theta: Params, target: Params, origin: Params) -> float:
    """‖θ − θ⋆‖ / ‖θ⋆ − origin‖: 0 at the target, 1 as far as ``origin`` is."""
    return P.distance(theta, target) / P.distance(target, origin)
