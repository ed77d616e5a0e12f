r"""Data-parallel curvature estimation: each rank estimates on its shard, the sums are all-reduced.

A curvature is a SUM over examples, H = Σ_i H_i (docs/architecture.md), so with the examples split
over R ranks, H = Σ_r Σ_{i ∈ shard r} H_i = Σ_r H_r: every rank runs the single-process estimator of
:func:`gradmerge.estimate_curvature` on its own shard, and the per-rank sums are added with
``all_reduce`` (:mod:`gradmerge.distributed.reduce` says how, K-FAC's mean-normalised A included).
For ``fisher`` = ``"empirical"``, ``"ggn"`` and ``"hessian"`` the result EQUALS the single-process
estimate on the ranks' shards concatenated, up to floating-point rounding (the summation order
differs).

Monte-Carlo Fisher (``fisher="mc"``). Draws come from one seeded generator per process, in batch
order; rank r seeds it with :func:`rank_seed` ``(seed, r)`` (rank 0 keeps ``seed``). The definition
of "equal" for MC is therefore: the distributed estimate equals, up to rounding,

    Σ_r gm.estimate_curvature(model, shard_r, fisher="mc", seed=rank_seed(seed, r)),

the sum of single-process estimates on the shards with those seeds. It is NOT bit-equal to one
single-process run over all the data with ``seed``, whose draws for rank r's examples depend on how
many draws came before them; it has the same distribution (every example's targets are drawn
independently from the model's predictive distribution, whichever generator draws them), so it is
an equally valid unbiased estimate of the Fisher. With one rank it is the single-process estimate.

Before any work the ranks compare the options and a fingerprint of the model (parameter and buffer
names, shapes, dtypes and checksums of their bits; :mod:`gradmerge.distributed.fingerprint`); after
their estimates, each rank's status, example count and the structure of its estimate. Any
disagreement or failure raises :class:`DistributedError` on EVERY rank with the same explanation;
no rank waits for the others longer than ``timeout`` at either point (:mod:`comm`).

Usage, in a script run by ``torchrun --nproc-per-node 2 script.py``::

    import torch.distributed as dist, gradmerge as gm
    dist.init_process_group("gloo")                      # "nccl" for one GPU per rank
    model = build_model().eval()                         # the same weights on every rank
    C = gm.distributed.estimate_curvature(model, gm.distributed.shard(all_batches),
                                          structure="kfac")
    if dist.get_rank() == 0:
        C.save("task.curvature.safetensors")             # every rank holds the same C
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch import nn

from gradmerge.curvature import KFAC, Blocks, Curvature
from gradmerge.distributed.comm import Comm
from gradmerge.distributed.errors import DistributedError
from gradmerge.distributed.fingerprint import (
    ModelFingerprint,
    first_difference,
    model_fingerprint,
    unwrap,
)
from gradmerge.distributed.reduce import Description, contributions, describe, rebuild
from gradmerge.errors import ArgumentError
from gradmerge.estimate import EstimateOptions
from gradmerge.estimate import estimate_with as single_process_estimate

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from gradmerge.estimate.options import EstimateKeywords

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits for the others at a synchronisation point (before the estimate, and
after its own shard is done): above the expected spread of the ranks' finishing times."""

_GOLDEN = 0x9E3779B97F4A7C15  # odd: rank seeds r·_GOLDEN are far apart for every r


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s Monte-Carlo draws: ``seed`` on rank 0, else
    ``(seed + rank · 0x9E3779B97F4A7C15) mod 2⁶³`` (distinct for the ranks of one run).

    Example:
        >>> rank_seed(7, 0), rank_seed(7, 1) != rank_seed(7, 2)
        (7, True)
    """
    if rank < 0:
        raise ArgumentError(f"rank must be non-negative, got {rank}")
    return seed if rank == 0 else (seed + rank * _GOLDEN) % (1 << 63)


@dataclass
class _Local:
    """One rank's estimate and what the reduction needs to know about it."""

    curvature: Curvature
    num_examples: int
    counts: dict[str, int] = field(default_factory=dict)  # K-FAC: module → M_r
    diagonal_a: set[str] = field(default_factory=set)  # K-FAC modules with a diagonal A


@dataclass(frozen=True)
class _Hello:
    """What a rank tells the others before estimating."""

    options: dict[str, Any]
    fingerprint: ModelFingerprint | None
    failure: str | None


