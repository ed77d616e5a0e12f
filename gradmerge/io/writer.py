"""Streaming output: sharded safetensors written tensor by tensor, into a folder made atomically.

Every output tensor's name, shape and dtype is known before the first one is computed, so each
shard's header (names, dtypes, shapes, byte offsets) is written first and the tensors' bytes are
appended as they come: nothing is buffered beyond the tensor being written. Shards follow the
Hugging Face layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with a
``model.safetensors.index.json``.

:func:`staged_output` (:func:`gradmerge.foundation.guard.staged_folder`, the guard every command
writes through) builds the output in a hidden sibling folder and renames it into place only when
everything succeeded: a failing or interrupted run leaves no output folder, never a half-written
one. A killed process can leave the hidden ``.OUT.gradmerge-*`` folder behind; its
name records the owning process, and :func:`remove_stale_stages` removes it once that is gone.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from gradmerge.errors import ArgumentError
from gradmerge.foundation.files import remove_stale_dirs_beside
from gradmerge.foundation.guard import staged_folder
from gradmerge.io.reader import SAFETENSORS_DTYPES

_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
DEFAULT_SHARD_SIZE = 5 * 10**9
"""The largest shard written (bytes) by default: merges' and removals' ``max_shard_size``
(:class:`gradmerge.jobs.options.Options`) and ``gradmerge materialize``'s."""
INDEX_NAME = "model.safetensors.index.json"


