"""MODEL of the commands: a Hugging Face folder (a LoRA adapter's included) or an entry point.

:func:`load_model` turns the MODEL argument into an ``nn.Module`` (the forms are listed in
:data:`gradmerge.io.sources.FORMS`); a Hugging Face folder is built offline by the class its config
names, and every parameter must come from its weights (:func:`hugging_face_model`); a PEFT LoRA
folder is its base with the adapter applied (:mod:`gradmerge.io.lora`).

Example:
    >>> model_kind("scripts/model.py:build")
    'entry point'
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from gradmerge.errors import ArgumentError, FileFormatError
from gradmerge.foundation.extras import require
from gradmerge.foundation.text import key_list
from gradmerge.io.entry_points import call_entry_point, split_entry_point
from gradmerge.io.lora import adapter_base, is_adapter, merged_state_dict
from gradmerge.io.text_data import TOKENIZER_FILES


def model_kind(spec: str) -> str:
    """``"hugging face folder"`` or ``"entry point"``; :class:`ArgumentError` for anything else."""
    if Path(spec).is_dir():
        return "hugging face folder"
    if ":" in spec:
        split_entry_point(spec)
        return "entry point"
    raise ArgumentError(
        f"MODEL {spec!r} is neither a folder nor an entry point: expected a Hugging Face model "
        "folder (with config.json) or module:function / path/to/file.py:function"
    )


def load_model(
    spec: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    allow_new_weights: bool = False,
    base: str | None = None,
) -> nn.Module:
    """The ``nn.Module`` MODEL names: a Hugging Face folder or an entry point (module docstring),
    the latter called with the keyword ``arguments`` (``--model-arg``).

    ``allow_new_weights``: let a folder's model have parameters its weights files lack (randomly
    initialised: an intentionally new head) or hold tensors it does not use
    (``--allow-new-weights``); see :func:`hugging_face_model`. ``base``: the base model
    folder of a LoRA adapter MODEL (``--adapter-base``; default: :func:`adapter_base`).

    Raises:
        ArgumentError: neither a folder nor ``module:function``; an entry point that cannot be
            imported, does not take ``arguments`` or does not return an ``nn.Module``; arguments
            for a folder.
        FileFormatError: a folder without a usable ``config.json`` or safetensors weights, or
            with weights that do not fit its model.
    """
    if model_kind(spec) == "hugging face folder":
        if arguments:
            raise ArgumentError(f"MODEL {spec} is a folder; arguments apply to entry points")
        if base is not None and not is_adapter(spec):
            raise ArgumentError(
                f"MODEL {spec} is not a LoRA adapter; --adapter-base applies to one"
            )
        if is_adapter(spec):  # a PEFT LoRA folder: its base with the adapter applied
            model = hugging_face_model(
                adapter_base(Path(spec), base), allow_new_weights=allow_new_weights
            )
            model.load_state_dict(merged_state_dict(Path(spec), model.state_dict()))
            return model
        return hugging_face_model(Path(spec), allow_new_weights=allow_new_weights)
    model = call_entry_point(spec, "MODEL", arguments)
    if not isinstance(model, nn.Module):
        raise ArgumentError(
            f"MODEL entry point {spec} returned {type(model).__name__}; expected a torch.nn.Module"
        )
    return model


def tokenizer_folder(spec: str, base: str | None = None) -> str:
    """Where text DATA's tokenizer is: MODEL's folder, or an adapter's base folder
    (:func:`adapter_base`, ``base`` if given) when the adapter folder holds no tokenizer files."""
    folder = Path(spec)
    if is_adapter(spec) and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return str(adapter_base(folder, base))
    return spec


def hugging_face_model(folder: Path, *, allow_new_weights: bool = False) -> nn.Module:
    """The model of a Hugging Face folder, built offline by the class its config names.

    Every parameter must come from the folder's weights and every stored tensor must be used
    (transformers' loading report): a model with randomly initialised parts would give a
    curvature of a random model, different at every run. ``allow_new_weights`` accepts them (a
    new head, on purpose) and names them on stderr.

    Raises:
        FileFormatError: no ``config.json``, no class, no safetensors weights; weights missing,
            unexpected or of another shape (named, with the fix).
        MissingExtraError: transformers is not installed (``pip install '.[hf]'`` in a clone).
    """
    require("hf", f"the Hugging Face model folder {folder}")
    import transformers

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileFormatError(
            f"{folder} has no config.json: expected a Hugging Face model folder "
            "(model.save_pretrained(folder)) or a module:function entry point"
        )
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as err:
        raise FileFormatError(f"{config_file} is not a JSON object ({err})") from err
    if not architectures:
        raise FileFormatError(
            f"{config_file} names no 'architectures': add the model class, e.g. "
            '"architectures": ["GPT2LMHeadModel"], or give a module:function entry point'
        )
    cls = getattr(transformers, architectures[0], None)
    if cls is None:
        raise FileFormatError(
            f"{config_file}: transformers {transformers.__version__} has no class "
            f"{architectures[0]!r}; load it yourself in a module:function entry point"
        )
    weights = [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]
    if not weights:
        raise FileFormatError(
            f"{folder} holds no safetensors weights (model.safetensors or shards with an index); "
            "save with model.save_pretrained(folder) (safetensors is its default)"
        )
    model, info = cls.from_pretrained(
        folder, local_files_only=True, use_safetensors=True, output_loading_info=True
    )
    if not isinstance(model, nn.Module):  # pragma: no cover - transformers models are modules
        raise FileFormatError(f"{folder}: {architectures[0]} is not a torch model")
    _check_loading(folder, architectures[0], info, allow_new_weights)
    return model


def _check_loading(folder: Path, name: str, info: Mapping[str, Any], allow: bool) -> None:
    """Refuse (or, with ``allow``, report) what transformers' loading report lists."""
    parts = []
    for key, what in (
        ("missing_keys", "missing from the weights (they would be initialised randomly)"),
        ("unexpected_keys", "stored but not used by the model"),
        ("mismatched_keys", "stored with another shape (they would be initialised randomly)"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            parts.append(f"{len(names)} tensor(s) {what}: {key_list(names)}")
    if not parts:
        return
    text = f"MODEL {folder} ({name}): " + "; ".join(parts)
    if allow:
        print(f"warning: {text} (accepted: --allow-new-weights)", file=sys.stderr)
        return
    raise FileFormatError(
        f"{text}. The weights files do not fit the config's model: save the complete model "
        "with model.save_pretrained(folder), or pass --allow-new-weights if a new head is meant "
        "to start from random values"
    )