@dataclass(frozen=True)
class _Done:
    """What a rank tells the others after estimating on its shard."""

    failure: str | None
    num_examples: int = 0
    description: Description = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def estimate_curvature(
    model: nn.Module,
    data: Iterable[Any],
    *,
    group: Any = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    expected_examples: int | None = None,
    **options: Unpack[EstimateKeywords],
) -> Curvature:
    r"""The curvature of ``model`` on the union of every rank's ``data``: H = Σ_r Σ_{i ∈ shard r}
    H_i.

    Every rank of ``group`` calls this with the same model and options and its OWN shard of the
    data (e.g. :func:`gradmerge.distributed.shard`); every rank returns the same, summed,
    curvature. See the module docstring for what "equal to a single-process run" means (exactly,
    up to rounding; for ``fisher="mc"``, with the per-rank seeds of :func:`rank_seed`).

    Args:
        model: an ``nn.Module`` with the same weights on every rank, or one wrapped in
            ``DistributedDataParallel`` (its ``.module`` is used; DDP's gradient all-reduce is
            never triggered and ``.grad`` is left untouched). FSDP/``fully_shard`` models and
            DTensor parameters are refused (:data:`fingerprint.FSDP_HELP`).
        data: this rank's batches, as for :func:`gradmerge.estimate_curvature`; at least one.
        group: the process group (default: the whole job). CPU tensors are summed over gloo.
        timeout: seconds (or a timedelta) a rank waits for the others at each synchronisation
            point before raising :class:`DistributedError`; default 30 minutes.
        expected_examples: if given, the total number of examples over all ranks must equal it
            (catches samplers that pad or drop, e.g. ``DistributedSampler(drop_last=False)``,
            which repeats examples so that they would be counted twice).
        **options: the keywords of :func:`gradmerge.estimate_curvature` (structure, fisher,
            loss, mc_samples, seed, ignore_index, kfac_approx, kfac_max_factor_side, params,
            max_params, progress), with its defaults: the fields of
            :class:`gradmerge.EstimateOptions`, checked by it on every rank. They must agree
            across ranks (``progress`` excepted).

    Returns:
        The summed curvature, on every rank; ``C.meta`` as in the single-process estimate, with
        ``num_examples`` the total over ranks and ``"ranks"`` the number of ranks.

    Raises:
        ArgumentError: torch.distributed is not initialised (on this rank, before any collective).
        DistributedError: on every rank, when the ranks disagree on the model or the options,
            when a rank's estimate failed (its exception is named), when the ranks' estimates
            differ in structure, when ``expected_examples`` is not met, or when the other ranks
            do not answer within ``timeout``.

    Example (one rank, so the sum is the single-process estimate):
        >>> import torch, torch.distributed as dist, gradmerge as gm
        >>> from gradmerge.distributed import estimate_curvature
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1, bias=False).double()
        >>> X = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> data = [(X, torch.zeros(2, 1, dtype=torch.float64))]
        >>> C = estimate_curvature(model, data, fisher="ggn", loss="mse")
        >>> C.values["weight"], C.meta["num_examples"], C.meta["ranks"]
        (tensor([[1., 4.]], dtype=torch.float64), '2', '1')
        >>> dist.destroy_process_group()
    """
    return estimate_with(
        model, data, options, group=group, timeout=timeout, expected_examples=expected_examples
    )


def estimate_with(
    model: nn.Module,
    data: Iterable[Any],
    options: EstimateOptions | EstimateKeywords,
    *,
    group: Any = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    expected_examples: int | None = None,
) -> Curvature:
    """:func:`estimate_curvature` with the options as one object: an :class:`EstimateOptions`
    (or its keywords, checked on every rank so that bad ones fail on all of them alike).

    Each rank runs the single-process path, :func:`gradmerge.estimate.estimate_with`, on its
    shard with its :func:`rank_seed`; see :func:`estimate_curvature` for the rest.
    """
    with Comm.open(group, timeout) as comm:
        # 1. Agree on the model and the options before any work.
        module: nn.Module | None = None
        checked: EstimateOptions | None = None
        fingerprint, failure, cause = None, None, None
        try:
            checked = (
                options if isinstance(options, EstimateOptions) else EstimateOptions(**options)
            )
            if expected_examples is not None and (
                not isinstance(expected_examples, int) or expected_examples < 1
            ):
                raise ArgumentError(
                    f"expected_examples must be a positive int, got {expected_examples!r}"
                )
            module = unwrap(model)
            fingerprint = model_fingerprint(module)
        except Exception as err:
            failure, cause = _failure(err), err
        agreed = {k: v for k, v in (vars(checked) if checked else {}).items() if k != "progress"}
        agreed["expected_examples"] = expected_examples
        hellos: list[_Hello] = comm.exchange(
            "check the model and options", _Hello(agreed, fingerprint, failure)
        )
        _raise_failures([h.failure for h in hellos], comm.rank, "before estimating", cause)
        _check_agreement(hellos)
        assert module is not None and checked is not None  # no failure anywhere, nor here

        # 2. Estimate on this rank's shard.
        local, cause = None, None
        try:
            local = _estimate_local(module, data, checked, comm.rank)
            parts = contributions(local.curvature, counts=local.counts, diagonal_a=local.diagonal_a)
            done = _Done(None, local.num_examples, describe(parts), local.counts)
        except Exception as err:
            done, cause = _Done(_failure(err)), err
        dones: list[_Done] = comm.exchange("combine their estimates", done)
        _raise_failures([d.failure for d in dones], comm.rank, "while estimating", cause)
        _check_estimates(dones, expected_examples)
        assert local is not None

        # 3. Sum over the ranks.
        comm.all_reduce(list(parts.values()))
        counts = {m: sum(d.counts[m] for d in dones) for m in local.counts}
        result = rebuild(local.curvature, parts, counts=counts, diagonal_a=local.diagonal_a)
    result.meta.update(local.curvature.meta)
    result.meta["num_examples"] = str(sum(d.num_examples for d in dones))
    result.meta["ranks"] = str(comm.world_size)
    return result


