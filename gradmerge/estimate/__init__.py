"""Curvature of a model on data: ``estimate_curvature`` and the estimators behind it.

Every estimate is a SUM over examples (an example is one row of a batch; see
:mod:`gradmerge.estimate._data`); divide by ``int(C.meta["num_examples"])`` for the mean.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, cast

from torch import Tensor, nn

from gradmerge import _weight_sample
from gradmerge.curvature import KFAC, Blocks, Curvature
from gradmerge.errors import ArgumentError
from gradmerge.estimate._data import FisherName, check_fisher, num_examples, split_batch
from gradmerge.estimate.dense import estimate_dense
from gradmerge.estimate.diagonal import estimate_diagonal
from gradmerge.estimate.gradient import gradient_fn
from gradmerge.estimate.kfac import (
    MAX_FACTOR_SIDE,
    KFACFactors,
    check_max_factor_side,
    estimate_kfac_factors,
)
from gradmerge.estimate.matrix_free import MatrixFree

MAX_DIAGONAL_FACTOR = 4096
"""Embeddings whose diagonal A factor is larger than this (or than the factor-side limit) get a
diagonal block instead of K-FAC (``gm.KFAC`` stores A as a dense vocab × vocab matrix; see
``kfac_curvature``)."""


STRUCTURES = ("diag", "kfac", "full")
"""The structures :func:`estimate_curvature` estimates."""


def check_structure(structure: object, fisher: object) -> None:
    """The checks of ``structure`` and its pairing with ``fisher`` shared by every estimator
    front end (:func:`estimate_curvature`, ``gm.distributed.estimate_curvature``).

    Raises:
        ArgumentError: an unknown structure, or ``fisher="hessian"`` with another structure
            than ``"full"``.
    """
    if structure not in STRUCTURES:
        raise ArgumentError(f"structure must be 'diag', 'kfac' or 'full', got {structure!r}")
    if fisher == "hessian" and structure != "full":
        raise ArgumentError(
            "fisher='hessian' is available for structure='full' (and gm.MatrixFree) only: "
            "diagonal and K-FAC estimates are of a Fisher or GGN"
        )


def estimate_curvature(
    model: nn.Module,
    data: Iterable[Any],
    *,
    structure: Literal["diag", "kfac", "full"] = "diag",
    fisher: Literal["empirical", "mc", "ggn", "hessian"] = "empirical",
    loss: Literal["cross_entropy", "mse"] = "cross_entropy",
    mc_samples: int = 1,
    seed: int = 0,
    ignore_index: int = -100,
    kfac_approx: Literal["expand", "reduce"] = "expand",
    params: Sequence[str] | None = None,
    max_params: int = 20_000,
    kfac_max_factor_side: int | None = MAX_FACTOR_SIDE,
    progress: bool = False,
) -> Curvature:
    r"""The curvature of ``model`` on ``data``, a SUM over examples: H = Σ_i H_i.

    Args:
        model: any ``nn.Module``, at the point where the curvature is wanted (θ_t for a task's
            H_t, θ_LLM for a prior or for removal).
        data: batches ``(inputs, targets)`` or dicts with ``"labels"``; must be re-iterable
            (a list or a DataLoader) for ``structure="kfac"``, which passes over it twice when
            some parameters are not covered by K-FAC.
        structure: ``"diag"`` (:class:`gm.Diagonal`), ``"kfac"`` (:class:`gm.KFAC` for Linear,
            Conv2d, Embedding and GPT-2 Conv1D layers, plus a diagonal block for every other
            trainable parameter: :class:`gm.Blocks`), ``"full"`` (:class:`gm.Dense`, small models).
        fisher: ``"empirical"`` Σ_i ∇ℓ_i ∇ℓ_iᵀ with the observed targets, ``"mc"`` with targets
            drawn from the model (``mc_samples``, seeded), ``"ggn"`` the generalised Gauss-Newton
            Σ_i J_iᵀ Λ_i J_i, ``"hessian"`` (``structure="full"`` only) the exact Hessian.
        loss: ``"cross_entropy"`` (token-level with ``ignore_index``) or ``"mse"`` (½‖f − y‖²).
        kfac_approx: K-FAC's treatment of weight sharing, ``"expand"`` or ``"reduce"``.
        params: restrict ``"diag"``/``"full"`` to these parameter names.
        max_params: the largest model ``"full"`` accepts.
        kfac_max_factor_side: ``"kfac"`` only: a layer whose A or G factor would have a larger
            side gets no Kronecker factors; its parameters join the diagonal block, estimated
            with the same ``fisher`` (exactly the values ``structure="diag"`` gives them), and
            the estimate still covers the whole model. A factor of side n takes n² × 4 bytes in
            float32: the default 16384 allows 1 GiB per factor, which keeps the layers inside
            the blocks of common transformers (widths ≤ 14336) on K-FAC and sends untied
            vocabulary heads (vocab 32k: 4 GB, 152k: 92 GB per G) to the diagonal. Embeddings,
            whose A is diagonal, are held to min(this, :data:`MAX_DIAGONAL_FACTOR`) for their
            vocabulary (their A is stored dense). ``None``: no limit.
        progress: print a line per batch (and per layer left to the diagonal) to stderr.

    Returns:
        The curvature; ``C.meta`` records structure, fisher, loss and num_examples (saved by
        ``C.save``); for ``"kfac"`` also kfac_approx, ``kfac_max_factor_side`` (the limit, or
        ``"none"``) and ``kfac_diagonal_layers``: a JSON object, module name → why its
        parameters are in the diagonal block instead of K-FAC (``"{}"`` when none are).

    Example:
        >>> import torch, gradmerge as gm
        >>> model = torch.nn.Linear(2, 1, bias=False).double()
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> y = torch.zeros(2, 1, dtype=torch.float64)
        >>> gm.estimate_curvature(model, [(X, y)], fisher="ggn", loss="mse").values["weight"]
        tensor([[1., 4.]], dtype=torch.float64)

        A 40-class head above a factor-side limit of 32 gets a diagonal block (and a warning):

        >>> import json, warnings
        >>> lm = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Linear(2, 40)).double()
        >>> ids = torch.tensor([[0, 1], [2, 3]])
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     C = gm.estimate_curvature(lm, [(ids, ids)], structure="kfac", kfac_max_factor_side=32)
        >>> [type(block).__name__ for block in C.blocks], json.loads(C.meta["kfac_diagonal_layers"])
        (['KFAC', 'Diagonal'], {'1': 'G would be 40 × 40: a factor side above the limit of 32'})
    """
    check_structure(structure, fisher)
    kfac_max_factor_side = check_max_factor_side(kfac_max_factor_side, "kfac_max_factor_side")
    data = _Counted(data)
    curvature: Curvature
    if structure == "full":
        curvature = estimate_dense(
            model,
            data,
            fisher=fisher,
            loss=loss,
            mc_samples=mc_samples,
            seed=seed,
            ignore_index=ignore_index,
            params=params,
            max_params=max_params,
        )
    elif structure == "diag":
        curvature = estimate_diagonal(
            model,
            data,
            fisher=_fisher(fisher),
            loss=loss,
            mc_samples=mc_samples,
            seed=seed,
            ignore_index=ignore_index,
            params=params,
            progress=progress,
        )
    else:
        if params is not None:
            raise ArgumentError(
                "params= restricts 'diag' and 'full' estimates; K-FAC covers the model"
            )
        if isinstance(data.data, Iterator):
            raise ArgumentError(
                "structure='kfac' passes over the data more than once: pass a list or a "
                "DataLoader, not a one-shot iterator"
            )
        factors = estimate_kfac_factors(
            model,
            data,
            fisher=_fisher(fisher),
            loss=loss,
            kfac_approx=kfac_approx,
            mc_samples=mc_samples,
            seed=seed,
            ignore_index=ignore_index,
            progress=progress,
            max_factor_side=kfac_max_factor_side,
        )
        curvature = kfac_curvature(
            model,
            data,
            factors,
            fisher=_fisher(fisher),
            loss=loss,
            mc_samples=mc_samples,
            seed=seed,
            ignore_index=ignore_index,
            progress=progress,
        )
    curvature.meta.update(
        {
            "structure": structure,
            "fisher": fisher,
            "loss": loss,
            "num_examples": str(data.examples),
            "normalisation": "sum over examples",
        }
    )
    if structure == "kfac":
        curvature.meta["kfac_approx"] = kfac_approx
    _weight_sample.record(curvature, dict(model.named_parameters()))
    return curvature


def kfac_curvature(
    model: nn.Module,
    data: Iterable[Any],
    factors: KFACFactors,
    *,
    fisher: FisherName = "empirical",
    loss: Literal["cross_entropy", "mse"] = "cross_entropy",
    mc_samples: int = 1,
    seed: int = 0,
    ignore_index: int = -100,
    progress: bool = False,
) -> Curvature:
    """``gm.KFAC`` from estimated factors, plus a diagonal block for what K-FAC does not cover.

    The diagonal block holds ``factors.uncovered`` (layers left out by the estimator: too large
    for ``factors.max_factor_side``, shared weights, other module types, ...), estimated by
    :func:`estimate_diagonal` with the same fisher type, seed and data, so its values are those
    of ``structure="diag"``. Embedding factors with a diagonal A larger than
    :data:`MAX_DIAGONAL_FACTOR` (or ``factors.max_factor_side``) are not stored as K-FAC either
    (their A would be a dense vocab × vocab matrix): those embeddings join the diagonal block.

    ``C.meta`` records the limit (``kfac_max_factor_side``) and, as a JSON object, every
    supported layer routed to the diagonal block with the reason (``kfac_diagonal_layers``).
    """
    limit = MAX_DIAGONAL_FACTOR
    if factors.max_factor_side is not None:
        limit = min(limit, factors.max_factor_side)
    kept, uncovered, routed = {}, list(factors.uncovered), dict(factors.left_out)
    for name, (a, g) in factors.factors.items():
        if a.ndim == 1:
            if a.numel() > limit:
                uncovered.append(f"{name}.weight")
                routed[name] = (
                    f"embedding of {a.numel()} rows: its diagonal A would be stored as a dense "
                    f"{a.numel()} × {a.numel()} matrix, a side above {limit}"
                )
                continue
            a = a.diag()
        kept[name] = (a, g)
    shapes = {name: tuple(_weight(model, name).shape) for name in kept}
    shapes = {name: shape for name, shape in shapes.items() if len(shape) > 2}
    parts: list[Curvature] = []
    if kept:
        parts.append(
            KFAC(
                kept,
                bias=[m for m in kept if factors.has_bias.get(m)],
                transposed=[m for m in kept if factors.transposed.get(m)],
                weight_shapes=shapes,
                counts={m: factors.counts[m] for m in kept if factors.counts.get(m)},
            )
        )
    if uncovered:
        parts.append(
            estimate_diagonal(
                model,
                data,
                fisher=fisher,
                loss=loss,
                mc_samples=mc_samples,
                seed=seed,
                ignore_index=ignore_index,
                params=uncovered,
                progress=progress,
            )
        )
    if not parts:
        raise ArgumentError("K-FAC found nothing to cover in this model")
    curvature = parts[0] if len(parts) == 1 else Blocks(parts)
    side = factors.max_factor_side
    curvature.meta["kfac_max_factor_side"] = "none" if side is None else str(side)
    curvature.meta["kfac_diagonal_layers"] = json.dumps(routed, ensure_ascii=False)
    return curvature


class _Counted:
    """``data``, counting the examples of the first complete pass (no extra pass over the data)."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data, self.examples = data, 0
        self._counted = False

    def __iter__(self) -> Iterator[Any]:
        seen = 0
        for index, batch in enumerate(self.data):
            seen += num_examples(split_batch(batch, index)[1])
            yield batch
        if not self._counted:
            self.examples, self._counted = seen, True


def _fisher(fisher: str) -> FisherName:
    return cast(FisherName, check_fisher(fisher))


def _weight(model: nn.Module, name: str) -> Tensor:
    weight = getattr(model.get_submodule(name), "weight", None)
    if not isinstance(weight, Tensor):
        raise ArgumentError(f"module {name!r} has no weight tensor")
    return weight


__all__ = [
    "MAX_FACTOR_SIDE",
    "MatrixFree",
    "estimate_curvature",
    "estimate_dense",
    "estimate_diagonal",
    "estimate_kfac_factors",
    "gradient_fn",
    "kfac_curvature",
]
