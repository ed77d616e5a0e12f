"""Curvatures in the layout of the paper's official code, converted to gradmerge diagonal files.

The official code (UKPLab/iclr2024-model-merging) stores each task's diagonal Fisher F_t as a
Hugging Face *model* folder (``<run>/hessian/``) whose weights are the per-parameter Fisher values,
averaged over batches, and merges per parameter with λ (all tasks), κ_t (per task), s (the
pretrained model's Fisher F_0) and δ:

    H̄ = λ Σ_t κ_t F_t + s F_0 + δ,    θ = θ_0 + λ Σ_t H̄⁻¹ (κ_t F_t + δ + s F_0)(θ_t − θ_0)

— Eq. 6 with α_t = λ, H_t = κ_t F_t and H_0 = δ + s F_0. :func:`convert_curvature` turns such a
folder (or a single state-dict file) into a gradmerge diagonal curvature scaled by S, so that
converted files with ``S = κ_t`` (tasks) and ``S = s`` (F_0), ``alpha: λ`` for every model and
``prior: {delta: δ, curvature: F_0 file}`` make ``gradmerge merge`` compute that formula.

Which tensors: those of floating dtype, except names holding ``position_ids`` or ``masked_bias``
(the buffers the official script leaves out); integer and bool buffers are left out too.

Example:
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> from gradmerge.io.official import convert_curvature
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_file({"w": torch.tensor([1.0, 0.5]), "pos.position_ids": torch.arange(2)},
    ...               f"{d}/model.safetensors")
    ...     C = convert_curvature(d, f"{d}.F.curvature.safetensors", scale=4.0)
    ...     print(C.values, C.meta["source.scale"])
    {'w': tensor([4., 2.])} 4.0

OUT may not be SRC, lie inside it or contain it (the output guard,
:mod:`gradmerge.foundation.guard`: it would replace the Fisher, or be read as part of it by the next
conversion: safetensors win over ``.bin``), and a gradmerge curvature file is refused
as SRC (it is converted already).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from gradmerge.curvature import Diagonal
from gradmerge.errors import ArgumentError, FileFormatError, MissingInputError, NonFiniteError
from gradmerge.foundation.guard import Input, Output, refuse_overlap
from gradmerge.io.reader import open_checkpoint

SKIPPED = ("position_ids", "masked_bias")
"""Name parts of the buffers the official script leaves out of its merge."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def convert_curvature(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    scale: float = 1.0,
    num_examples: int | None = None,
) -> Diagonal:
    """Write ``scale`` × the diagonal curvature stored at ``src`` to ``out``; return it.

    Args:
        src: a folder as the official script writes it (``model.safetensors``, sharded
            safetensors with an index, or ``pytorch_model.bin`` / its shards, read with
            ``torch.load(weights_only=True)``; a folder holding only a ``hessian/`` subfolder
            stands for that subfolder, as in the script), or one state-dict file
            (``.safetensors``, ``.bin``, ``.pt``) of per-parameter diagonal values.
        out: the gradmerge curvature file to write (atomically).
        scale: S, multiplying every value (κ_t for a task, s for the pretrained model's F_0).
        num_examples: recorded as the curvature's ``num_examples`` when given (the official
            values are means over batches: gradmerge's sums over N examples are N × those).

    Raises:
        ArgumentError: a scale that is not a positive finite number, num_examples below 1;
        OutputOverlapError: ``out`` is, lies inside or contains ``src`` (the output guard,
            :mod:`gradmerge.foundation.guard`).
        OutputWriteError: ``out`` could not be written (nothing is left of it).
        MissingInputError: no such file or folder, or a shard that the index names is missing.
        FileFormatError: no weights, an unreadable file, negative values, no float tensor; a
            gradmerge curvature file as (or inside) ``src``.
        NonFiniteError: NaN or ±Inf values, or values that overflow once scaled.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ArgumentError(f"scale must be a number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ArgumentError(f"scale must be a positive finite number, got {scale}")
    if num_examples is not None and num_examples < 1:
        raise ArgumentError(f"num_examples must be at least 1, got {num_examples}")
    refuse_overlap(Output("OUT", Path(out)), [Input("SRC", Path(src))])
    source = _resolve(Path(src))
    _refuse_converted(source)
    values: dict[str, Tensor] = {}
    for name, tensor in read_state_dict(source):
        if not tensor.is_floating_point() or any(part in name for part in SKIPPED):
            continue
        values[name] = _checked(name, tensor, scale, source)
    if not values:
        raise FileFormatError(
            f"{source} holds no floating-point tensors: expected per-parameter diagonal Fisher "
            "values, as the official code's hessian/ folder"
        )
    curvature = Diagonal(values)
    curvature.meta.update(
        {
            "fisher": "converted (official code's diagonal Fisher)",
            "source.converted_from": str(source.resolve()),
            "source.scale": repr(float(scale)),
        }
    )
    if num_examples is not None:
        curvature.meta["num_examples"] = str(num_examples)
    curvature.save(out)
    return curvature


def _refuse_converted(source: Path) -> None:
    """A gradmerge curvature file as SRC, or among SRC's files, is an error (module docstring)."""
    from safetensors import safe_open

    from gradmerge.curvature.io import FORMAT

    files = [source] if source.is_file() else sorted(source.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                meta = handle.metadata() or {}
        except Exception:  # not safetensors, or damaged: reading it reports that
            continue
        if meta.get("format") == FORMAT:
            inside = "" if file == source else f" {source} holds {file.name}, which is"
            raise FileFormatError(
                f"SRC{inside or f' {file} is'} a gradmerge curvature file ({FORMAT}, "
                f"{meta.get('structure', '?')}), not a Fisher of the official code: it is "
                "converted already, use it as `curvature:` in a merge YAML"
                + (f"; move it out of {source} to convert the folder" if inside else "")
            )


def _resolve(src: Path) -> Path:
    if not src.exists():
        raise MissingInputError(
            f"no curvature at {src}: expected the official code's hessian/ folder or a "
            "state-dict file (.safetensors, .bin, .pt)"
        )
    hessian = src / "hessian"
    if src.is_dir() and hessian.is_dir() and not any(_weight_files(src)):
        return hessian
    return src


def _weight_files(folder: Path) -> Iterator[Path]:
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth"):
        yield from folder.glob(pattern)


def read_state_dict(src: Path) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of a folder's or file's weights: safetensors through
    :func:`open_checkpoint`, pickle files only with ``torch.load(weights_only=True)``."""
    pickles = _pickle_files(src)
    if pickles is None:
        with open_checkpoint(src) as checkpoint:
            for name in checkpoint:
                yield name, checkpoint.get(name)
        return
    for file in pickles:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # unpickling refused (not weights only) or a damaged file
            raise FileFormatError(
                f"{file} cannot be read with torch.load(weights_only=True) ({err}); gradmerge "
                "never runs pickled code: save the Fisher as safetensors instead"
            ) from err
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()
        ):
            raise FileFormatError(
                f"{file} holds a {type(loaded).__name__}; expected a state dict of named tensors"
            )
        yield from loaded.items()


def _pickle_files(src: Path) -> list[Path] | None:
    """The pickle files to read, or None for safetensors (a folder with safetensors wins)."""
    if src.is_file():
        return [src] if src.suffix in PICKLE_SUFFIXES else None
    if any(src.glob("*.safetensors")):
        return None
    index = src / "pytorch_model.bin.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise FileFormatError(f"{index} is not a shard index ({err})") from err
        missing = [s for s in shards if not (src / s).is_file()]
        if missing:
            raise MissingInputError(f"{index} names shards that are missing: {missing}")
        return [src / s for s in shards]
    single = src / "pytorch_model.bin"
    return [single] if single.is_file() else None  # None: open_checkpoint explains what is missing


def _checked(name: str, tensor: Tensor, scale: float, source: Path) -> Tensor:
    values = tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        raise NonFiniteError(
            f"{source}: {name} holds {int(bad.sum())} NaN/Inf value(s); a Fisher is finite — "
            "re-estimate it"
        )
    negative = values < 0
    if bool(negative.any()):
        raise FileFormatError(
            f"{source}: {name} holds {int(negative.sum())} negative value(s) (smallest "
            f"{float(values.min()):.3g}); a diagonal Fisher is non-negative — is this a weight "
            "file rather than the hessian/ folder?"
        )
    scaled = values * scale
    if not bool(torch.isfinite(scaled).all()):
        raise NonFiniteError(
            f"{source}: {name} overflows {values.dtype} once scaled by {scale}; use a smaller "
            "scale (and a larger alpha)"
        )
    return scaled.contiguous()