def _estimate_local(
    module: nn.Module, data: Iterable[Any], options: EstimateOptions, rank: int
) -> _Local:
    """This rank's single-process estimate (seeded with :func:`rank_seed`), with what the
    reduction needs of its K-FAC layers: the counts M_r that A_r is a mean over (carried by
    ``gm.KFAC``; 0 where the rank kept no position) and which A are diagonal (embeddings)."""
    seeded = replace(options, seed=rank_seed(options.seed, rank))
    curvature = single_process_estimate(module, data, seeded)
    local = _Local(curvature, int(curvature.meta["num_examples"]))
    parts = curvature.blocks if isinstance(curvature, Blocks) else [curvature]
    for kfac in (part for part in parts if isinstance(part, KFAC)):
        for layer in kfac.terms:
            local.counts[layer] = kfac.counts.get(layer, 0)
            if isinstance(module.get_submodule(layer), nn.Embedding):
                local.diagonal_a.add(layer)
    return local


def _failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _raise_failures(
    failures: list[str | None], rank: int, when: str, cause: BaseException | None
) -> None:
    failed = {r: f for r, f in enumerate(failures) if f is not None}
    if not failed:
        return
    by_message: dict[str, list[int]] = {}
    for r, f in failed.items():
        by_message.setdefault(f, []).append(r)
    lines = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {f}"
        for f, ranks in by_message.items()
    )
    raise DistributedError(
        f"{len(failed)} of {len(failures)} ranks failed {when}: {lines}", failed
    ) from cause


def _check_agreement(hellos: list[_Hello]) -> None:
    """Every rank was called with rank 0's options and holds rank 0's model (same everywhere)."""
    ref = hellos[0]
    for r, hello in enumerate(hellos[1:], start=1):
        diff = [k for k in ref.options if hello.options.get(k) != ref.options[k]]
        if diff:
            shown = ", ".join(
                f"{k}={hello.options.get(k)!r} (rank 0: {ref.options[k]!r})" for k in diff
            )
            raise DistributedError(
                f"the ranks were called with different options: rank {r} has {shown}; every "
                "rank must pass the same options (only the data differs)"
            )
    for r, hello in enumerate(hellos[1:], start=1):
        assert hello.fingerprint is not None and ref.fingerprint is not None
        what = first_difference(ref.fingerprint, hello.fingerprint)
        if what is not None:
            raise DistributedError(
                f"the ranks hold different models: rank {r} differs from rank 0: {what}. Load "
                "the same checkpoint on every rank (DDP broadcasts rank 0's weights when it "
                "wraps the model) before estimating"
            )


def _check_estimates(dones: list[_Done], expected_examples: int | None) -> None:
    """The ranks' estimates have one structure, and the example count is the expected one."""
    ref = dones[0].description
    for r, done in enumerate(dones[1:], start=1):
        if done.description != ref or set(done.counts) != set(dones[0].counts):
            raise DistributedError(
                f"the ranks' estimates differ in structure: {_structure_diff(ref, done.description)}"
                f" (rank {r} vs rank 0). K-FAC's coverage can depend on the data: a layer called "
                "with a batch dimension other than the batch's (e.g. a position embedding) is "
                "covered only with batches of one example; give every rank batches of the same "
                "form"
            )
    total = sum(d.num_examples for d in dones)
    if expected_examples is not None and total != expected_examples:
        counts = ", ".join(f"rank {r}: {d.num_examples}" for r, d in enumerate(dones))
        raise DistributedError(
            f"the ranks saw {total} examples in all ({counts}), expected {expected_examples}: "
            "a sampler that pads shards repeats examples (DistributedSampler(drop_last=False)) "
            "and one that drops them loses some; shard with gm.distributed.shard or shard_range"
        )


def _structure_diff(ref: Description, other: Description) -> str:
    ref_keys, other_keys = {d[0]: d for d in ref}, {d[0]: d for d in other}
    only_ref = [k for k in ref_keys if k not in other_keys]
    only_other = [k for k in other_keys if k not in ref_keys]
    if only_ref or only_other:
        return f"only on rank 0: {only_ref[:3]}, only on the other rank: {only_other[:3]}"
    for k, d in ref_keys.items():
        if other_keys[k] != d:
            return f"{k!r} is {other_keys[k][1:]} there and {d[1:]} on rank 0"
    return "the same tensors in a different order"
