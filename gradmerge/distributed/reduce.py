r"""Summing curvature estimates over ranks: which tensors to all-reduce, and the result rebuilt.

A curvature is a SUM over examples, so the estimate on the union of the ranks' shards is the sum
of the ranks' estimates — exactly for every quantity that is itself a sum over examples:

- ``Diagonal`` values and ``Dense`` matrices: H = Σ_r H_r.
- ``KFAC``: G = Σ_r G_r is a sum, but A is a MEAN over the M kept positions (``expand``) or
  examples (``reduce``) that the layer saw (``gradmerge.estimate.kfac``):
  A_r = (1/M_r) Σ_{(i,s) on rank r} a_is a_isᵀ. The single-process A on all the data is therefore

      A = (Σ_r M_r A_r) / (Σ_r M_r),     M = Σ_r M_r,

  so each rank contributes M_r A_r and M_r, and the sums are divided once at the end (a rank with
  M_r = 0 contributes 0). An embedding's A is diagonal: only its diagonal is sent.
- ``Blocks`` (K-FAC plus a diagonal block for what K-FAC does not cover): block by block.

Every rank must hold an estimate of the same structure (same keys, shapes and dtypes, in the same
order): :func:`describe` lists it for the cross-rank comparison that precedes the reduction. The
tensors are named and the structure rebuilt by the curvature files' codec
(:mod:`gradmerge.curvature.codec`).

Example (one process: the "reduction" over one rank is the identity):
    >>> import torch, gradmerge as gm
    >>> from gradmerge.distributed.reduce import contributions, rebuild
    >>> C = gm.KFAC({"fc": (2 * torch.eye(2), torch.eye(1))})
    >>> parts = contributions(C, counts={"fc": 3}, diagonal_a=set())
    >>> parts["kfac/fc/0/A"]                                # M_r A_r, to be summed over ranks
    tensor([[6., 0.],
            [0., 6.]])
    >>> rebuild(C, parts, counts={"fc": 3}, diagonal_a=set()).terms["fc"][0][0]
    tensor([[2., 0.],
            [0., 2.]])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Set

import torch
from torch import Tensor

from gradmerge.curvature import Curvature
from gradmerge.curvature.codec import Spec, decode, encode, kfac_key, nodes
from gradmerge.errors import ArgumentError, StructureError

Description = list[tuple[str, tuple[int, ...], str]]

ESTIMATES = ("diag", "dense", "kfac", "blocks")
"""The structures an estimate is made of (the spec types of :mod:`gradmerge.curvature.codec`)."""


def contributions(
    curvature: Curvature, *, counts: Mapping[str, int], diagonal_a: Set[str]
) -> dict[str, Tensor]:
    """The tensors this rank adds to the sum, by a key naming their place in ``curvature``.

    Args:
        curvature: this rank's estimate (Diagonal, Dense, KFAC with one term per layer, Blocks).
        counts: K-FAC module → M_r, the number A_r is a mean over (``KFACFactors.counts``).
        diagonal_a: K-FAC modules whose A is diagonal (embeddings): only the diagonal is sent.

    Returns:
        key → tensor, in a fixed order; the tensors are fresh or the estimate's own (summed in
        place by the reduction).

    Raises:
        StructureError: ``curvature`` is not an estimate's structure.
    """
    out: dict[str, Tensor] = {}
    spec = _estimate_spec(curvature, out)
    for key, layer in _a_factors(spec):
        a = out[key].diagonal() if layer in diagonal_a else out[key]
        out[key] = a * counts[layer]  # Σ over positions = M_r · mean
    return out


def describe(parts: Mapping[str, Tensor]) -> Description:
    """(key, shape, dtype) of each contribution: what every rank must agree on."""
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in parts.items()]


def rebuild(
    curvature: Curvature,
    summed: Mapping[str, Tensor],
    *,
    counts: Mapping[str, int],
    diagonal_a: Set[str],
) -> Curvature:
    """``curvature``'s structure with the summed tensors; K-FAC's A divided by M = Σ_r M_r.

    K-FAC layers get the counts M > 0 and the default solver settings (those of every estimate).
    """
    spec = _estimate_spec(curvature, {})
    tensors = dict(summed)
    for key, layer in _a_factors(spec):
        a = tensors[key] / max(counts[layer], 1)
        tensors[key] = torch.diag(a) if layer in diagonal_a else a
    for _, node in nodes(spec):
        if node["type"] == "kfac":
            node["counts"] = {m: counts[m] for m in node["terms"] if counts[m] > 0}
    return decode(spec, tensors)


def _estimate_spec(curvature: Curvature, tensors: dict[str, Tensor]) -> Spec:
    """The codec's spec of ``curvature`` (its tensors into ``tensors``), refused unless it is an
    estimate: Diagonal, Dense, KFAC with one term per layer, or Blocks of these."""
    refusal = (
        f"cannot sum a {type(curvature).__name__} curvature over ranks: estimates are Diagonal, "
        "Dense, KFAC or Blocks of these"
    )
    try:
        spec = encode(curvature, "", tensors)
    except ArgumentError as err:  # not stored as tensors (MatrixFree)
        raise StructureError(refusal) from err
    for _, node in nodes(spec):
        if node["type"] not in ESTIMATES:
            raise StructureError(refusal)
        if node["type"] != "kfac":
            continue
        for layer, terms in node["terms"].items():
            if terms != 1:
                raise StructureError(
                    f"K-FAC layer {layer!r} holds {terms} Kronecker terms; an estimate has one"
                )
    return spec


def _a_factors(spec: Spec) -> Iterator[tuple[str, str]]:
    """(tensor name, layer) of every K-FAC layer's A factor in ``spec``."""
    for prefix, node in nodes(spec):
        if node["type"] == "kfac":
            for layer in node["terms"]:
                yield kfac_key(prefix, layer, 0, "A"), layer
