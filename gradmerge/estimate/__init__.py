"""Curvature of a model on data: ``estimate_curvature`` and the estimators behind it.

Every estimate is a SUM over examples (an example is one row of a batch; see
:mod:`gradmerge.estimate._data`); divide by ``int(C.meta["num_examples"])`` for the mean.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, cast

from torch import Tensor, nn

from gradmerge.curvature import KFAC, Blocks, Curvature
from gradmerge.errors import ArgumentError
from gradmerge.estimate._data import FisherName, num_examples, split_batch
from gradmerge.estimate.dense import estimate_dense
from gradmerge.estimate.diagonal import estimate_diagonal
from gradmerge.estimate.kfac import KFACFactors, estimate_kfac_factors
from gradmerge.estimate.matrix_free import MatrixFree

MAX_DIAGONAL_FACTOR = 4096
"""Embeddings whose diagonal A factor is larger than this get a diagonal block instead of K-FAC
(a dense vocab × vocab factor would not fit; see ``kfac_curvature``)."""


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

    Returns:
        The curvature; ``C.meta`` records structure, fisher, loss and num_examples (saved by
        ``C.save``).

    Example:
        >>> import torch, gradmerge as gm
        >>> model = torch.nn.Linear(2, 1, bias=False).double()
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> y = torch.zeros(2, 1, dtype=torch.float64)
        >>> gm.estimate_curvature(model, [(X, y)], fisher="ggn", loss="mse").values["weight"]
        tensor([[1., 4.]], dtype=torch.float64)
    """
    if structure not in ("diag", "kfac", "full"):
        raise ArgumentError(f"structure must be 'diag', 'kfac' or 'full', got {structure!r}")
    if fisher == "hessian" and structure != "full":
        raise ArgumentError(
            "fisher='hessian' is available for structure='full' (and gm.MatrixFree) only: "
            "diagonal and K-FAC estimates are of a Fisher or GGN"
        )
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

    Embedding factors with a diagonal A larger than :data:`MAX_DIAGONAL_FACTOR` are not stored
    as K-FAC (their A would be a dense vocab × vocab matrix); those embeddings join the diagonal
    block, estimated with the same fisher type.
    """
    kept, uncovered = {}, list(factors.uncovered)
    for name, (a, g) in factors.factors.items():
        if a.ndim == 1:
            if a.numel() > MAX_DIAGONAL_FACTOR:
                uncovered.append(f"{name}.weight")
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
    return parts[0] if len(parts) == 1 else Blocks(parts)


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
    if fisher not in ("empirical", "mc", "ggn"):
        raise ArgumentError(f"fisher must be 'empirical', 'mc' or 'ggn', got {fisher!r}")
    return cast(FisherName, fisher)


def _weight(model: nn.Module, name: str) -> Tensor:
    weight = getattr(model.get_submodule(name), "weight", None)
    if not isinstance(weight, Tensor):
        raise ArgumentError(f"module {name!r} has no weight tensor")
    return weight


__all__ = [
    "MatrixFree",
    "estimate_curvature",
    "estimate_dense",
    "estimate_diagonal",
    "estimate_kfac_factors",
    "kfac_curvature",
]
