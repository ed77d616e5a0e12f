"""One encoding of a curvature's structure tree: named tensors plus a JSON-able spec.

Both the curvature files (:mod:`gradmerge.curvature.io`) and the sum of data-parallel estimates
over ranks (:mod:`gradmerge.distributed.reduce`) walk a curvature through this one codec, so a
structure is described in one place. :func:`encode` dispatches on the structure's type
(:func:`functools.singledispatch`); :func:`decode` on the spec's ``type``. Tensor names, under
the prefix of the enclosing part:

- ``Diagonal``: ``diag/<param>``; spec ``{"type": "diag", "keys": [...]}``;
- ``Dense``: ``dense``; spec ``{"type": "dense", "layout": [[name, shape], ...]}``;
- ``KFAC``: ``kfac/<layer>/<term>/A`` and ``.../G``; spec ``terms`` (layer → number of terms),
  ``bias``, ``transposed``, ``weight_shapes``, ``counts``;
- ``Blocks`` / lazy ``Sum``: each part under ``blocks<i>/`` / ``sum<i>/``; spec ``parts``;
- ``ScaledIdentity``: no tensors; spec ``{"type": "identity", "delta": δ}``.

Example:
    >>> import torch, gradmerge as gm
    >>> from gradmerge.curvature.codec import decode, encode
    >>> C = gm.Blocks([gm.KFAC({"fc": (torch.eye(2), torch.eye(1))}), gm.Diagonal({"b": torch.ones(1)})])
    >>> tensors = {}
    >>> spec = encode(C, "", tensors)
    >>> sorted(tensors)
    ['blocks0/kfac/fc/0/A', 'blocks0/kfac/fc/0/G', 'blocks1/diag/b']
    >>> torch.equal(decode(spec, tensors).dense(), C.dense())
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import singledispatch
from typing import Any

import torch
from torch import Tensor

from gradmerge.curvature.base import Curvature
from gradmerge.curvature.blocks import Blocks
from gradmerge.curvature.dense import Dense
from gradmerge.curvature.diagonal import Diagonal, unchecked
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.curvature.kfac import KFAC
from gradmerge.curvature.lazy import Sum
from gradmerge.errors import ArgumentError, FileFormatError

Spec = dict[str, Any]


@singledispatch
def encode(c: Curvature, prefix: str, tensors: dict[str, Tensor]) -> Spec:
    """Put ``c``'s tensors into ``tensors`` (names under ``prefix``); return its spec.

    The tensors are ``c``'s own (not copies).

    Raises:
        ArgumentError: a structure not stored as tensors (``MatrixFree``).
    """
    raise ArgumentError(f"cannot save a {type(c).__name__} curvature (it is not stored as tensors)")


@encode.register
def _(c: ScaledIdentity, prefix: str, tensors: dict[str, Tensor]) -> Spec:
    return {"type": "identity", "delta": c.delta}


@encode.register
def _(c: Diagonal, prefix: str, tensors: dict[str, Tensor]) -> Spec:
    for k, v in c.values.items():
        tensors[f"{prefix}diag/{k}"] = v
    return {"type": "diag", "keys": list(c.values)}


@encode.register
def _(c: Dense, prefix: str, tensors: dict[str, Tensor]) -> Spec:
    tensors[f"{prefix}dense"] = c.matrix
    return {"type": "dense", "layout": [[k, list(s)] for k, s in c.layout]}


@encode.register
def _(c: KFAC, prefix: str, tensors: dict[str, Tensor]) -> Spec:
    for name, terms in c.terms.items():
        for i, (a, g) in enumerate(terms):
            tensors[kfac_key(prefix, name, i, "A")] = a
            tensors[kfac_key(prefix, name, i, "G")] = g
    return {
        "type": "kfac",
        "terms": {n: len(t) for n, t in c.terms.items()},
        "bias": sorted(c.bias),
        "transposed": sorted(c.transposed),
        "weight_shapes": {k: list(v) for k, v in c.weight_shapes.items()},
        "counts": dict(c.counts),
    }


@encode.register
def _(c: Blocks, prefix: str, tensors: dict[str, Tensor]) -> Spec:
    return _encode_parts("blocks", c.blocks, prefix, tensors)


@encode.register
def _(c: Sum, prefix: str, tensors: dict[str, Tensor]) -> Spec:
    return _encode_parts("sum", c.terms, prefix, tensors)


def _encode_parts(
    kind: str, parts: list[Curvature], prefix: str, tensors: dict[str, Tensor]
) -> Spec:
    return {
        "type": kind,
        "parts": [encode(p, f"{prefix}{kind}{i}/", tensors) for i, p in enumerate(parts)],
    }


def kfac_key(prefix: str, layer: str, term: int, factor: str) -> str:
    """The name of factor ``"A"`` or ``"G"`` of a K-FAC layer's ``term``."""
    return f"{prefix}kfac/{layer}/{term}/{factor}"


