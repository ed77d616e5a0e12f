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
other PEFT methods.

Two readers: :class:`LoraCheckpoint` shows an adapter over its base checkpoint as the fine-tuned
checkpoint, materialising a tensor when the streaming merge asks for it, so that ``gradmerge
merge`` and ``gradmerge remove`` take adapter folders wherever they take a model
(:func:`open_model`); :func:`merged_state_dict` applies an adapter to a loaded model's state
dict (``gradmerge curvature``).

Example:
    >>> import torch
    >>> update = LoraUpdate(torch.ones(1, 3), torch.ones(2, 1), scale=2.0, transpose=False)
    >>> update.delta(torch.float32)
    tensor([[2., 2., 2.],
            [2., 2., 2.]])
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> from safetensors.torch import save_file
    >>> from gradmerge.io import open_checkpoint
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_file({"fc.weight": torch.zeros(2, 3)}, f"{d}/base.safetensors")
    ...     (Path(d) / "ad").mkdir()
    ...     _ = (Path(d) / "ad/adapter_config.json").write_text(json.dumps(
    ...         {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["fc"]}))
    ...     save_file({"base_model.model.fc.lora_A.weight": torch.ones(1, 3),
    ...                "base_model.model.fc.lora_B.weight": torch.ones(2, 1)},
    ...               f"{d}/ad/adapter_model.safetensors")
    ...     with open_checkpoint(f"{d}/base.safetensors") as base:
    ...         print(LoraCheckpoint(Path(d) / "ad", base).get("fc.weight"))
    tensor([[2., 2., 2.],
            [2., 2., 2.]])
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradmerge.curvature.provenance import sample_hash_from
from gradmerge.errors import AdapterBaseError, ArgumentError, FileFormatError, StructureError
from gradmerge.foundation.text import key_list
from gradmerge.io.reader import Checkpoint, open_checkpoint

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


def changed_tensors(folder: Path) -> frozenset[str]:
    """The names (the base's state-dict names) of the tensors the adapter in ``folder`` changes:
    the weight of every LoRA target and every tensor of ``modules_to_save``. Every other tensor
    of θ_t = θ_0 + s·B·A is the base's, so its task vector θ_t − θ_0 is exactly zero.

    Raises:
        FileFormatError, StructureError: as :func:`read_adapter`.
    """
    updates, saved = read_adapter(folder)
    return frozenset(updates) | frozenset(saved)


def adapted_parameters(folder: Path, names: Iterable[str]) -> list[str]:
    """The parameters (among ``names``, a model's ``named_parameters`` names) whose curvature an
    adapter's merge needs: every parameter of a LoRA target module — its weight, which the adapter
    changes, and its bias, which it does not but which K-FAC couples with the weight in one
    layer ([W | b] ⊗, the bias as the last input column) — and every tensor of
    ``modules_to_save``. What ``gradmerge curvature`` estimates for an adapter MODEL (unless
    ``--whole-model``): every other parameter has a zero task vector and no coupling to these, so
    no curvature there can change a merge (the merge copies the base there).

    Example:
        >>> import json, tempfile, torch
        >>> from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / CONFIG).write_text(json.dumps(
        ...         {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["fc"]}))
        ...     save_file({"base_model.model.fc.lora_A.weight": torch.ones(1, 3),
        ...                "base_model.model.fc.lora_B.weight": torch.ones(2, 1),
        ...                "base_model.model.head.weight": torch.ones(2, 2)},
        ...               f"{d}/adapter_model.safetensors")
        ...     adapted_parameters(Path(d), ["emb.weight", "fc.weight", "fc.bias", "head.weight"])
        ['fc.weight', 'fc.bias', 'head.weight']

    Raises:
        FileFormatError, StructureError: as :func:`read_adapter`.
        StructureError: a changed tensor that is not among ``names`` (the adapter was trained on
            another model, or changes a buffer).
    """
    updates, saved = read_adapter(folder)
    names = list(names)
    known = set(names)
    missing = sorted(k for k in [*updates, *saved] if k not in known)
    if missing:
        raise StructureError(
            f"{folder}: the adapter changes {key_list(missing, limit=3)}, which the model has no "
            "parameter of: the adapter was trained on another model"
        )
    modules = {k.rpartition(".")[0] for k in updates}
    return [n for n in names if n in saved or n.rpartition(".")[0] in modules]


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


