r"""LoRA adapters (PEFT folders) as fine-tuned weights: θ_t = θ_0 + (α/r)·B·A.

A PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) fine-tunes a base
model θ_0 by low-rank updates: for every target module with LoRA factors A (r × in) and B (out ×
r), its weight becomes

    W_t = W_0 + s·B·A        (s = lora_alpha / r, or lora_alpha / √r with ``use_rslora``)

transposed for ``fan_in_fan_out`` layers (GPT-2's Conv1D stores W as in × out); the rank r of a
module is that of its factors (so ``rank_pattern`` is honoured). Tensors of ``modules_to_save``
(e.g. a classification head) replace the base's. What this does not express is refused with an
error naming the setting: DoRA (``use_dora``), trained biases (``bias`` other than "none",
``lora_bias``), per-module alphas (``alpha_pattern``), LoRA on embeddings or convolutions, and
other PEFT methods. :mod:`gradmerge.io.lora_models` reads an adapter over a checkpoint tensor by
tensor (merges, removals); :func:`merged_state_dict` applies it to a loaded model's state dict
(``gradmerge curvature``).

Example:
    >>> import torch
    >>> update = LoraUpdate(torch.ones(1, 3), torch.ones(2, 1), scale=2.0, transpose=False)
    >>> update.delta(torch.float32)
    tensor([[2., 2., 2.],
            [2., 2., 2.]])
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradmerge._text import key_list
from gradmerge.errors import FileFormatError, StructureError

CONFIG = "adapter_config.json"
PREFIX = "base_model.model."


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder (it holds ``adapter_config.json``)."""
    return (Path(path) / CONFIG).is_file()


