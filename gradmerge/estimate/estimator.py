"""The one path from options to a curvature: ``estimate_curvature``, ``estimate_with``.

Every estimate is a SUM over examples (an example is one row of a batch; see
:mod:`gradmerge.estimate._data`); divide by ``int(C.meta["num_examples"])`` for the mean.
The keywords of :func:`estimate_curvature` are :class:`EstimateOptions`' fields, their
defaults read from its declarations (:mod:`gradmerge.estimate.options`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

from torch import Tensor, nn

from gradmerge.curvature import KFAC, Blocks, Curvature, Diagonal, provenance
from gradmerge.errors import ArgumentError
from gradmerge.estimate._data import num_examples, split_batch
from gradmerge.estimate.dense import estimate_dense
from gradmerge.estimate.diagonal import estimate_diagonal
from gradmerge.estimate.kfac import KFACFactors, estimate_kfac_factors
from gradmerge.estimate.options import (
    EstimateOptions,
    Fisher,
    FisherName,
    KFACApprox,
    KFACApproxName,
    LossFunction,
    LossName,
    Structure,
    StructureName,
)

MAX_DIAGONAL_FACTOR = 4096
"""Embeddings whose diagonal A factor is larger than this (or than the factor-side limit) get a
diagonal block instead of K-FAC (``gm.KFAC`` stores A as a dense vocab × vocab matrix; see
``kfac_curvature``)."""


def estimate_curvature(
    model: nn.Module,
    data: Iterable[Any],
    *,
    structure: Structure | StructureName = EstimateOptions.structure,
    fisher: Fisher | FisherName | Literal["hessian"] = EstimateOptions.fisher,
    loss: LossFunction | LossName = EstimateOptions.loss,
    mc_samples: int = EstimateOptions.mc_samples,
    seed: int = EstimateOptions.seed,
    ignore_index: int = EstimateOptions.ignore_index,
    kfac_approx: KFACApprox | KFACApproxName = EstimateOptions.kfac_approx,
    params: Sequence[str] | None = EstimateOptions.params,
    max_params: int = EstimateOptions.max_params,
    kfac_max_factor_side: int | None = EstimateOptions.kfac_max_factor_side,
    progress: bool = EstimateOptions.progress,
) -> Curvature:
    r"""The curvature of ``model`` on ``data``, a SUM over examples: H = Σ_i H_i.

    The keywords are the fields of :class:`EstimateOptions`, checked there before any work (an
    :class:`~gradmerge.errors.ArgumentError` names the option): this is
    ``estimate_with(model, data, EstimateOptions(**keywords))``. Their defaults are its
    declarations' (docs/config.md, "Curvature estimates", lists them).

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
            float32: the default (:data:`MAX_FACTOR_SIDE`) allows 1 GiB per factor, which keeps the
            layers inside the blocks of common transformers (widths ≤ 14336) on K-FAC and sends
            untied vocabulary heads (vocab 32k: 4 GB, 152k: 92 GB per G) to the diagonal.
            Embeddings, whose A is diagonal, are held to min(this, :data:`MAX_DIAGONAL_FACTOR`) for
            their vocabulary (their A is stored dense). ``None``: no limit.
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
    # The keywords above are EstimateOptions' fields, in order (a test holds them equal).
    options = EstimateOptions(
        structure, fisher, loss, mc_samples, seed, ignore_index, kfac_approx, params,
        max_params, kfac_max_factor_side, progress,
    )  # fmt: skip
    return estimate_with(model, data, options)


def estimate_with(model: nn.Module, data: Iterable[Any], options: EstimateOptions) -> Curvature:
    r"""The curvature of ``model`` on ``data`` with ``options``: the one path behind
    :func:`estimate_curvature` (``estimate_curvature(model, data, **kw)`` is
    ``estimate_with(model, data, EstimateOptions(**kw))``), ``gm.distributed.estimate_curvature``
    (on each rank's shard) and ``gradmerge curvature``.

    H = Σ_i H_i, a SUM over the examples of ``data``; the structures and curvature types are
    those of :class:`EstimateOptions` (:func:`estimate_curvature` documents them and ``C.meta``).

    Args:
        model: any ``nn.Module``, at the point where the curvature is wanted.
        data: batches ``(inputs, targets)`` or dicts with ``"labels"``; re-iterable (a list or a
            DataLoader) for ``structure="kfac"``.
        options: the estimator's options, checked when they were made.

    Example:
        >>> import torch, gradmerge as gm
        >>> model = torch.nn.Linear(2, 1, bias=False).double()
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> data = [(X, torch.zeros(2, 1, dtype=torch.float64))]
        >>> C = gm.estimate.estimate_with(model, data, gm.EstimateOptions(structure="full", fisher="ggn", loss="mse"))
        >>> C.matrix, C.meta["structure"]
        (tensor([[1., 0.],
                [0., 4.]], dtype=torch.float64), 'full')

    References:
        Martens, "New Insights and Perspectives on the Natural Gradient Method", JMLR 2020
        (Fisher and GGN); Martens & Grosse, ICML 2015 (K-FAC).
    """
    counted = _Counted(data)
    curvature: Curvature
    if options.structure == Structure.FULL:
        curvature = estimate_dense(
            model, counted, params=options.params, max_params=options.max_params, **_draws(options)
        )
    elif options.structure == Structure.DIAG:
        curvature = _diagonal(model, counted, options, options.params)
    else:
        if isinstance(data, Iterator):
            raise ArgumentError(
                "structure='kfac' passes over the data more than once: pass a list or a "
                "DataLoader, not a one-shot iterator"
            )
        factors = estimate_kfac_factors(
            model,
            counted,
            kfac_approx=options.kfac_approx,
            kfac_max_factor_side=options.kfac_max_factor_side,
            progress=options.progress,
            diagonal=True,  # the diagonal block from the same pass
            **_draws(options),
        )
        curvature = kfac_curvature(model, counted, factors, options)
    curvature.meta.update(
        {
            "structure": str(options.structure),
            "fisher": str(options.fisher),
            "loss": str(options.loss),
            "num_examples": str(counted.examples),
            "normalisation": "sum over examples",
        }
    )
    if options.structure == Structure.KFAC:
        curvature.meta["kfac_approx"] = str(options.kfac_approx)
    provenance.record(curvature, dict(model.named_parameters()))
    return curvature