def decode(
    spec: Spec, tensors: Mapping[str, Tensor], prefix: str = "", *, defer: bool = False
) -> Curvature:
    """The curvature that ``spec`` describes, over ``tensors``; ``defer``: diagonals' NaN/Inf
    checked by their user (:func:`~gradmerge.curvature.diagonal.unchecked`).

    Raises:
        FileFormatError: a tensor or field the spec needs is missing, or an unknown structure.
    """
    try:
        kind = spec["type"]
        build = _DECODERS.get(kind)
        if build is None:
            raise FileFormatError(f"unknown curvature structure {kind!r} in file")
        return build(spec, tensors, prefix, defer)
    except KeyError as err:
        raise FileFormatError(f"curvature file is missing tensor or field {err}") from err


def _decode_diag(spec: Spec, tensors: Mapping[str, Tensor], prefix: str, defer: bool) -> Curvature:
    values = {k: tensors[f"{prefix}diag/{k}"] for k in spec["keys"]}
    return unchecked(values) if defer else Diagonal(values)


def _decode_dense(spec: Spec, tensors: Mapping[str, Tensor], prefix: str, defer: bool) -> Curvature:
    m = tensors[f"{prefix}dense"]
    like = {k: torch.empty(s, dtype=m.dtype, device=m.device) for k, s in spec["layout"]}
    return Dense(m, like)


def _decode_kfac(spec: Spec, tensors: Mapping[str, Tensor], prefix: str, defer: bool) -> Curvature:
    factors = {
        n: [
            (tensors[kfac_key(prefix, n, i, "A")], tensors[kfac_key(prefix, n, i, "G")])
            for i in range(count)
        ]
        for n, count in spec["terms"].items()
    }
    return KFAC(
        factors,
        bias=spec["bias"],
        transposed=spec["transposed"],
        weight_shapes={k: tuple(v) for k, v in spec["weight_shapes"].items()},
        counts=spec.get("counts"),  # files from before counts were saved have none
    )


def _decode_parts(spec: Spec, tensors: Mapping[str, Tensor], prefix: str, defer: bool) -> Curvature:
    kind = spec["type"]
    parts = [  # "index": a part's place in the saved file (restricted specs skip parts)
        decode(p, tensors, f"{prefix}{kind}{p.get('index', i)}/", defer=defer)
        for i, p in enumerate(spec["parts"])
    ]
    return Blocks(parts) if kind == "blocks" else Sum(parts)


_DECODERS: dict[str, Callable[[Spec, Mapping[str, Tensor], str, bool], Curvature]] = {
    "identity": lambda spec, tensors, prefix, defer: ScaledIdentity(spec["delta"]),
    "diag": _decode_diag,
    "dense": _decode_dense,
    "kfac": _decode_kfac,
    "blocks": _decode_parts,
    "sum": _decode_parts,
}


def nodes(spec: Spec, prefix: str = "") -> Iterator[tuple[str, Spec]]:
    """Every structure of ``spec`` (depth first, parts after their parent) with the prefix of
    its tensors."""
    yield prefix, spec
    kind = spec["type"]
    for i, part in enumerate(spec.get("parts", ())):
        yield from nodes(part, f"{prefix}{kind}{part.get('index', i)}/")
