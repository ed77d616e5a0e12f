"""Where models and data come from: Hugging Face folders, tensor files and Python entry points.

The library side of ``gradmerge curvature MODEL DATA OUT`` (and of its data-parallel form under
``torchrun``): the command-line modules parse flags, this module turns the MODEL and DATA
arguments into an ``nn.Module`` and batches that :func:`gradmerge.estimate_curvature` accepts, and
records where they came from (:func:`provenance`).

The forms MODEL and DATA take are :data:`FORMS` (a string, shown by ``gradmerge curvature
--help`` also under ``python -OO``): a Hugging Face folder or an entry point for MODEL; text
(:mod:`gradmerge.io.text_data`), a tensor file (:class:`TensorBatches`) or an entry point for DATA.

This module is the one place the commands import MODEL and DATA from: it holds the forms
(:data:`FORMS`), the inputs a spec reads (:func:`spec_inputs`) and the provenance record, and
re-exports the loaders of its parts: :mod:`gradmerge.io.models` (MODEL),
:mod:`gradmerge.io.data` (DATA), :mod:`gradmerge.io.entry_points` (``module:function``) and
:mod:`gradmerge.io.lora` (an adapter's base).

Example:
    >>> import torch
    >>> from gradmerge.io.sources import TensorBatches
    >>> batches = TensorBatches({"inputs": torch.zeros(5, 2), "targets": torch.zeros(5)}, batch_size=2)
    >>> [x.shape[0] for x, _ in batches]
    [2, 2, 1]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradmerge._version import __version__
from gradmerge.errors import ArgumentError, FileFormatError
from gradmerge.foundation.guard import Input
from gradmerge.io.data import (
    LM_KEYS,
    MAX_ENTRY_POINT_EXAMPLES,
    TENSOR_SUFFIXES,
    TensorBatches,
    bounded,
    check_tokens,
    data_kind,
    load_data,
    read_tensors,
    warn_unshifted,
)
from gradmerge.io.entry_points import (
    call_entry_point,
    entry_point,
    parse_argument,
    split_entry_point,
)
from gradmerge.io.forms import FORMS as FORMS
from gradmerge.io.lora import adapter_base, base_fingerprint, is_adapter
from gradmerge.io.models import hugging_face_model, load_model, model_kind, tokenizer_folder

__all__ = [
    "FORMS",
    "LM_KEYS",
    "MAX_ENTRY_POINT_EXAMPLES",
    "TENSOR_SUFFIXES",
    "TensorBatches",
    "adapter_base",
    "base_fingerprint",
    "bounded",
    "call_entry_point",
    "check_tokens",
    "data_kind",
    "describe_source",
    "entry_point",
    "file_sha256",
    "hugging_face_model",
    "load_data",
    "load_model",
    "model_kind",
    "parse_argument",
    "provenance",
    "read_tensors",
    "spec_inputs",
    "tokenizer_folder",
    "warn_unshifted",
]


def spec_inputs(
    role: str, spec: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None
) -> list[Input]:
    """The files and folders that reading MODEL or DATA ``spec`` reads, for the output guard
    (:mod:`gradmerge.foundation.guard`): the path itself; for an entry point
    ``path/to/file.py:function`` its file (a dotted module is found by Python, not by a path); for a
    LoRA adapter folder also the base it applies to (``base`` when given, else the one its
    ``adapter_config.json`` names, :func:`adapter_base`; left out when that cannot be told, as
    loading refuses it then).

    Example:
        >>> [str(i.path) for i in spec_inputs("DATA", "scripts/data.py:batches")]
        ['scripts/data.py']
    """
    text = str(spec)
    if ":" in text and not Path(text).exists():  # an entry point
        module = text.rpartition(":")[0]
        if module.endswith(".py") or "/" in module or os.sep in module:
            return [Input(role, Path(module))]
        return []
    found = [Input(role, Path(text))]
    if is_adapter(text):
        # an adapter whose base cannot be told is refused by loading, which names the fix
        with contextlib.suppress(ArgumentError, FileFormatError):
            found.append(Input(f"the base of LoRA adapter {role}", adapter_base(Path(text), base)))
    return found


def provenance(
    model: str,
    data: str,
    *,
    device: torch.device,
    ignore_index: int,
    batch_size: int,
    shift_labels: bool,
    model_arguments: Mapping[str, Any] | None = None,
    data_arguments: Mapping[str, Any] | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    mc_samples: int | None = None,
    base: str | None = None,
) -> dict[str, str]:
    """What a curvature (or gradient) file's metadata records about how it was made
    (``source.*`` keys).

    ``model`` and ``data`` are the MODEL and DATA arguments; a tensor file's SHA-256 and how it
    was batched are recorded too, so that the estimate can be traced to its exact inputs;
    ``seed`` and ``mc_samples`` (Monte-Carlo Fishers) when given. For a LoRA adapter MODEL, the
    base model it was applied to (:func:`adapter_base`, ``base`` if given) and a fingerprint of
    that base's weights (:func:`base_fingerprint`).
    """
    data_kind_ = data_kind(data)
    meta = {
        "source.model": describe_source(model, model_kind(model)),
        "source.data": describe_source(data, data_kind_),
        "source.ignore_index": str(ignore_index),
        "source.device": str(device),
        "source.gradmerge": __version__,
        "source.torch": torch.__version__,
    }
    for key, value in (("seed", seed), ("mc_samples", mc_samples)):
        if value is not None:
            meta[f"source.{key}"] = str(value)
    for key, arguments in (("model", model_arguments), ("data", data_arguments)):
        if arguments:
            meta[f"source.{key}_arguments"] = json.dumps(dict(arguments), sort_keys=True)
    if is_adapter(model) and model_kind(model) == "hugging face folder":
        resolved = adapter_base(Path(model), base)
        meta["source.adapter_base"] = str(resolved.resolve())
        meta["source.adapter_base_weights_sample_sha256"] = base_fingerprint(resolved)
    if data_kind_ in ("tensor file", "text file"):
        meta["source.data_sha256"] = file_sha256(Path(data))
    if data_kind_ != "entry point":
        meta["source.batch_size"] = str(batch_size)
    if max_examples is not None:
        meta["source.max_examples"] = str(max_examples)
    if data_kind_ == "tensor file":
        meta["source.shift_labels"] = str(bool(shift_labels))
    return meta


def describe_source(spec: str, kind: str) -> str:
    """``spec`` with its file or folder made absolute (a module entry point stays as given)."""
    if kind == "entry point":
        module, attr = split_entry_point(spec)
        if module.endswith(".py") or "/" in module:
            return f"{Path(module).resolve()}:{attr}"
        return spec
    return str(Path(spec).resolve())


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