def kfac_curvature(
    model: nn.Module,
    data: Iterable[Any],
    factors: KFACFactors,
    options: EstimateOptions | None = None,
) -> Curvature:
    """``gm.KFAC`` from estimated factors, plus a diagonal block for what K-FAC does not cover.

    The diagonal block holds ``factors.uncovered`` (layers left out by the estimator: too large
    for ``factors.kfac_max_factor_side``, shared weights, other module types, ...): the values
    the K-FAC pass collected (``factors.diagonal``, from ``estimate_kfac_factors(diagonal=True)``,
    the same draws), and for any parameter it lacks, :func:`estimate_diagonal` with ``options``
    (fisher type, seed, ...; default: the factors' fisher and loss) in a pass of its own over the
    same data. Either way its values are those of ``structure="diag"``. Embedding
    factors with a diagonal A larger than :data:`MAX_DIAGONAL_FACTOR` (or
    ``factors.kfac_max_factor_side``) are not stored as K-FAC either (their A would be a dense
    vocab × vocab matrix): those embeddings join the diagonal block.

    ``C.meta`` records the limit (``kfac_max_factor_side``) and, as a JSON object, every
    supported layer routed to the diagonal block with the reason (``kfac_diagonal_layers``).
    """
    if options is None:
        options = EstimateOptions(
            structure=Structure.KFAC,
            fisher=Fisher.check(factors.fisher, "fisher"),
            loss=LossFunction.check(factors.loss, "loss"),
            kfac_approx=KFACApprox.check(factors.kfac_approx, "kfac_approx"),
            kfac_max_factor_side=factors.kfac_max_factor_side,
        )
    limit = MAX_DIAGONAL_FACTOR
    if factors.kfac_max_factor_side is not None:
        limit = min(limit, factors.kfac_max_factor_side)
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
        parts.append(_diagonal_block(model, data, options, uncovered, factors.diagonal))
    if not parts:
        raise ArgumentError("K-FAC found nothing to cover in this model")
    curvature = parts[0] if len(parts) == 1 else Blocks(parts)
    side = factors.kfac_max_factor_side
    curvature.meta["kfac_max_factor_side"] = "none" if side is None else str(side)
    curvature.meta["kfac_diagonal_layers"] = json.dumps(routed, ensure_ascii=False)
    return curvature


def _diagonal_block(
    model: nn.Module,
    data: Iterable[Any],
    options: EstimateOptions,
    params: list[str],
    collected: dict[str, Tensor],
) -> Curvature:
    """The diagonal of ``params``: taken from ``collected`` (the K-FAC pass's shared-pass diagonal)
    where it has them, estimated in a pass of its own for the others (``fisher="ggn"``, or a
    non-embedding layer left out while the pass ran: never called, a batch dimension that does not
    match)."""
    missing = [name for name in params if name not in collected]
    values = {name: collected[name] for name in params if name in collected}
    if missing:
        values |= _diagonal(model, data, options, missing).values  # type: ignore[attr-defined]
    return Diagonal({name: values[name] for name in params})


def _diagonal(
    model: nn.Module, data: Iterable[Any], options: EstimateOptions, params: Sequence[str] | None
) -> Curvature:
    """:func:`estimate_diagonal` with ``options``, over ``params`` (None: every parameter)."""
    return estimate_diagonal(
        model, data, params=params, progress=options.progress, **_draws(options)
    )


def _draws(options: EstimateOptions) -> dict[str, Any]:
    """The keywords every estimator takes from the options: which curvature of which loss, and
    the Monte-Carlo draws (``fisher="mc"``) and ignored targets behind it."""
    return {
        "fisher": options.fisher,
        "loss": options.loss,
        "mc_samples": options.mc_samples,
        "seed": options.seed,
        "ignore_index": options.ignore_index,
    }


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


def _weight(model: nn.Module, name: str) -> Tensor:
    weight = getattr(model.get_submodule(name), "weight", None)
    if not isinstance(weight, Tensor):
        raise ArgumentError(f"module {name!r} has no weight tensor")
    return weight


__all__ = ["MAX_DIAGONAL_FACTOR", "estimate_curvature", "estimate_with", "kfac_curvature"]
