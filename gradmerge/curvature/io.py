"""Save and load curvatures as safetensors files, with metadata and a parameter fingerprint.

A file holds the tensors of one curvature (any structure, nested ``Blocks`` and lazy ``Sum``s of
structured terms included) and string metadata: the format version, the structure, what the
estimator recorded (fisher type, loss, number of examples, ...), the dtype, the layout, and a
fingerprint (SHA-256 of the covered parameter names and shapes). ``load_curvature(path, like=m)``
refuses a file whose fingerprint does not match the model or parameter dict ``m``. Writes are
atomic: a temporary file in the same folder, renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradmerge.curvature.base import Curvature
from gradmerge.curvature.blocks import Blocks
from gradmerge.curvature.dense import Dense
from gradmerge.curvature.diagonal import Diagonal
from gradmerge.curvature.identity import ScaledIdentity
from gradmerge.curvature.kfac import KFAC
from gradmerge.curvature.lazy import Sum
from gradmerge.errors import ArgumentError, FileFormatError, StructureError
from gradmerge.params import Layout, Params

FORMAT = "gradmerge-curvature/1"


def fingerprint(layout: Layout) -> str:
    """SHA-256 of the sorted ``name:shape`` lines of the covered parameters."""
    lines = sorted(f"{k}:{','.join(map(str, s))}" for k, s in layout)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def save_curvature(curvature: Curvature, path: str | os.PathLike[str]) -> Path:
    """Write ``curvature`` to ``path`` (a ``.safetensors`` file), atomically."""
    from safetensors.torch import save_file

    if curvature.layout is None:
        raise ArgumentError("δ·I covers no particular parameters; there is nothing to save")
    tensors: dict[str, Tensor] = {}
    spec = _encode(curvature, "", tensors)
    seen: set[tuple[int, int]] = set()
    for key, value in tensors.items():  # safetensors refuses tensors that share memory
        ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()))
        if (
            ident in seen
            or value.untyped_storage().nbytes() != value.numel() * value.element_size()
        ):
            tensors[key] = value.clone()
        seen.add(ident)
    dtype, _ = curvature._dtype_device()
    meta = {
        "format": FORMAT,
        "structure": spec["type"],
        "spec": json.dumps(spec),
        "layout": json.dumps([[k, list(s)] for k, s in curvature.layout]),
        "fingerprint": fingerprint(curvature.layout),
        "dtype": str(dtype).removeprefix("torch."),
        **{f"info.{k}": str(v) for k, v in curvature.meta.items()},
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=meta
        )
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_curvature(
    path: str | os.PathLike[str],
    *,
    like: nn.Module | Params | None = None,
    device: torch.device | str | None = None,
) -> Curvature:
    """Read a curvature written by :func:`save_curvature` (``C.save``).

    Args:
        path: the file.
        like: a model or parameter dict the curvature must fit: every covered parameter must
            exist there with the same shape, else :class:`StructureError` names the differences.
        device: where to put the tensors (default: CPU).

    Raises:
        FileNotFoundError: no such file.
        FileFormatError: not a gradmerge curvature file, or a corrupt/truncated one.
        StructureError: the fingerprint does not match ``like``.
    """
    from safetensors import safe_open

    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no curvature file at {source}")
    try:
        with safe_open(str(source), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API
    except Exception as err:  # safetensors raises its own errors for damaged files
        raise FileFormatError(f"{source} is not a readable safetensors file ({err})") from err
    if meta.get("format") != FORMAT:
        raise FileFormatError(
            f"{source} is not a gradmerge curvature file (format {meta.get('format')!r}, "
            f"expected {FORMAT!r}); write curvatures with C.save(path)"
        )
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    try:
        curvature = _decode(json.loads(meta["spec"]), tensors)
        stored = meta["fingerprint"]
    except (KeyError, ValueError) as err:
        raise FileFormatError(f"{source}: damaged curvature metadata ({err})") from err
    if fingerprint(curvature.layout or ()) != stored:
        raise FileFormatError(f"{source}: the stored fingerprint does not match its tensors")
    curvature.meta.update({k[5:]: v for k, v in meta.items() if k.startswith("info.")})
    if like is not None:
        _check_fits(curvature, like, source)
    return curvature


def _check_fits(curvature: Curvature, like: nn.Module | Params, source: Path) -> None:
    shapes = (
        {k: tuple(v.shape) for k, v in like.named_parameters()}
        if isinstance(like, nn.Module)
        else {k: tuple(v.shape) for k, v in like.items()}
    )
    layout = curvature.layout or ()
    missing = [k for k, _ in layout if k not in shapes]
    wrong = [
        f"{k}: file {tuple(s)}, model {shapes[k]}"
        for k, s in layout
        if k in shapes and tuple(s) != shapes[k]
    ]
    if missing or wrong:
        raise StructureError(
            f"{source} was estimated for other parameters (fingerprint mismatch): "
            + (f"{len(missing)} not in the model, e.g. {missing[:3]}; " if missing else "")
            + (f"{len(wrong)} of another shape, e.g. {wrong[:3]}" if wrong else "")
            + ". Estimate the curvature for this model."
        )


def _encode(c: Curvature, prefix: str, tensors: dict[str, Tensor]) -> dict[str, Any]:
    if isinstance(c, ScaledIdentity):
        return {"type": "identity", "delta": c.delta}
    if isinstance(c, Diagonal):
        for k, v in c.values.items():
            tensors[f"{prefix}diag/{k}"] = v
        return {"type": "diag", "keys": list(c.values)}
    if isinstance(c, Dense):
        tensors[f"{prefix}dense"] = c.matrix
        return {"type": "dense", "layout": [[k, list(s)] for k, s in c.layout]}
    if isinstance(c, KFAC):
        for name, terms in c.terms.items():
            for i, (a, g) in enumerate(terms):
                tensors[f"{prefix}kfac/{name}/{i}/A"] = a
                tensors[f"{prefix}kfac/{name}/{i}/G"] = g
        return {
            "type": "kfac",
            "terms": {n: len(t) for n, t in c.terms.items()},
            "bias": sorted(c.bias),
            "transposed": sorted(c.transposed),
            "weight_shapes": {k: list(v) for k, v in c.weight_shapes.items()},
        }
    if isinstance(c, (Blocks, Sum)):
        kind = "blocks" if isinstance(c, Blocks) else "sum"
        parts = c.blocks if isinstance(c, Blocks) else c.terms
        return {
            "type": kind,
            "parts": [_encode(p, f"{prefix}{kind}{i}/", tensors) for i, p in enumerate(parts)],
        }
    raise ArgumentError(f"cannot save a {type(c).__name__} curvature (it is not stored as tensors)")


def _decode(spec: dict[str, Any], tensors: dict[str, Tensor], prefix: str = "") -> Curvature:
    try:
        kind = spec["type"]
        if kind == "identity":
            return ScaledIdentity(spec["delta"])
        if kind == "diag":
            return Diagonal({k: tensors[f"{prefix}diag/{k}"] for k in spec["keys"]})
        if kind == "dense":
            m = tensors[f"{prefix}dense"]
            like = {k: torch.empty(s, dtype=m.dtype) for k, s in spec["layout"]}
            return Dense(m, like)
        if kind == "kfac":
            factors = {
                n: [
                    (tensors[f"{prefix}kfac/{n}/{i}/A"], tensors[f"{prefix}kfac/{n}/{i}/G"])
                    for i in range(count)
                ]
                for n, count in spec["terms"].items()
            }
            return KFAC(
                factors,
                bias=spec["bias"],
                transposed=spec["transposed"],
                weight_shapes={k: tuple(v) for k, v in spec["weight_shapes"].items()},
            )
        if kind in ("blocks", "sum"):
            parts = [
                _decode(p, tensors, f"{prefix}{kind}{i}/") for i, p in enumerate(spec["parts"])
            ]
            return Blocks(parts) if kind == "blocks" else Sum(parts)
    except KeyError as err:
        raise FileFormatError(f"curvature file is missing tensor or field {err}") from err
    raise FileFormatError(f"unknown curvature structure {kind!r} in file")
