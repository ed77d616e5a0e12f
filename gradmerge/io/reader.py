"""Lazy, tensor-by-tensor reading of checkpoints: a safetensors file, a shard folder, a HF folder.

``open_checkpoint(path)`` reads only the files' headers (names, dtypes, shapes, offsets); ``get``
reads one tensor, memory-mapped by safetensors (the pages count in the page cache, not in the
process's anonymous memory), converted only if a device or dtype is asked for.

Folder resolution, in order: a ``*.safetensors.index.json`` (the Hugging Face shard index;
``model.safetensors.index.json`` if there are several), ``model.safetensors``, the only
``*.safetensors`` file. PyTorch ``.bin`` weights are refused with the command that converts them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from gradmerge.errors import FileFormatError, MissingInputError, StructureError
from gradmerge.foundation.readahead import Readahead, row_range

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names → torch dtypes."""

ASSET_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
    "preprocessor_config.json",
)
"""Files of a Hugging Face folder that a merged model keeps from its base (config, tokenizer)."""

_MAX_HEADER = 100_000_000  # bytes; safetensors' own limit


class Checkpoint:
    """A checkpoint opened lazily. Build it with :func:`open_checkpoint`.

    Attributes:
        path: what was opened (file or folder).
        folder: the folder, when ``path`` is one (its config/tokenizer files: ``assets()``).
        files: the safetensors files, in shard order.
        bytes_read: bytes of tensor data handed out by ``get`` so far.

    Tensors returned by ``get`` without a conversion are views of the memory-mapped file: read
    them, do not modify them in place.
    """

    def __init__(self, path: Path, files: list[Path], folder: Path | None) -> None:
        from safetensors import safe_open

        self.path, self.folder, self.files = path, folder, tuple(files)
        self.bytes_read = 0
        self._entries: dict[str, tuple[int, str, tuple[int, ...], int]] = {}
        self._order: list[tuple[int, int, str]] = []
        self._starts: dict[str, int] = {}  # where each tensor's bytes begin in its file
        digest = hashlib.sha256()
        self._metadata: dict[str, str] = {}
        self._handles = []
        for index, file in enumerate(self.files):
            raw, header = _read_header(file)
            digest.update(raw)
            self._metadata.update(header.pop("__metadata__", None) or {})
            for name, entry in header.items():
                if name in self._entries:
                    raise FileFormatError(
                        f"{name!r} is stored twice in {path}: in {self.files[self._entries[name][0]]} "
                        f"and {file}; a checkpoint holds each tensor once"
                    )
                dtype, shape, (begin, end) = _entry(file, name, entry)
                self._entries[name] = (index, dtype, shape, end - begin)
                self._starts[name] = 8 + len(raw) + begin
                self._order.append((index, begin, name))
            try:
                self._handles.append(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as err:  # safetensors checks that the data covers the file exactly
                self.close()
                raise FileFormatError(
                    f"{file} is not a readable safetensors file ({err}); it may be truncated or "
                    "corrupt: copy or download it again"
                ) from err
        self._order.sort()
        self._readahead = Readahead(self.files)
        self.fingerprint = digest.hexdigest()
        """SHA-256 of the files' safetensors headers (names, dtypes, shapes, offsets, metadata):
        it identifies the checkpoint's structure and layout, not its values."""

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self._entries)} tensors, {len(self.files)} file(s))"

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the files (tensors already read stay valid)."""
        for handle in self._handles:
            handle.__exit__(None, None, None)
        self._handles = []
        if hasattr(self, "_readahead"):
            self._readahead.close()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def keys(self) -> list[str]:
        """Tensor names in storage order (file by file, by offset): the order that reads
        sequentially."""
        return [name for _, _, name in self._order]

    def _entry(self, key: str) -> tuple[int, str, tuple[int, ...], int]:
        try:
            return self._entries[key]
        except KeyError:
            raise StructureError(f"{self.path} has no tensor {key!r}") from None

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor ``key`` (from the header; nothing is read)."""
        return self._entry(key)[2]

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype of tensor ``key``."""
        return SAFETENSORS_DTYPES[self._entry(key)[1]]

    def nbytes(self, key: str) -> int:
        """The stored size of tensor ``key`` in bytes."""
        return self._entry(key)[3]

    def file_of(self, key: str) -> Path:
        """The file that holds tensor ``key``."""
        return self.files[self._entry(key)[0]]

    @property
    def metadata(self) -> dict[str, str]:
        """The files' ``__metadata__`` (string pairs), merged."""
        return dict(self._metadata)

    @property
    def total_bytes(self) -> int:
        """The size of all tensors' data."""
        return sum(e[3] for e in self._entries.values())

    def get(
        self,
        key: str,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        rows: slice | None = None,
    ) -> Tensor:
        """Read tensor ``key`` (``rows`` of it only, along its first dimension, when given),
        moved to ``device`` and cast to ``dtype`` when given: only what is returned is read
        and converted."""
        index = self._entry(key)[0]
        if not self._handles:
            raise ValueError(f"{self.path} is closed")
        tensor = self._handles[index].get_tensor(key)  # a view of the mapped file
        if rows is not None:
            tensor = tensor[rows]
        self.bytes_read += tensor.numel() * tensor.element_size()
        if device is not None or dtype is not None:
            tensor = tensor.to(device=device, dtype=dtype)
        return tensor

    def prefetch(self, key: str, rows: slice | None = None) -> None:
        """Start reading tensor ``key`` (``rows`` of it) into the page cache in the background,
        so that a later :meth:`get` finds it there (:mod:`gradmerge.foundation.readahead`; a hint
        only)."""
        index, _, shape, nbytes = self._entry(key)
        start = self._starts[key]
        self._readahead.advise(index, *row_range(start, start + nbytes, shape, rows))

    def rows(self, key: str, indices: list[int]) -> Tensor:
        """Rows ``indices`` of tensor ``key`` (along its first dimension), reading only those
        rows; the whole (0-dim) value when ``indices`` is empty."""
        index = self._entry(key)[0]
        if not self._handles:
            raise ValueError(f"{self.path} is closed")
        if not indices:
            return self.get(key)
        part = self._handles[index].get_slice(key)
        return torch.cat([part[i : i + 1] for i in indices])

    def assets(self) -> list[Path]:
        """Config and tokenizer files beside the weights (empty when ``path`` is a file)."""
        if self.folder is None:
            return []
        return sorted(
            p
            for p in self.folder.iterdir()
            if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in ASSET_PATTERNS)
        )


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a checkpoint lazily: a ``.safetensors`` file, a shard folder or a Hugging Face folder.

    Raises:
        MissingInputError: no such file or folder, or a shard the index names is missing.
        FileFormatError: not safetensors (e.g. PyTorch ``.bin`` weights), a corrupt or truncated
            file, an index that does not match its shards.

    Example:
        >>> import tempfile, torch
        >>> from safetensors.torch import save_file
        >>> from gradmerge.io import open_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.ones(2, 3), "step": torch.tensor(7)}, f"{d}/model.safetensors")
        ...     with open_checkpoint(d) as ckpt:
        ...         print(ckpt.keys(), ckpt.shape("w"), ckpt.dtype("step"), ckpt.get("w", dtype=torch.float64).sum())
        ['step', 'w'] (2, 3) torch.int64 tensor(6., dtype=torch.float64)
    """
    source = Path(path)
    if not source.exists():
        raise MissingInputError(
            f"no checkpoint at {source}: expected a .safetensors file or a folder"
        )
    if source.is_file():
        return Checkpoint(source, [source], None)
    return Checkpoint(source, _folder_files(source), source)


def _folder_files(folder: Path) -> list[Path]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        preferred = folder / "model.safetensors.index.json"
        if preferred not in indexes:
            raise FileFormatError(
                f"{folder} holds several shard indexes {[p.name for p in indexes]}: keep one, or "
                "pass the folder of one model"
            )
        indexes = [preferred]
    if indexes:
        return _indexed_files(indexes[0])
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files
    if len(files) > 1:
        raise FileFormatError(
            f"{folder} holds {len(files)} .safetensors files but no *.safetensors.index.json that "
            "says how they form one model: pass one file, or add the index"
        )
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise FileFormatError(
            f"{folder} holds PyTorch pickle weights (.bin/.pt); gradmerge reads safetensors only. "
            "Convert with transformers: AutoModel.from_pretrained(folder)"
            ".save_pretrained(new_folder) (safetensors is the default)"
        )
    raise FileFormatError(f"{folder} holds no .safetensors weights")


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not a mapping")
    except (ValueError, KeyError, TypeError) as err:
        raise FileFormatError(f"{index} is not a shard index ({err!r})") from err
    names = list(dict.fromkeys(str(v) for v in weight_map.values()))
    files = [index.parent / n for n in names]
    for f in files:
        if not f.is_file():
            raise MissingInputError(f"{index} names shard {f.name}, which is not in {index.parent}")
    stored: dict[str, str] = {}
    for f in files:
        _, header = _read_header(f)
        stored.update({k: f.name for k in header if k != "__metadata__"})
    for key, name in weight_map.items():
        if stored.get(key) != name:
            where = f"in {stored[key]}" if key in stored else "in no shard"
            raise FileFormatError(
                f"{index} puts {key!r} in {name}, but it is {where}: the index and the shards "
                "do not match; save the model again"
            )
    extra = sorted(set(stored) - set(weight_map))
    if extra:
        raise FileFormatError(
            f"the shards in {index.parent} hold {len(extra)} tensor(s) the index does not list, "
            f"e.g. {extra[:3]}: the index and the shards do not match; save the model again"
        )
    return files


def _read_header(file: Path) -> tuple[bytes, dict]:
    """The raw JSON header of a safetensors file, and its parsed form."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise FileFormatError(f"{file} is not a safetensors file: {size} bytes, too short")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise FileFormatError(
                f"{file} is not a safetensors file, or it is truncated: its header claims "
                f"{length} bytes of a {size}-byte file"
            )
        raw = fh.read(length)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
    except (ValueError, TypeError) as err:
        raise FileFormatError(
            f"{file} is not a safetensors file: unreadable header ({err})"
        ) from err
    return raw, header


def _entry(file: Path, name: str, entry: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    try:
        if not isinstance(entry, dict):
            raise TypeError(f"expected a JSON object, got {type(entry).__name__}")
        dtype, offsets = entry["dtype"], entry["data_offsets"]
        shape = tuple(int(s) for s in entry["shape"])
        begin, end = int(offsets[0]), int(offsets[1])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise FileFormatError(f"{file}: damaged header entry for {name!r} ({err!r})") from err
    if dtype not in SAFETENSORS_DTYPES:
        raise FileFormatError(
            f"{file}: tensor {name!r} has dtype {dtype!r}, which gradmerge cannot read"
        )
    return dtype, shape, (begin, end)