@dataclass(frozen=True)
class LoraUpdate:
    """The low-rank update of one weight: ``scale · B @ A`` (transposed with ``transpose``)."""

    a: Tensor
    b: Tensor
    scale: float
    transpose: bool

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it updates: (out, in), or (in, out) with ``transpose``."""
        shape = (int(self.b.shape[0]), int(self.a.shape[1]))
        return shape[::-1] if self.transpose else shape

    def delta(self, dtype: torch.dtype) -> Tensor:
        """s·B·A in ``dtype`` (at least float32 for the product)."""
        wide = torch.promote_types(dtype, torch.float32)
        d = (self.b.to(wide) @ self.a.to(wide)) * self.scale
        return (d.T if self.transpose else d).to(dtype)


def read_adapter(folder: Path) -> tuple[dict[str, LoraUpdate], dict[str, Tensor]]:
    """The updates (by the base weight's name) and the replaced tensors (``modules_to_save``) of
    an adapter folder.

    Raises:
        FileFormatError: an unreadable config or weights file, LoRA factors without their pair or
            of mismatched rank.
        StructureError: a setting this does not express (module docstring), naming it.
    """
    config = _config(folder)
    tensors = _weights(folder)
    updates: dict[str, dict[str, Tensor]] = {}
    saved: dict[str, Tensor] = {}
    for key, value in tensors.items():
        name = key.removeprefix(PREFIX)
        if "lora_embedding_" in name or "lora_magnitude_vector" in name:
            raise StructureError(
                f"{folder}: {key!r} is a LoRA {'embedding' if 'embedding' in name else 'DoRA'} "
                "tensor; gradmerge materialises LoRA on Linear/Conv1D weights only: merge the "
                "adapter with peft's merge_and_unload() and save the full model instead"
            )
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if name.endswith(marker):
                updates.setdefault(name[: -len(marker)], {})[part] = value
                break
        else:
            saved[name] = value  # modules_to_save (or a head): replaces the base's tensor
    scale_of = _scales(config, folder)
    _check_targets(config, sorted(updates), folder)
    out = {}
    for module, pair in updates.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise FileFormatError(f"{folder}: {module!r} has {sorted(pair)} but not both factors")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise StructureError(
                f"{folder}: {module!r} has LoRA factors A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; expected 2-d A (r × in) and B (out × r) of one rank r "
                "(convolution LoRA is not supported: merge it with peft's merge_and_unload())"
            )
        if int(a.shape[0]) != _rank(config, module):
            raise StructureError(
                f"{folder}: {module!r} has LoRA factors of rank {a.shape[0]}, but "
                f"{CONFIG} gives it r = {_rank(config, module)} (r or rank_pattern): the "
                "scale lora_alpha / r would be wrong; the config is not this adapter's (peft "
                "refuses it too)"
            )
        out[f"{module}.weight"] = LoraUpdate(
            a, b, scale_of(int(a.shape[0])), bool(config.get("fan_in_fan_out"))
        )
    return out, saved


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise FileFormatError(f"{folder / CONFIG} is not readable JSON ({err})") from err
    if not isinstance(config, dict):
        raise FileFormatError(f"{folder / CONFIG} holds a {type(config).__name__}, not an object")
    refused = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r}"),
        (bool(config.get("use_dora")), "use_dora: true (DoRA)"),
        (config.get("bias", "none") != "none", f"bias: {config.get('bias')!r} (trained biases)"),
        (bool(config.get("lora_bias")), "lora_bias: true"),
        (bool(config.get("alpha_pattern")), "alpha_pattern (per-module alphas)"),
        (bool(config.get("layer_replication")), "layer_replication"),
        (bool(config.get("target_parameters")), "target_parameters"),
        (bool(config.get("trainable_token_indices")), "trainable_token_indices"),
    ]
    for bad, what in refused:
        if bad:
            raise StructureError(
                f"{folder / CONFIG}: {what} is not supported; gradmerge materialises plain LoRA "
                "(W + (lora_alpha/r)·B·A). Merge the adapter with peft's merge_and_unload() and "
                "save the full model instead"
            )
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise FileFormatError(
                f"{folder / CONFIG}: `{key}` must be a positive number, got {value!r} (finite, above 0)"
            )
    return config


def _rank(config: Mapping[str, Any], module: str) -> int:
    """The rank the config gives ``module``: ``r``, or a ``rank_pattern`` entry that matches
    its name (peft's rule: the pattern matches the name's end, after a dot)."""
    rank = config["r"]
    for pattern, value in (config.get("rank_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            rank = value
    return int(rank)


def _check_targets(config: Mapping[str, Any], modules: list[str], folder: Path) -> None:
    """Every ``target_modules`` name must have LoRA factors in the weights (peft matches a name
    to a module's last parts; a string is a regular expression over the whole name)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear" and not any(re.fullmatch(targets, m) for m in modules):
            raise StructureError(
                f"{folder / CONFIG}: target_modules {targets!r} matches none of the adapter's "
                f"LoRA modules ({key_list(modules, limit=4)}): the config and the weights do not "
                "belong together"
            )
        return
    missing = [t for t in targets or () if not any(m == t or m.endswith(f".{t}") for m in modules)]
    if missing:
        raise StructureError(
            f"{folder / CONFIG}: target_modules {key_list(missing, limit=4)} have no LoRA "
            f"factors in the adapter's weights (modules with factors: "
            f"{key_list(modules, limit=4)}): the weights file is incomplete, or the config is "
            "not this adapter's"
        )


def _scales(config: Mapping[str, Any], folder: Path) -> Any:
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora"))

    def scale(rank: int) -> float:
        return alpha / math.sqrt(rank) if rslora else alpha / rank

    return scale


def _weights(folder: Path) -> dict[str, Tensor]:
    safe, pickle = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if safe.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(safe))
        except Exception as err:  # safetensors' own errors on damaged files
            raise FileFormatError(f"{safe} is not a readable safetensors file ({err})") from err
    if pickle.is_file():
        try:
            loaded = torch.load(pickle, map_location="cpu", weights_only=True)
        except Exception as err:  # refused unpickling or a damaged file
            raise FileFormatError(
                f"{pickle} cannot be read with torch.load(weights_only=True) ({err})"
            ) from err
        if isinstance(loaded, dict) and all(isinstance(v, Tensor) for v in loaded.values()):
            return dict(loaded)
        raise FileFormatError(f"{pickle} holds a {type(loaded).__name__}, not a state dict")
    raise FileFormatError(
        f"{folder} holds {CONFIG} but no adapter_model.safetensors (or adapter_model.bin)"
    )


def merged_state_dict(folder: Path, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (the base model's tensors) with the adapter in ``folder`` applied: what
    ``gradmerge curvature`` loads into the base model for an adapter MODEL.

    Raises:
        StructureError: an update or saved tensor whose name or shape the base does not have.
    """
    updates, saved = read_adapter(folder)
    out = dict(state)
    for key in [*updates, *saved]:
        if key not in out:
            raise StructureError(f"{folder}: {key!r} is not a tensor of the base model")
    shapes = {k: u.shape for k, u in updates.items()}
    shapes.update({k: tuple(v.shape) for k, v in saved.items()})
    for key, shape in shapes.items():
        if tuple(out[key].shape) != tuple(shape):
            what = "a LoRA target" if key in updates else "a saved module's tensor"
            raise StructureError(
                f"{folder}: {what} {key!r} has shape {tuple(shape)}, the base's is "
                f"{tuple(out[key].shape)}: the adapter was trained on another model"
            )
    for key, update in updates.items():
        out[key] = out[key] + update.delta(out[key].dtype)
    for key, value in saved.items():
        out[key] = value.to(out[key].dtype)
    return out