class LoraCheckpoint(Checkpoint):
    """An adapter folder over its base checkpoint, read as the full fine-tuned checkpoint θ_t.

    A :class:`Checkpoint` for every reader of one (plan, engine, record); it opens no file of
    its own beyond the adapter's weights, so it does not run ``Checkpoint.__init__``.

    Every name, shape and dtype is the base's; :meth:`get` returns W_0 + s·B·A for a LoRA
    target, the adapter's tensor for ``modules_to_save``, the base's otherwise.

    Raises:
        StructureError: an update or saved tensor whose name or shape the base does not have.
    """

    def __init__(self, folder: Path, base: Checkpoint) -> None:
        self.path = self.folder = Path(folder)
        self.base = base
        self.updates, self.saved = read_adapter(self.path)
        for key, update in self.updates.items():
            shape = (update.b.shape[0], update.a.shape[1])
            shape = shape[::-1] if update.transpose else shape
            self._check(key, shape, "a LoRA target")
        for key, value in self.saved.items():
            self._check(key, tuple(value.shape), "a saved module's tensor")
        files = sorted(p for p in self.path.iterdir() if p.name.startswith("adapter_model"))
        self.files = (*files, *base.files)
        digest = hashlib.sha256(base.fingerprint.encode())
        for file in files:
            digest.update(file.read_bytes())
        self.fingerprint = digest.hexdigest()
        """SHA-256 of the base's fingerprint and the adapter's bytes."""
        self.bytes_read = 0
        self.changed = frozenset(self.updates) | frozenset(self.saved)
        """The tensors θ_t changes (:func:`changed_tensors`); every other one is the base's."""

    def _check(self, key: str, shape: tuple[int, ...], what: str) -> None:
        if key not in self.base:
            raise StructureError(
                f"{self.path}: {what} {key!r} is not in the base model {self.base.path}: the "
                "adapter was trained on another model"
            )
        if tuple(self.base.shape(key)) != tuple(shape):
            raise StructureError(
                f"{self.path}: {what} {key!r} has shape {tuple(shape)}, the base's is "
                f"{tuple(self.base.shape(key))}"
            )

    def __repr__(self) -> str:
        return f"LoraCheckpoint({str(self.path)!r} over {self.base!r})"

    def close(self) -> None:
        """Nothing to close of its own (the base is closed by whoever opened it)."""

    def __contains__(self, key: object) -> bool:
        return key in self.base

    def __len__(self) -> int:
        return len(self.base)

    def keys(self) -> list[str]:
        """The base's tensor names."""
        return self.base.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        """The base's shape of ``key``."""
        return self.base.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        """The base's dtype of ``key``."""
        return self.base.dtype(key)

    def nbytes(self, key: str) -> int:
        """The base's stored size of ``key``."""
        return self.base.nbytes(key)

    def file_of(self, key: str) -> Path:
        """The adapter's weights file for a LoRA or saved tensor, else the base's file."""
        return self.files[0] if key in self.updates or key in self.saved else self.base.file_of(key)

    @property
    def metadata(self) -> dict[str, str]:
        """The base's metadata."""
        return self.base.metadata

    @property
    def total_bytes(self) -> int:
        """The base's size: θ_t has the base's tensors."""
        return self.base.total_bytes

    def assets(self) -> list[Path]:
        """The base's config and tokenizer files."""
        return self.base.assets()

    def get(
        self,
        key: str,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        rows: slice | None = None,
    ) -> Tensor:
        """θ_t's tensor ``key`` (module docstring; ``rows`` of it, formed whole first), moved
        and cast when asked."""
        if key in self.saved:
            tensor = self.saved[key].to(self.base.dtype(key))
        elif key in self.updates:
            weight = self.base.get(key)
            tensor = weight + self.updates[key].delta(weight.dtype)
        else:
            tensor = self.base.get(key)
        if rows is not None:
            tensor = tensor[rows]
        self.bytes_read += tensor.numel() * tensor.element_size()
        if device is not None or dtype is not None:
            tensor = tensor.to(device=device, dtype=dtype)
        return tensor

    def prefetch(self, key: str, rows: slice | None = None) -> None:
        """Read ahead the base's tensor ``key`` (θ_t's is formed from it)."""
        self.base.prefetch(key, rows)

    def rows(self, key: str, indices: list[int]) -> Tensor:
        """Rows ``indices`` of θ_t's tensor ``key`` (the whole value when ``indices`` is empty)."""
        tensor = self.get(key)
        return tensor if not indices else tensor[indices]


def open_model(
    path: str | Path, base: Checkpoint, adapter_base: str | Path | None = None
) -> Checkpoint:
    """A fine-tuned model: an adapter folder over ``base``, or a checkpoint (file or folder).

    An adapter's own base (``adapter_base`` when given, else its ``base_model_name_or_path``
    resolved as :func:`adapter_base` does) must hold ``base``'s weights
    (:func:`check_adapter_base`).
    """
    if is_adapter(path):
        check_adapter_base(Path(path), base, adapter_base)
        return LoraCheckpoint(Path(path), base)
    if adapter_base is not None:
        raise ArgumentError(f"{path} is not a LoRA adapter; `adapter_base` applies to one")
    return open_checkpoint(path)