class ShardedWriter:
    """Write planned tensors, in plan order, into safetensors shards of at most ``max_shard_size``.

    Args:
        folder: where the shards go (it must exist).
        entries: (name, shape, dtype) of every tensor, in the order they will be written.
        max_shard_size: a shard is closed before it would exceed this many bytes (a single larger
            tensor gets a shard of its own).
        metadata: the shards' ``__metadata__`` (``{"format": "pt"}`` by default, which
            transformers expects).

    Example:
        >>> import tempfile, torch
        >>> from safetensors.torch import load_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     w = ShardedWriter(d, [("a", (2,), torch.float32), ("b", (1,), torch.int64)], 10)
        ...     w.write("a", torch.ones(2)); w.write("b", torch.tensor([3]))
        ...     files = w.finish()
        ...     print([f.name for f in files], load_file(files[1]))
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json'] {'b': tensor([3])}
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
        max_shard_size: int,
        *,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.metadata = metadata if metadata is not None else {"format": "pt"}
        self._shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = []
        size = 0
        for name, shape, dtype in entries:
            if dtype not in _NAMES:
                raise ArgumentError(f"cannot write {name!r}: safetensors has no dtype {dtype}")
            nbytes = math.prod(shape) * dtype.itemsize
            if not self._shards or (size + nbytes > max_shard_size and size > 0):
                self._shards.append([])
                size = 0
            self._shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        n = len(self._shards)
        self.files = [
            self.folder
            / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            for i in range(n)
        ]
        self._queue = [(i, e) for i, shard in enumerate(self._shards) for e in shard]
        self._next = 0
        self._row = 0  # rows of the next tensor written so far (write_rows)
        self._open: BinaryIO | None = None
        self.bytes_written = 0

    def write(self, name: str, tensor: Tensor) -> None:
        """Append tensor ``name`` (the next one in the plan) to its shard."""
        self._check_next(name, tensor, 0, tuple(tensor.shape) == self._planned_shape())
        self._append(tensor, whole=True)

    def write_rows(self, name: str, rows: Tensor, start: int) -> None:
        """Append rows ``start : start + len(rows)`` of tensor ``name`` (the next one in the
        plan), so that a tensor larger than memory can be written a block of rows at a time;
        the blocks come in order, and the tensor is complete when its last row is written.

        Example:
            >>> import tempfile, torch
            >>> from safetensors.torch import load_file
            >>> with tempfile.TemporaryDirectory() as d:
            ...     w = ShardedWriter(d, [("a", (3, 2), torch.float32)], 100)
            ...     w.write_rows("a", torch.zeros(2, 2), 0); w.write_rows("a", torch.ones(1, 2), 2)
            ...     print(load_file(w.finish()[0])["a"].tolist())
            [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
        """
        shape = self._planned_shape()
        fits = rows.dim() > 0 and tuple(rows.shape[1:]) == shape[1:] and len(shape) > 0
        self._check_next(name, rows, start, fits and start + len(rows) <= shape[0])
        self._row = start + len(rows)
        self._append(rows, whole=self._row == shape[0])

    def _planned_shape(self) -> tuple[int, ...]:
        return self._queue[self._next][1][1] if self._next < len(self._queue) else ()

    def _check_next(self, name: str, tensor: Tensor, start: int, fits: bool) -> None:
        """Refuse anything but the planned tensor (or its next rows) in its planned dtype."""
        if self._next >= len(self._queue):
            raise ArgumentError(f"{name!r} was not planned: every planned tensor is written")
        expected, shape, dtype, _ = self._queue[self._next][1]
        if name != expected or tensor.dtype != dtype or start != self._row or not fits:
            due = f" from row {self._row}" if self._row else ""
            given = f" from row {start}" if start else ""
            raise ArgumentError(
                f"expected {expected!r} {shape} {dtype}{due} next, got {name!r} "
                f"{tuple(tensor.shape)} {tensor.dtype}{given}"
            )

    def _append(self, tensor: Tensor, *, whole: bool) -> None:
        shard = self._queue[self._next][0]
        if self._open is None:
            self._open = open(self.files[shard], "wb")  # noqa: SIM115 - closed at the shard's end
            header = _header(self._shards[shard], self.metadata)
            _reserve(self._open, len(header) + sum(e[3] for e in self._shards[shard]))
            self._open.write(header)
            self.bytes_written += len(header)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._open.write(data.numpy().data)
        self.bytes_written += data.numel()
        if not whole:
            return
        self._next, self._row = self._next + 1, 0
        if self._next == len(self._queue) or self._queue[self._next][0] != shard:
            self._open.close()
            self._open = None

    def finish(self) -> list[Path]:
        """Check that every planned tensor was written; write the index when there are shards."""
        if self._next != len(self._queue):
            missing = [e[0] for _, e in self._queue[self._next :]]
            raise ArgumentError(f"{len(missing)} planned tensor(s) not written, e.g. {missing[:3]}")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": sum(e[3] for s in self._shards for e in s)},
                "weight_map": {
                    e[0]: f.name
                    for f, shard in zip(self.files, self._shards, strict=True)
                    for e in shard
                },
            }
            path = self.folder / INDEX_NAME
            path.write_text(json.dumps(index, indent=2) + "\n")
            return [*self.files, path]
        return list(self.files)

    def abort(self) -> None:
        """Close an open shard (the staged folder is removed by :func:`staged_output`)."""
        if self._open is not None:
            self._open.close()
            self._open = None


def _reserve(file: BinaryIO, size: int) -> None:
    """Allocate the shard's blocks up front: a full disk fails here, before its data is
    computed, and the writes that follow allocate no blocks (figures in
    ``benchmarks/README.md``)."""
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(file.fileno(), 0, size)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise OSError(
                err.errno,
                f"no space left for {size:,} bytes of {file.name}: free space or "
                "choose an output folder on another disk",
            ) from err
        # EOPNOTSUPP, EINVAL, ...: the file system cannot reserve; the writes will allocate


def _header(
    shard: list[tuple[str, tuple[int, ...], torch.dtype, int]], metadata: dict[str, str]
) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape, dtype, nbytes in shard:
        entries[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


staged_output = staged_folder
"""The output folder built in a hidden sibling and renamed into place when complete:
:func:`gradmerge.foundation.guard.staged_folder` (the one implementation, shared with every
command)."""


def remove_stale_stages(out_dir: str | os.PathLike[str]) -> tuple[list[Path], list[Path]]:
    """Remove the hidden staging folders of ``out_dir`` left by processes that are gone (killed
    mid-run); returns (removed, left alone because their owner cannot be known).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as d:
        ...     remove_stale_stages(Path(d) / "out")
        ([], [])
    """
    return remove_stale_dirs_beside(Path(out_dir).absolute(), "gradmerge")
