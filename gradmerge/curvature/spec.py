"""A curvature file's structure tree (its ``spec``), read and queried without its tensors.

The spec (:mod:`gradmerge.curvature.codec` writes it) says which structure covers which
parameters. Before a tensor is read, a file opened lazily (:class:`gradmerge.curvature.io.
CurvatureFile`) asks it: is it nested no deeper than :data:`MAX_SPEC_DEPTH` (:func:`parse_spec`,
for untrusted metadata), which parameters does each part couple (:func:`coupling_groups`, joined
across the terms of a sum by :func:`join_groups`), which tensors does it name
(:func:`tensor_names`), is it elementwise (:func:`is_elementwise`), and what is it cut down to
some parameters (:func:`restricted_spec`).

Example:
    >>> from gradmerge.curvature.spec import coupling_groups, restricted_spec
    >>> spec = {"type": "blocks", "parts": [
    ...     {"type": "kfac", "terms": {"fc": 1}, "bias": ["fc"], "transposed": [],
    ...      "weight_shapes": {}},
    ...     {"type": "diag", "keys": ["norm.weight"]}]}
    >>> coupling_groups(spec)
    [('fc.weight', 'fc.bias'), ('norm.weight',)]
    >>> restricted_spec(spec, {"norm.weight"})
    {'type': 'blocks', 'parts': [{'type': 'diag', 'keys': ['norm.weight'], 'index': 1}]}
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gradmerge.errors import ArgumentError, FileFormatError

MAX_SPEC_DEPTH = 32
"""Nesting levels a curvature file's structure may have (Blocks of Sums of ...): real ones have
a few; a deeper one is refused before anything recurses over it."""


def parse_spec(text: str, source: Path) -> dict[str, Any]:
    """The ``spec`` metadata of a curvature file, refused when its structures nest deeper than
    :data:`MAX_SPEC_DEPTH` (a 50,000-deep one overflowed Python's recursion limit while being
    parsed; a few hundred levels would overflow it in the decoding that recurses over parts)."""
    try:
        spec = json.loads(text)
    except RecursionError:
        spec = None
    if spec is not None and not isinstance(spec, dict):
        raise ValueError(f"the structure is a {type(spec).__name__}, not an object")
    if spec is None or spec_depth(spec) > MAX_SPEC_DEPTH:
        raise FileFormatError(
            f"{source}: damaged curvature metadata: its structure nests more than "
            f"{MAX_SPEC_DEPTH} levels deep; write the curvature again with C.save(path)"
        )
    return spec


def spec_depth(spec: dict[str, Any]) -> int:
    """Nesting levels of structures in ``spec`` (1 for a flat one), counted without recursion
    (the input is untrusted) and only up to just past :data:`MAX_SPEC_DEPTH`."""
    stack, deepest = [(spec, 1)], 0
    while stack and deepest <= MAX_SPEC_DEPTH:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        parts = node.get("parts") if isinstance(node, dict) else None
        if isinstance(parts, list):
            stack.extend((p, depth + 1) for p in parts)
    return deepest


def _layer_keys(name: str, spec: dict[str, Any]) -> tuple[str, ...]:
    return (f"{name}.weight", f"{name}.bias") if name in spec["bias"] else (f"{name}.weight",)


def coupling_groups(spec: dict[str, Any]) -> list[tuple[str, ...]]:
    kind = spec["type"]
    if kind == "identity":
        return []
    if kind == "diag":
        return [(str(k),) for k in spec["keys"]]
    if kind == "dense":
        return [tuple(str(k) for k, _ in spec["layout"])]
    if kind == "kfac":
        return [_layer_keys(n, spec) for n in spec["terms"]]
    if kind == "blocks":
        return [g for p in spec["parts"] for g in coupling_groups(p)]
    if kind == "sum":  # the terms cover the same parameters; join groups that share a parameter
        return join_groups([g for p in spec["parts"] for g in coupling_groups(p)])
    raise ValueError(f"unknown curvature structure {kind!r}")


def join_groups(groups: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Connected components of overlapping groups, each in first-appearance order (union-find)."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    order: list[str] = []
    for group in groups:
        for k in group:
            if k not in parent:
                parent[k] = k
                order.append(k)
        for k in group[1:]:
            parent[find(k)] = find(group[0])
    members: dict[str, list[str]] = {}
    for k in order:
        members.setdefault(find(k), []).append(k)
    return [tuple(m) for m in members.values()]


def kfac_layer_keys(spec: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    if spec["type"] == "kfac":
        return {n: _layer_keys(n, spec) for n in spec["terms"]}
    if spec["type"] == "blocks":
        return {n: keys for p in spec["parts"] for n, keys in kfac_layer_keys(p).items()}
    return {}


def tensor_names(spec: dict[str, Any], prefix: str = "") -> Iterator[str]:
    kind = spec["type"]
    if kind == "diag":
        yield from (f"{prefix}diag/{k}" for k in spec["keys"])
    elif kind == "dense":
        yield f"{prefix}dense"
    elif kind == "kfac":
        for n, count in spec["terms"].items():
            for i in range(count):
                yield from (f"{prefix}kfac/{n}/{i}/A", f"{prefix}kfac/{n}/{i}/G")
    elif kind in ("blocks", "sum"):
        for i, p in enumerate(spec["parts"]):
            yield from tensor_names(p, f"{prefix}{kind}{p.get('index', i)}/")


def is_elementwise(spec: dict[str, Any]) -> bool:
    """Whether a structure couples no two entries (diagonal, δ·I, and blocks and sums of them)."""
    kind = spec["type"]
    if kind in ("blocks", "sum"):
        return all(is_elementwise(p) for p in spec["parts"])
    return kind in ("diag", "identity")


def restricted_spec(spec: dict[str, Any], keys: set[str]) -> dict[str, Any] | None:
    """``spec`` cut down to the parameters in ``keys`` (``None``: it covers none of them)."""
    kind = spec["type"]
    if kind == "identity":
        return spec
    if kind == "diag":
        kept = [k for k in spec["keys"] if k in keys]
        return {"type": "diag", "keys": kept} if kept else None
    if kind == "dense":
        inside = [k in keys for k, _ in spec["layout"]]
        if all(inside):
            return spec
        if any(inside):
            raise _split_error(tuple(k for k, _ in spec["layout"]), keys)
        return None
    if kind == "kfac":
        layers = []
        for n in spec["terms"]:
            group = _layer_keys(n, spec)
            inside = [k in keys for k in group]
            if all(inside):
                layers.append(n)
            elif any(inside):
                raise _split_error(group, keys)
        if not layers:
            return None
        return {
            "type": "kfac",
            "terms": {n: spec["terms"][n] for n in layers},
            "bias": [n for n in spec["bias"] if n in layers],
            "transposed": [n for n in spec["transposed"] if n in layers],
            "weight_shapes": {n: s for n, s in spec["weight_shapes"].items() if n in layers},
            "counts": {n: m for n, m in spec.get("counts", {}).items() if n in layers},
        }
    parts = []
    for i, part in enumerate(spec["parts"]):
        cut = restricted_spec(part, keys)
        if cut is not None:
            parts.append({**cut, "index": i})
    if all(p["type"] == "identity" for p in parts):
        return None
    return {"type": kind, "parts": parts}


def _split_error(group: tuple[str, ...], keys: set[str]) -> ArgumentError:
    inside = [k for k in group if k in keys]
    outside = [k for k in group if k not in keys]
    return ArgumentError(
        f"the curvature couples {list(group)[:4]}{' ...' if len(group) > 4 else ''}, but only "
        f"{inside[:3]} were asked for (not {outside[:3]}): restrict to whole coupling groups "
        "(CurvatureFile.couplings())"
    )
