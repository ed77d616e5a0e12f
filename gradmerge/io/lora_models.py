r"""LoRA adapter folders read as full checkpoints θ_t = θ_0 + (α/r)·B·A, one tensor at a time.

:class:`LoraCheckpoint` shows an adapter over its base as the fine-tuned checkpoint, materialising
a tensor when the streaming merge asks for it (the LoRA rules: :mod:`gradmerge.io.lora`), so that
``gradmerge merge`` and ``gradmerge remove`` take adapter folders wherever they take a model
(:func:`open_model`).

Example:
    >>> import json, tempfile, torch
    >>> from pathlib import Path
    >>> from safetensors.torch import save_file
    >>> from gradmerge.io import open_checkpoint
    >>> from gradmerge.io.lora_models import LoraCheckpoint
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
from pathlib import Path

import torch
from torch import Tensor

from gradmerge._weight_sample import sample_hash_from
from gradmerge.errors import ArgumentError, StructureError
from gradmerge.io.lora import is_adapter, read_adapter
from gradmerge.io.reader import Checkpoint, open_checkpoint


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
    ) -> Tensor:
        """θ_t's tensor ``key`` (module docstring), moved and cast when asked."""
        if key in self.saved:
            tensor = self.saved[key].to(self.base.dtype(key))
        elif key in self.updates:
            weight = self.base.get(key)
            tensor = weight + self.updates[key].delta(weight.dtype)
        else:
            tensor = self.base.get(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        if device is not None or dtype is not None:
            tensor = tensor.to(device=device, dtype=dtype)
        return tensor

    def rows(self, key: str, indices: list[int]) -> Tensor:
        """Rows ``indices`` of θ_t's tensor ``key`` (the whole value when ``indices`` is empty)."""
        tensor = self.get(key)
        return tensor if not indices else tensor[indices]


def open_model(
    path: str | Path, base: Checkpoint, adapter_base: str | Path | None = None
) -> Checkpoint:
    """A fine-tuned model: an adapter folder over ``base``, or a checkpoint (file or folder).

    An adapter's own base (``adapter_base`` when given, else its ``base_model_name_or_path``
    resolved as :func:`gradmerge.io.sources.adapter_base` does) must hold ``base``'s weights
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

    Its own base (:func:`gradmerge.io.sources.adapter_base`) is the same path as ``base``, or a
    checkpoint of the same weights (the same :func:`gradmerge._weight_sample.sample_hash`). A
    base named by a hub name only (not a local path) cannot be checked and is taken to be
    ``base``; an ambiguous relative name is refused as in ``gradmerge curvature``.

    Raises:
        AdapterBaseError: an ambiguous relative ``base_model_name_or_path``.
        StructureError: an own base whose weights differ from ``base``'s.
    """
    from gradmerge.errors import AdapterBaseError
    from gradmerge.io.sources import adapter_base as resolve
    from gradmerge.io.sources import base_fingerprint

    try:
        own = resolve(folder, adapter_base)
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