def check_adapter_base(
    folder: Path, base: Checkpoint, adapter_base: str | Path | None = None
) -> None:
    """Refuse an adapter whose own base is another model than the merge's ``base``.

    Its own base (:func:`adapter_base`) is the same path as ``base``, or a
    checkpoint of the same weights (the same :func:`gradmerge.curvature.provenance.sample_hash`). A
    base named by a hub name only (not a local path) cannot be checked and is taken to be
    ``base``; an ambiguous relative name is refused as in ``gradmerge curvature``.

    Raises:
        AdapterBaseError: an ambiguous relative ``base_model_name_or_path``.
        StructureError: an own base whose weights differ from ``base``'s.
    """
    try:
        own = _adapter_base(folder, adapter_base)
    except ArgumentError as err:
        if adapter_base is not None or isinstance(err, AdapterBaseError):
            raise
        return  # a hub name: nothing local to compare with
    if own.resolve() == Path(base.path).resolve():
        return
    keys = [k for k in base if base.dtype(k).is_floating_point]
    if base_fingerprint(own) != sample_hash_from(keys, base.shape, base.rows):
        raise StructureError(
            f"{folder} is a LoRA adapter over {own}, whose weights differ from base_model "
            f"{base.path}: applied to base_model it would give another model than the one "
            "trained. Use the adapter's own base as base_model, or name the right base with "
            "`adapter_base:` if its recorded base_model_name_or_path is wrong"
        )


def adapter_base(folder: Path, base: str | os.PathLike[str] | None = None) -> Path:
    """The base model of a PEFT adapter folder: ``base`` when given (``--adapter-base``, a YAML
    ``adapter_base:``), else its config's ``base_model_name_or_path``.

    An absolute ``base_model_name_or_path`` is taken as it is. A relative one (peft records the
    name the base was loaded by, e.g. ``base``) is read relative to the folder that holds the
    adapter folder; it is refused when it also names another existing path relative to the
    current directory, or names one only there: which model the adapter was trained on cannot
    be told then, and a wrong base gives a silently wrong model.

    Example:
        >>> import json, tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     (Path(d) / "base").mkdir(); (Path(d) / "ad").mkdir()
        ...     _ = (Path(d) / "ad/adapter_config.json").write_text(
        ...         json.dumps({"base_model_name_or_path": "base"}))
        ...     adapter_base(Path(d) / "ad") == Path(d) / "base"
        True

    Raises:
        AdapterBaseError: a relative base that exists relative to the current directory and is
            not the one beside the adapter (or is not there at all).
        ArgumentError: no such local path (a hub name: gradmerge loads offline); a given
            ``base`` that does not exist.
        FileFormatError: an unreadable ``adapter_config.json``.
    """
    if base is not None:
        if not Path(base).exists():
            raise ArgumentError(f"the adapter base {base} of {folder} does not exist")
        return Path(base)
    try:
        named = json.loads((folder / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise FileFormatError(f"{folder}/adapter_config.json is not readable JSON ({err})") from err
    fix = (
        "name the base model with --adapter-base FOLDER (gradmerge curvature/gradient) or "
        "`adapter_base:` beside the adapter's `model:` in a merge or remove YAML"
    )
    if named and Path(str(named)).is_absolute() and Path(str(named)).exists():
        return Path(str(named))
    if named and not Path(str(named)).is_absolute():
        beside, here = folder.parent / str(named), Path.cwd() / str(named)
        same = beside.exists() and here.exists() and beside.resolve() == here.resolve()
        if here.exists() and not same:
            where = f"{beside} beside the adapter" if beside.exists() else "nothing beside it"
            raise AdapterBaseError(
                f"MODEL {folder} is a LoRA adapter over the relative base_model_name_or_path "
                f"{named!r}, which names {here.resolve()} relative to the current directory and "
                f"{where}: which model it was trained on cannot be told; {fix}"
            )
        if beside.exists():
            return beside
    raise ArgumentError(
        f"MODEL {folder} is a LoRA adapter over {named!r}, which is not a local model folder "
        f"(a relative name is read relative to {folder.parent}); {fix}, or set "
        "base_model_name_or_path in its adapter_config.json"
    )


_adapter_base = adapter_base
""":func:`adapter_base` under a name that ``check_adapter_base``'s argument does not shadow."""


def base_fingerprint(path: Path) -> str:
    """:func:`gradmerge.curvature.provenance.sample_hash` of the floating-point weights of a model
    folder or checkpoint file (a few rows per tensor are read): which base an adapter was
    applied to, recorded in a curvature's metadata."""
    with open_checkpoint(path) as checkpoint:
        keys = [k for k in checkpoint if checkpoint.dtype(k).is_floating_point]
        return sample_hash_from(keys, checkpoint.shape, checkpoint.rows)
