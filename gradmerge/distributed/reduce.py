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
order): :func:`describe` lists it for the cross-rank comparison that precedes the reduction.

Example (one process: the "reduction" over one rank is the identity):
    >>> import torch, gradmerge as gm
    >>> from gradmerge.distributed.reduce import contributions, rebuild
    >>> C = gm.KFAC({"fc": (2 * torch.eye(2), torch.eye(1))})
    >>> parts = contributions(C, counts={"fc": 3}, diagonal_a=set())
    >>> parts["kfac/fc/A"]                                  # M_r A_r, to be summed over ranks
    tensor([[6., 0.],
            [0., 6.]])
    >>> rebuild(C, parts, counts={"fc": 3}, diagonal_a=set()).terms["fc"][0][0]
    tensor([[2., 0.],
            [0., 2.]])
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import torch
from torch import Tensor

from gradmerge.curvature import KFAC, Blocks, Curvature, Dense, Diagonal
from gradmerge.errors import StructureError

Description = list[tuple[str, tuple[int, ...], str]]


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
    """
    out: dict[str, Tensor] = {}
    _collect(curvature, "", counts, diagonal_a, out)
    return out


def _collect(
    c: Curvature, prefix: str, counts: Mapping[str, int], diag_a: Set[str], out: dict[str, Tensor]
) -> None:
    if isinstance(c, Diagonal):
        for k, v in c.values.items():
            out[f"{prefix}diag/{k}"] = v
    elif isinstance(c, Dense):
        out[f"{prefix}dense"] = c.matrix
    elif isinstance(c, KFAC):
        for m, terms in c.terms.items():
            if len(terms) != 1:
                raise StructureError(
                    f"K-FAC layer {m!r} holds {len(terms)} Kronecker terms; an estimate has one"
                )
            a, g = terms[0]
            a = a.diagonal() if m in diag_a else a
            out[f"{prefix}kfac/{m}/A"] = a * counts[m]  # Σ over positions = M_r · mean
            out[f"{prefix}kfac/{m}/G"] = g
    elif isinstance(c, Blocks):
        for i, block in enumerate(c.blocks):
            _collect(block, f"{prefix}block{i}/", counts, diag_a, out)
    else:
        raise StructureError(
            f"cannot sum a {type(c).__name__} curvature over ranks: estimates are Diagonal, "
            "Dense, KFAC or Blocks of these"
        )


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
    """``curvature``'s structure with the summed tensors; K-FAC's A divided by M = Σ_r M_r."""
    return _build(curvature, "", summed, counts, diagonal_a)


def _build(
    c: Curvature,
    prefix: str,
    summed: Mapping[str, Tensor],
    counts: Mapping[str, int],
    diag_a: Set[str],
) -> Curvature:
    if isinstance(c, Diagonal):
        return Diagonal({k: summed[f"{prefix}diag/{k}"] for k in c.values})
    if isinstance(c, Dense):
        return Dense(summed[f"{prefix}dense"], c._like())
    if isinstance(c, KFAC):
        factors: dict[str, tuple[Tensor, Tensor]] = {}
        for m in c.terms:
            a = summed[f"{prefix}kfac/{m}/A"] / max(counts[m], 1)
            factors[m] = (torch.diag(a) if m in diag_a else a, summed[f"{prefix}kfac/{m}/G"])
        return KFAC(
            factors,
            bias=c.bias,
            transposed=c.transposed,
            weight_shapes=c.weight_shapes,
            cg_tol=c.cg_tol,
            cg_maxiter=c.cg_maxiter,
            counts={m: counts[m] for m in c.terms if counts[m] > 0},
        )
    if isinstance(c, Blocks):
        return Blocks(
            [
                _build(b, f"{prefix}block{i}/", summed, counts, diag_a)
                for i, b in enumerate(c.blocks)
            ]
        )
    raise StructureError(f"cannot rebuild a {type(c).__name__} curvature")  # see _collect
